"""One decode step of 16 sequences on SmolLM2-135M Q4_1 GGUF (block form, float32 sums),
in process, with 0, 1 and 4 distinct LoRA adapters among the rows (rank 8, on every
q/k/v/o/gate/up/down projection), on the fused decoder layers (adapter steps pass their
slots to the fused op) and on the per-op path (LoraLinear after each projection: how
adapter steps ran before they joined the fused op). Best of --iters steps per cell, the
cells taking turns (a shared machine's load moves them alike; the best is the least
disturbed). No server, no scheduler: the model forward alone.

    .venv/bin/python benchmarks/lora_step.py [--rank 8] [--context 64] [--iters 30]
        [--dtype float32|float16] [--cpu-time]

--dtype float16 is what the server runs (vLLM's dtype=auto for the GGUF); --cpu-time times
each step by the process's CPU time instead of wall time (on a machine shared with other
work: waits for a core do not count; run it with VLLM_METAL_NUM_THREADS=1, as the pool's
spinning threads would count too).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "py"))
from lora_checkpoint import write_adapter  # noqa: E402
from lora_overhead import CONCURRENCY, projection_shapes  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--context", type=int, default=64, help="tokens already in each sequence")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--cpu-time", action="store_true", help="process CPU time per step")
    args = ap.parse_args()
    from vllm_metal.lora.manager import LoraManager
    from vllm_metal.models import load_model
    from vllm_metal.models.generate import KVPool, SeqChunk, build_step
    from vllm_metal.models.offline import smollm2_gguf

    gguf = str(smollm2_gguf())
    weights, n = projection_shapes(gguf)
    tmp = Path(tempfile.mkdtemp(prefix="lora_step_"))
    for i in range(4):
        write_adapter(tmp / f"a{i}", weights, n, r=args.rank, alpha=2 * args.rank, seed=i)
    loaded = load_model(gguf, args.dtype, int8_activations=False)
    model = loaded.model
    lora = LoraManager(model, SimpleNamespace(max_loras=4, max_lora_rank=args.rank, max_cpu_loras=4))
    requests = [SimpleNamespace(lora_int_id=i + 1, lora_name=f"a{i}", lora_path=str(tmp / f"a{i}"),
                                load_inplace=False) for i in range(4)]
    for r in requests:
        lora.add(r)
    pool = KVPool(loaded.spec, CONCURRENCY * (args.context // 16 + 2), 16)
    tables = [[] for _ in range(CONCURRENCY)]
    for t in tables:
        pool.allocate(t, args.context + 1)
    step = build_step([SeqChunk([7], args.context, t) for t in tables], pool.kv_caches, 16)
    ids = [f"r{i}" for i in range(CONCURRENCY)]
    cu = np.array(step.ctx.cu_seqlens_q)
    plans = {"0 adapters": [None] * CONCURRENCY, "1 adapter": [requests[0]] * CONCURRENCY,
             "4 adapters": [requests[i % 4] for i in range(CONCURRENCY)]}
    fused = model._fused_layers()
    assert fused, "SmolLM2 runs fused decoder layers"

    def run(adapters, per_op: bool) -> float:
        object.__setattr__(model, "_fused_plan", [] if per_op else fused)
        for rid, r in zip(ids, adapters):
            lora.request_added(rid, r)
        clock = time.process_time if args.cpu_time else time.perf_counter
        t0 = clock()
        lora.begin_step(ids, cu)
        try:
            mx.eval(model(step.input_ids, step.ctx))
        finally:
            lora.end_step()
        return clock() - t0

    cells = {f"{path}, {label}": (adapters, path == "per-op")
             for path in ("fused", "per-op") for label, adapters in plans.items()}
    best = {c: float("inf") for c in cells}
    for c, (adapters, per_op) in cells.items():
        run(adapters, per_op)  # warm-up
    for _ in range(args.iters):
        for c, (adapters, per_op) in cells.items():
            best[c] = min(best[c], run(adapters, per_op))
    ref = best["fused, 0 adapters"]
    print(f"| step of {CONCURRENCY} decode rows ({args.dtype}) | best of {args.iters} "
          f"({'CPU ' if args.cpu_time else ''}ms) | tok/s | vs base |")
    print("|---|---:|---:|---:|")
    for c, t in best.items():
        print(f"| {c} | {t * 1e3:.2f} | {CONCURRENCY / t:.0f} | {ref / t:.2f} |")


if __name__ == "__main__":
    main()
