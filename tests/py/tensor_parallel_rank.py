"""One rank of a tensor-parallel forward, run as a script by test_tensor_parallel.py and
test_tensor_parallel_qwen3_5.py:
    MLX_RANK=r MLX_HOSTFILE=h python tensor_parallel_rank.py OUT.npz MODEL [MODEL ...]
joins the ring once; for each MODEL loads it, keeps its shard and feeds the test's
sequences through models.testing.run_packed (a hybrid Qwen3.5: greedy decoding of HYBRID_PROMPTS through
qwen3_5_checkpoint.run_packed_greedy); rank 0 saves each sequence's logits to OUT.npz
(model j's sequence i as "m{j}_{i}"). Several models per run: one process start for all."""

import sys

import mlx.core as mx
import numpy as np

from vllm_metal.models import load_model
from vllm_metal.models.tensor_parallel import shard_loaded
from vllm_metal.models.testing import run_packed

SEQUENCES = [np.random.default_rng(n).integers(3, 300, n).tolist() for n in (14, 7, 19, 17)]
# decode rows beside chunked prefills (5-token chunks), several requests per step
HYBRID_PROMPTS = [np.random.default_rng(n).integers(3, 300, n).tolist() for n in (11, 4, 17, 1)]
HYBRID_STEPS = 6


def run(loaded) -> list[np.ndarray]:
    """Per sequence: its logits rows (the hybrid model's: one per greedy step)."""
    if loaded.hybrid is None:
        return run_packed(loaded, SEQUENCES)
    from qwen3_5_checkpoint import run_packed_greedy

    _, rows = run_packed_greedy(loaded, HYBRID_PROMPTS, HYBRID_STEPS)
    return [np.stack(r) for r in rows]


def main(out: str, *models: str) -> None:
    group = mx.distributed.init(strict=True, backend="ring")
    logits = {}
    for j, model in enumerate(models):
        loaded = load_model(model, "float32")
        shard_loaded(loaded, group)
        logits.update({f"m{j}_{i}": rows for i, rows in enumerate(run(loaded))})
    if group.rank() == 0:
        np.savez(out, **logits)


if __name__ == "__main__":
    main(*sys.argv[1:])
