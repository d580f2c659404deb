"""GGUF mat-vec / prefill throughput per type against this machine's copy bandwidth.

Prints one JSON object per line (machine-readable) and a table. Weights are
random valid blocks at real model shapes (SmolLM2-135M / Gemma-3-270M FFN);
GB/s counts the weight bytes read per call, the copy bound is a NumPy memcpy of
a buffer far larger than the caches measured in the same run (median of runs).

    .venv/bin/python benchmarks/gguf_bench.py [--threads N] [--repeats R]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "py"))
from test_gguf_fixtures import SUPPORTED, block_size, random_blocks  # noqa: E402

from vllm_metal import _core  # noqa: E402


def copy_bandwidth(repeats: int) -> float:
    """GB/s of bytes read by a large memcpy (read + write traffic counted once, like a mat-vec)."""
    src = np.ones(64 << 20, dtype=np.uint8)  # 64 MiB
    dst = np.empty_like(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return src.nbytes / statistics.median(times) / 1e9


def bench_matmul(t, m: int, n: int, k: int, repeats: int) -> float:
    blocks = mx.array(random_blocks(t, n, k, seed=1))
    x = mx.array(np.random.default_rng(0).standard_normal((m, k)).astype(np.float32))
    mx.eval(blocks, x)
    for _ in range(2):
        mx.eval(_core.gguf_matmul(x, blocks, t.name, [n, k]))
    inner = max(1, int(2e8 // max(1, blocks.nbytes * max(1, m // 8))))
    inner = min(inner, 200)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            mx.eval(_core.gguf_matmul(x, blocks, t.name, [n, k]))
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times), blocks.nbytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--types", default="", help="comma-separated subset, e.g. Q4_1,Q4_K")
    args = ap.parse_args()
    _core.set_num_threads(args.threads)
    copy = copy_bandwidth(args.repeats * 2)
    print(json.dumps({"bench": "copy", "gbps": round(copy, 2), "threads": _core.num_threads()}))
    types = [t for t in SUPPORTED if not args.types or t.name in args.types.split(",")]
    rows = []
    for t in types:
        k = 2048 if block_size(t) == 256 else 576  # SmolLM2 d=576; K-quants need 256 | k
        n = 1536
        for m in (1, 128):
            sec, nbytes = bench_matmul(t, m, n, k, args.repeats)
            gbps = nbytes / sec / 1e9
            rec = {"bench": "gguf_matmul", "type": t.name, "m": m, "n": n, "k": k,
                   "us": round(sec * 1e6, 1), "weight_gbps": round(gbps, 2),
                   "gflops": round(2 * m * n * k / sec / 1e9, 2), "vs_copy": round(gbps / copy, 3)}
            print(json.dumps(rec))
            rows.append(rec)
    print(f"\ncopy bandwidth {copy:.1f} GB/s, {_core.num_threads()} threads")
    print(f"{'type':8} {'m':>4} {'us':>9} {'GB/s':>7} {'GFLOP/s':>8} {'vs copy':>8}")
    for r in rows:
        print(f"{r['type']:8} {r['m']:>4} {r['us']:>9} {r['weight_gbps']:>7} {r['gflops']:>8} {r['vs_copy']:>8}")


if __name__ == "__main__":
    main()
