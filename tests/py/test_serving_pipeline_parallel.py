"""--pipeline-parallel-size 2 served on loopback: two stage workers under vLLM's
multiprocessing executor, hidden states sent stage to stage on MLX's ring. Reference: the
same checkpoint served by one process (parallel_reference.py, shared with the tensor
parallel tests); greedy tokens must match exactly. Async scheduling (vLLM's default: the
last stage sends the sampled tokens back on the ring) on every model, on three stages for
the tiny llama; without it (the scheduler sends them back) on the tiny llama."""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from parallel_reference import (ARGS, JOBS, PER_OP, SYNC, VOCAB, assert_same_greedy, counter,
                                one_process_reference, serve_jobs, shared_tiny_llama)

pytestmark = pytest.mark.slow

# Async: beside JOBS, three requests of 60 tokens (4 blocks of 16 each), in a pool of 9
# blocks (vLLM keeps one back: 8 hold the 128 tokens of --max-model-len): requests are
# preempted and recomputed while
# their tokens are in flight on the ring. Their reference: mlx-lm's llama on the same files.
LONG_JOBS = [(np.random.default_rng(100 + i).integers(3, VOCAB, 20).tolist(), 40) for i in range(3)]
SMALL_POOL = [a if a != "48" else "9" for a in ARGS]


def mlx_lm_greedy(checkpoint, jobs) -> list[list[int]]:
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(checkpoint))
    out = []
    for prompt, n in jobs:
        cache = make_prompt_cache(model)
        logits, tokens = model(mx.array([prompt]), cache=cache), []
        for _ in range(n):
            tokens.append(int(mx.argmax(logits[0, -1]).item()))
            logits = model(mx.array([tokens[-1:]]), cache=cache)
        out.append(tokens)
    return out


@pytest.mark.parametrize("scheduling, stages", [("async", 3), ("sync", 2)])
def test_pipeline_parallel_greedy_matches_one_process(scheduling, stages):
    """Async on three stages, one layer each: the sampled tokens go back stage by stage
    (the ring reaches neighbours only). Sync on two (PP=2 async: the models below)."""
    pp = ["--pipeline-parallel-size", str(stages)]
    if scheduling == "async":  # vLLM's default
        out, server = serve_jobs(shared_tiny_llama(), pp, SMALL_POOL, JOBS + LONG_JOBS)
        assert counter(server.metrics, "vllm:num_preemptions_total") > 0
        assert [t for t, _ in out[len(JOBS):]] == mlx_lm_greedy(shared_tiny_llama(), LONG_JOBS)
    else:
        out, server = serve_jobs(shared_tiny_llama(), SYNC + pp)
    log = server.log_path.read_text()
    splits = {2: ["0-1", "2-2"], 3: ["0-0", "1-1", "2-2"]}[stages]
    assert all(f"pipeline stage {i} of {stages}: layers {s}" in log for i, s in enumerate(splits))
    assert re.search(rf"scheduling +{scheduling}\n", log)  # the startup summary
    # the same ops, but vLLM keeps several batches in flight under PP: requests share steps
    # differently, and a row's sums can depend on its batch (last-bit differences)
    assert_same_greedy(one_process_reference(), out[:len(JOBS)], atol=1e-5)


def test_pipeline_parallel_smollm2_q4_1_matches_one_process():
    from vllm_metal.models.offline import OFFLINE_GGUF

    gguf = str(OFFLINE_GGUF["smollm2"]())
    args = ["--max-model-len", "256", "--max-num-seqs", "4", "--num-gpu-blocks-override", "32"]
    jobs = [(p, 8) for p in ("The capital of France is", "Water boils at",
                             "1, 2, 3, 4,", "My favourite food is")]
    one, _ = serve_jobs(gguf, SYNC, args, jobs, env=PER_OP)
    two, _ = serve_jobs(gguf, ["--pipeline-parallel-size", "2"], args, jobs)
    assert_same_greedy(one, two, atol=1e-3)


def test_pipeline_parallel_hybrid_qwen3_5_matches_mlx_lm(tmp_path):
    """The hybrid Qwen3.5 split into stages of layers 0-1 and 2-3 (each a gated delta net
    and a full-attention layer): each stage keeps the state slots and KV cache of its own
    layers. Reference: mlx-lm's own model on the same files, request by request."""
    import numpy as np
    from qwen3_5_checkpoint import CONFIG, greedy, reference_model, write_checkpoint

    checkpoint = write_checkpoint(tmp_path / "qwen3_5", config=dict(
        CONFIG, full_attention_interval=2, layer_types=["linear_attention", "full_attention"] * 2))
    rng = np.random.default_rng(5)
    # chunked prefills (32-token budget) beside decodes, as in the llama test
    jobs = [(rng.integers(3, 320, n).tolist(), m) for n, m in [(5, 12), (45, 8), (20, 10), (33, 6)]]
    two, server = serve_jobs(checkpoint, ["--pipeline-parallel-size", "2"], jobs=jobs)
    log = server.log_path.read_text()
    assert "pipeline stage 0 of 2: layers 0-1" in log and "pipeline stage 1 of 2: layers 2-3" in log
    reference = reference_model(checkpoint)
    for (tokens, _), (prompt, n) in zip(two, jobs, strict=True):
        assert tokens == greedy(reference, prompt, n)
