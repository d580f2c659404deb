"""--seed (vLLM's default 0) seeds the draws of requests that name no seed, as vLLM's workers
do: the same `vllm serve` command, sent the same unseeded requests one after another, gives
the same samples after a restart. (Before, unseeded requests drew from OS entropy.)"""

from __future__ import annotations

import pytest

from serving_harness import Server

pytestmark = [pytest.mark.slow, pytest.mark.serving]

ARGS = ["--max-model-len", "256", "--num-gpu-blocks-override", "32"]
PROMPTS = ["Once upon a time", "My favourite food is", "The weather today"]


def _samples() -> list[str]:
    from vllm_metal.models.offline import smollm2_gguf

    server = Server(str(smollm2_gguf()), "smollm2", ARGS)
    try:
        texts = []
        for prompt in PROMPTS:
            r = server.client.post("/v1/completions", json={
                "model": server.name, "prompt": prompt, "max_tokens": 16, "temperature": 1.0})
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        return texts
    finally:
        server.stop()


def test_unseeded_requests_sample_the_same_after_a_restart():
    first = _samples()
    assert len(set(first)) == len(PROMPTS)
    assert _samples() == first
