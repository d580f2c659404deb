"""Served Qwen3-MoE with --additional-config moe_expert_offload, a cache of 25% of the
experts: greedy tokens equal transformers' (as the fully resident server's do,
test_serving_qwen3_moe.py), from safetensors and from a GGUF file, a concurrent batch
equals solo, and the cache's counters appear on /metrics and count; a non-MoE model with
the option is refused at startup."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from qwen3_5_checkpoint import write_tokenizer  # noqa: E402
from serving_harness import Server  # noqa: E402
from test_models_qwen3_moe import hf_greedy, write_checkpoint  # noqa: E402
from test_serving_qwen3_moe import SERVER_ARGS, VOCAB, complete_ids, prompts  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.serving]

OFFLOAD = ["--additional-config", json.dumps({"moe_expert_offload": {"cache_fraction": 0.25}})]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe_offload")
    config, hf = write_checkpoint(path, seed=0, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
    write_tokenizer(path, VOCAB)
    return path, hf, config


@pytest.fixture(scope="module")
def server(checkpoint):
    s = Server(str(checkpoint[0]), "qwen3_moe-streamed", SERVER_ARGS + OFFLOAD)
    yield s
    s.stop()


def expert_metrics(server) -> dict:
    text = server.client.get("/metrics").text
    out = {}
    for name in ("cache_hits_total", "cache_misses_total", "bytes_streamed_total", "cache_hit_rate"):
        m = re.search(rf"^vllm_metal:moe_expert_{name} ([0-9.e+]+)$", text, re.M)
        assert m, f"vllm_metal:moe_expert_{name} not on /metrics"
        out[name] = float(m.group(1))
    return out


def test_streamed_tokens_match_transformers_and_metrics_count(server, checkpoint):
    ps = prompts(1, 3)
    want = hf_greedy(checkpoint[1], ps, 16)
    got = [complete_ids(server, p, 16) for p in ps]
    assert got == want, server.tail()
    before = expert_metrics(server)
    assert before["cache_misses_total"] > 0 and before["bytes_streamed_total"] > 0
    complete_ids(server, ps[0], 8)
    after = expert_metrics(server)
    lookups = lambda m: m["cache_hits_total"] + m["cache_misses_total"]  # noqa: E731
    assert lookups(after) > lookups(before)
    assert after["bytes_streamed_total"] >= before["bytes_streamed_total"]
    assert after["cache_hit_rate"] == pytest.approx(after["cache_hits_total"] / lookups(after))


def test_streamed_concurrent_batch_equals_solo(server, checkpoint):
    ps = prompts(2, 6)
    want = hf_greedy(checkpoint[1], ps, 12)
    with cf.ThreadPoolExecutor(len(ps)) as pool:
        got = list(pool.map(lambda p: complete_ids(server, p, 12), ps))
    assert got == want, server.tail()
    assert server.alive()


def test_streamed_gguf_served_tokens_match_transformers(checkpoint, tmp_path):
    from test_models_qwen3_moe_gguf import write_gguf

    path, hf, config = checkpoint
    gguf_path = write_gguf(path, config, tmp_path / "tiny-qwen3moe.gguf", "F32")
    ps = prompts(3, 2)
    want = hf_greedy(hf, ps, 12)
    s = Server(str(gguf_path), "qwen3_moe-gguf-streamed", SERVER_ARGS + OFFLOAD)
    try:
        got = [complete_ids(s, p, 12) for p in ps]
        assert got == want, s.tail()
        assert expert_metrics(s)["cache_misses_total"] > 0
    finally:
        s.stop()


def test_non_moe_model_refused_at_startup(tmp_path):
    from vllm_metal.models.testing import tiny_config, write_random_checkpoint

    write_random_checkpoint(tiny_config("qwen3", vocab_size=VOCAB), tmp_path)
    write_tokenizer(tmp_path, VOCAB)
    vllm = Path(sys.executable).with_name("vllm")
    r = subprocess.run([str(vllm), "serve", str(tmp_path), "--port", "18431", *SERVER_ARGS,
                        *OFFLOAD], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert "moe_expert_offload with a model without mixture-of-experts layers" in r.stdout + r.stderr
