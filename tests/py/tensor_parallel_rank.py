"""One rank of a tensor-parallel forward, run as a script by test_tensor_parallel.py:
    MLX_RANK=r MLX_HOSTFILE=h python tensor_parallel_rank.py MODEL OUT.npz
joins the ring, loads MODEL, keeps its shard and feeds the test's sequences through
models.testing.run_packed; rank 0 saves each sequence's logits to OUT.npz."""

import sys

import mlx.core as mx
import numpy as np

from vllm_metal.models import load_model
from vllm_metal.models.tensor_parallel import shard_loaded
from vllm_metal.models.testing import run_packed

SEQUENCES = [np.random.default_rng(n).integers(3, 300, n).tolist() for n in (14, 7, 19, 17)]


def main(model: str, out: str) -> None:
    group = mx.distributed.init(strict=True, backend="ring")
    loaded = load_model(model, "float32")
    shard_loaded(loaded, group)
    logits = run_packed(loaded, SEQUENCES)
    if group.rank() == 0:
        np.savez(out, *logits)


if __name__ == "__main__":
    main(*sys.argv[1:])
