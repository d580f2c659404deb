"""`vllm serve` on a tiny random-weight Qwen3-MoE checkpoint (2 layers, 8 experts, top-2,
hidden 64, written by transformers), token-exact against transformers' greedy decoding
on the same weights: requests one at a time, then a concurrent batch (equal to solo);
and the same weights as a llama.cpp qwen3moe GGUF file (F32 experts in block form)."""

from __future__ import annotations

import concurrent.futures as cf

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from qwen3_5_checkpoint import write_tokenizer  # noqa: E402
from serving_harness import Server  # noqa: E402
from test_models_qwen3_moe import hf_greedy, write_checkpoint  # noqa: E402
from test_models_qwen3_moe_gguf import write_gguf  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.serving]

VOCAB = 320  # room for the byte-level test tokenizer
# float32: vLLM's dtype "auto" would serve a float32 checkpoint in half precision
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "8",
               "--num-gpu-blocks-override", "64", "--max-num-batched-tokens", "32"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    config, hf = write_checkpoint(path, seed=0, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
    write_tokenizer(path, VOCAB)
    return path, hf, config


@pytest.fixture(scope="module")
def server(checkpoint):
    s = Server(str(checkpoint[0]), "qwen3_moe-tiny", SERVER_ARGS)
    yield s
    s.stop()


def complete_ids(server, prompt: list[int], max_tokens: int) -> list[int]:
    r = server.client.post("/v1/completions", json={
        "model": server.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "return_token_ids": True, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, int(rng.integers(3, 40))).tolist() for _ in range(n)]


def test_served_tokens_match_transformers(server, checkpoint):
    ps = prompts(1, 3)
    want = hf_greedy(checkpoint[1], ps, 16)
    assert all(len(set(w)) > 3 for w in want)  # not a degenerate repeat
    got = [complete_ids(server, p, 16) for p in ps]
    assert got == want, server.tail()


def test_concurrent_batch_equals_solo(server, checkpoint):
    ps = prompts(2, 6)
    want = hf_greedy(checkpoint[1], ps, 12)
    with cf.ThreadPoolExecutor(len(ps)) as pool:
        got = list(pool.map(lambda p: complete_ids(server, p, 12), ps))
    assert got == want, server.tail()
    assert server.alive()


def test_served_gguf_tokens_match_transformers(checkpoint, tmp_path):
    path, hf, config = checkpoint
    gguf_path = write_gguf(path, config, tmp_path / "tiny-qwen3moe.gguf", "F32")
    ps = prompts(3, 2)
    want = hf_greedy(hf, ps, 12)
    s = Server(str(gguf_path), "qwen3_moe-gguf", SERVER_ARGS)
    try:
        got = [complete_ids(s, p, 12) for p in ps]
        assert got == want, s.tail()
    finally:
        s.stop()
