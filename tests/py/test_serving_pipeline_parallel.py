"""--pipeline-parallel-size 2 served on loopback: two stage workers under vLLM's
multiprocessing executor, hidden states sent stage to stage on MLX's ring. Reference: the
same checkpoint served by one process; greedy tokens must match exactly. Pipeline
parallelism runs without async scheduling (platform.py refuses the combination: its
message is checked in test_pipeline_parallel.py)."""

from __future__ import annotations

import numpy as np
import pytest

from test_serving_tensor_parallel import serve_jobs, tiny_llama

SYNC = ["--no-async-scheduling"]
# the stages run the per-op path (fused_layers.py): so does the one-process reference
PER_OP = {"VLLM_METAL_FUSED_LAYERS": "0"}


def assert_same_greedy(one, two, atol):
    for (tokens1, lp1), (tokens2, lp2) in zip(one, two, strict=True):
        assert tokens2 == tokens1
        np.testing.assert_allclose(lp2, lp1, atol=atol)


@pytest.mark.slow
def test_pipeline_parallel_greedy_matches_one_process(tmp_path):
    checkpoint = tiny_llama(tmp_path / "llama", num_hidden_layers=3)  # stages of 2 and 1 layers
    one, _ = serve_jobs(checkpoint, SYNC, env=PER_OP)
    two, server = serve_jobs(checkpoint, SYNC + ["--pipeline-parallel-size", "2"])
    log = server.log_path.read_text()
    assert "pipeline stage 0 of 2: layers 0-1" in log and "pipeline stage 1 of 2: layers 2-2" in log
    # the same ops, but vLLM keeps 2 batches in flight under PP: requests share steps
    # differently, and a row's sums can depend on its batch (last-bit differences)
    assert_same_greedy(one, two, atol=1e-5)


@pytest.mark.slow
def test_pipeline_parallel_smollm2_q4_1_matches_one_process():
    from vllm_metal.models.offline import OFFLINE_GGUF

    gguf = str(OFFLINE_GGUF["smollm2"]())
    args = ["--max-model-len", "256", "--max-num-seqs", "4", "--num-gpu-blocks-override", "32"] + SYNC
    jobs = [(p, 8) for p in ("The capital of France is", "Water boils at",
                             "1, 2, 3, 4,", "My favourite food is")]
    one, _ = serve_jobs(gguf, [], args, jobs, env=PER_OP)
    two, _ = serve_jobs(gguf, ["--pipeline-parallel-size", "2"], args, jobs)
    assert_same_greedy(one, two, atol=1e-3)
