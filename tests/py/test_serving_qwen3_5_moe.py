"""`vllm serve` on a tiny random-weight Qwen3.5-MoE checkpoint (hybrid gated delta net +
attention, every MLP 8 experts top-2 plus a gated shared expert, hidden 64), in the
published layout (Qwen3_5MoeForConditionalGeneration, served text-only, fused
experts.gate_up_proj), token-exact against mlx-lm's own qwen3_5_moe forward on the same
files: one request, then concurrent waves that a 16-block pool forces to preempt, then
shared-prefix prompts through the prefix cache; and the same weights as a qwen35moe GGUF file."""

from __future__ import annotations

import concurrent.futures as cf

import pytest

from qwen3_5_checkpoint import MOE_CONFIG, greedy, reference_model, write_checkpoint
from serving_harness import Server
from test_serving_qwen3_5 import (SERVER_ARGS, assert_preempted, check_concurrent, complete_ids,
                                  jobs, prefix_hits, shared_prefix_jobs)

pytestmark = [pytest.mark.slow, pytest.mark.serving]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("qwen3_5_moe_vl"), seed=0, config=MOE_CONFIG,
                            vision_language=True)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return reference_model(checkpoint)


@pytest.fixture(scope="module")
def server(checkpoint):
    s = Server(str(checkpoint), "qwen3_5_moe-tiny", [*SERVER_ARGS, "--enable-prefix-caching"])
    yield s
    s.stop()


def test_single_request_matches_mlx_lm(server, reference):
    prompt = jobs(7, 1)[0][0] + list(range(40, 60))  # prefilled in chunks of 32
    tokens = complete_ids(server, prompt, 20)
    assert tokens == greedy(reference, prompt, 20)
    assert len(set(tokens)) > 3  # not a degenerate checkpoint


def test_concurrent_requests_with_preemption_match_mlx_lm(server, reference):
    check_concurrent(server, reference, seed=1)
    assert_preempted(server)


def test_prefix_caching_is_exact(server, reference):
    before = prefix_hits(server)
    work = shared_prefix_jobs(5, 6)
    want = [greedy(reference, p, n) for p, n in work]
    assert complete_ids(server, *work[0]) == want[0]
    with cf.ThreadPoolExecutor(len(work) - 1) as pool:
        got = list(pool.map(lambda j: complete_ids(server, *j), work[1:]))
    assert got == want[1:]
    assert prefix_hits(server) > before


def test_qwen35moe_gguf_file_is_served(tmp_path, reference):
    """`vllm serve file.gguf`: the same weights as a llama.cpp qwen35moe file (F32, so the
    tokens are the reference's; experts in block form), concurrent requests."""
    from qwen3_5_checkpoint import random_model, write_gguf

    gguf = write_gguf(random_model(seed=0, config=MOE_CONFIG), tmp_path / "qwen35moe.gguf",
                      config=MOE_CONFIG)
    s = Server(str(gguf), "qwen3_5_moe-gguf", ["--dtype", "float32", "--max-model-len", "128",
                                               "--max-num-seqs", "4", "--num-gpu-blocks-override",
                                               "32"],
               env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    try:
        work = jobs(5, 4)
        want = [greedy(reference, p, n) for p, n in work]
        with cf.ThreadPoolExecutor(len(work)) as pool:
            got = list(pool.map(lambda j: complete_ids(s, *j), work))
        assert got == want
    finally:
        s.stop()


def test_mtp_speculation_matches_mlx_lm(tmp_path, reference):
    """The checkpoint's MTP block (an MoE layer here) drafts; tokens stay mlx-lm's greedy ones."""
    import json

    from test_serving_qwen3_5 import draft_tokens, jobs

    ckpt = write_checkpoint(tmp_path / "mtp", seed=0, config=MOE_CONFIG, mtp=True)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    s = Server(str(ckpt), "qwen3_5_moe-tiny", [*SERVER_ARGS, "--speculative-config", json.dumps(spec)])
    try:
        work = jobs(15, 3)
        with cf.ThreadPoolExecutor(len(work)) as pool:
            got = list(pool.map(lambda j: complete_ids(s, *j), work))
        metrics = s.client.get("/metrics").text
    finally:
        s.stop()
    assert got == [greedy(reference, p, n) for p, n in work]
    assert draft_tokens(metrics) >= 2 * 15
