"""`vllm serve` on a tiny random-weight OLMoE checkpoint (2 layers, 8 experts, top-2, hidden
64, written by transformers), token-exact against transformers' greedy decoding: a concurrent
batch equals each request solo (and transformers); the same weights as a llama.cpp olmoe
GGUF file (F32 experts in block form) served with its experts streamed from the file
through a cache of 25% of them (its tokenizer read from a tokenizer-only copy of the
metadata: transformers' GGUF reader refuses the olmoe arch)."""

from __future__ import annotations

import concurrent.futures as cf

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from qwen3_5_checkpoint import write_tokenizer  # noqa: E402
from serving_harness import Server  # noqa: E402
from test_serving_expert_offload import OFFLOAD, expert_metrics  # noqa: E402
from test_models_olmoe import VOCAB, write_checkpoint, write_gguf  # noqa: E402
from test_models_qwen3_moe import hf_greedy  # noqa: E402
from test_serving_qwen3_moe import SERVER_ARGS, complete_ids, prompts  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.serving]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("olmoe")
    config, hf = write_checkpoint(path, seed=0, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
    write_tokenizer(path, VOCAB)
    return path, hf, config


def test_concurrent_batch_equals_solo_and_transformers(checkpoint):
    path, hf, _ = checkpoint
    ps = prompts(2, 6)
    want = hf_greedy(hf, ps, 12)
    assert all(len(set(w)) > 3 for w in want)  # not a degenerate repeat
    s = Server(str(path), "olmoe-tiny", SERVER_ARGS)
    try:
        solo = [complete_ids(s, p, 12) for p in ps]
        with cf.ThreadPoolExecutor(len(ps)) as pool:
            batch = list(pool.map(lambda p: complete_ids(s, p, 12), ps))
        assert batch == solo, s.tail()
        assert solo == want, s.tail()
        assert s.alive()
    finally:
        s.stop()


def test_streamed_gguf_tokens_match_transformers(checkpoint, tmp_path):
    path, hf, config = checkpoint
    gguf_path = write_gguf(path, config, tmp_path / "tiny-olmoe.gguf", "F32")
    ps = prompts(3, 2)
    want = hf_greedy(hf, ps, 12)
    s = Server(str(gguf_path), "olmoe-gguf", SERVER_ARGS + OFFLOAD)
    try:
        got = [complete_ids(s, p, 12) for p in ps]
        assert got == want, s.tail()
        counters = expert_metrics(s)  # the experts really came through the bounded cache
        assert counters["cache_misses_total"] > 0 and counters["bytes_streamed_total"] > 0
    finally:
        s.stop()
