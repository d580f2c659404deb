"""`vllm serve` on a tiny random-weight gpt-oss checkpoint (dense float32 experts; sliding
and full layers, attention sinks, YaRN; written by transformers), token-exact against
transformers' greedy decoding: a concurrent batch equals each request solo (and
transformers); the same model as a gpt-oss GGUF file with MXFP4 experts, served with its
experts streamed from the file through a cache of 25% of them."""

from __future__ import annotations

import concurrent.futures as cf

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from qwen3_5_checkpoint import write_tokenizer  # noqa: E402
from serving_harness import Server  # noqa: E402
from test_serving_expert_offload import OFFLOAD, expert_metrics  # noqa: E402
from test_models_gpt_oss import write_checkpoint  # noqa: E402
from test_models_qwen3_moe import hf_greedy  # noqa: E402
from test_serving_qwen3_moe import SERVER_ARGS, complete_ids, prompts  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.serving]

VOCAB = 320  # room for the byte-level test tokenizer


def test_concurrent_batch_equals_solo_and_transformers(tmp_path):
    _, hf = write_checkpoint(tmp_path, seed=0, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
    write_tokenizer(tmp_path, VOCAB)
    ps = prompts(2, 6)
    want = hf_greedy(hf, ps, 12)
    assert all(len(set(w)) > 3 for w in want)  # not a degenerate repeat
    s = Server(str(tmp_path), "gpt-oss-tiny", SERVER_ARGS)
    try:
        solo = [complete_ids(s, p, 12) for p in ps]
        with cf.ThreadPoolExecutor(len(ps)) as pool:
            batch = list(pool.map(lambda p: complete_ids(s, p, 12), ps))
        assert batch == solo, s.tail()
        assert solo == want, s.tail()
        assert s.alive()
    finally:
        s.stop()


def test_streamed_mxfp4_gguf_tokens_match_transformers(tmp_path):
    """A llama.cpp gpt-oss GGUF file with MXFP4 experts, served with the experts streamed:
    transformers' tokens on the experts the file holds."""
    from test_models_gpt_oss_gguf import set_experts, write_gguf

    config, hf = write_checkpoint(tmp_path / "hf", seed=7, vocab_size=VOCAB, bos_token_id=1,
                                  eos_token_id=2)
    stored = write_gguf(tmp_path / "hf", config, tmp_path / "tiny-gpt-oss.gguf", "MXFP4")
    set_experts(hf, stored)
    ps = prompts(3, 3)
    want = hf_greedy(hf, ps, 12)
    s = Server(str(tmp_path / "tiny-gpt-oss.gguf"), "gpt-oss-gguf", SERVER_ARGS + OFFLOAD)
    try:
        with cf.ThreadPoolExecutor(len(ps)) as pool:
            got = list(pool.map(lambda p: complete_ids(s, p, 12), ps))
        assert got == want, s.tail()
        counters = expert_metrics(s)  # the experts really came through the bounded cache
        assert counters["cache_misses_total"] > 0 and counters["bytes_streamed_total"] > 0
    finally:
        s.stop()
