"""The encoder's two heavy ops against torch, op by op, at all-MiniLM-L6-v2's shapes.

    projections  ops.gguf_matmul on float32 weights (type F32: what GGUFLinear runs on the
                 CPU) against torch.nn.functional.linear (MKL sgemm), x [T, k] @ W[n, k]^T
                 for MiniLM's four projections, T = 512 / 4096 / 16384 rows (32 x 16,
                 256 x 16, 32 x 512 tokens).
    attention    ops.varlen_attention (bidirectional, packed) against torch's
                 scaled_dot_product_attention on [B, 12, L, 32], L = 16 / 128 / 512.

Times are CPU seconds of the process (time.process_time), best of --reps, one thread each
by default: the work each side does, much less sensitive to other jobs on a shared machine
than wall time (our pool's spinning workers would count too, hence one thread). Reported as
GMAC/s (multiply-adds per CPU second) and ours / torch.

    .venv/bin/python benchmarks/encoder_ops.py [--threads 1] [--reps 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
import numpy as np


def best(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()

    import torch

    from vllm_metal import _core, ops

    torch.set_num_threads(a.threads)
    _core.set_num_threads(a.threads)
    rows = []
    print(f"# CPU seconds, best of {a.reps}, {a.threads} thread(s)")
    print("| op | shape | ours GMAC/s | torch GMAC/s | ours / torch |")
    print("|---|---|---:|---:|---:|")
    for t in (512, 4096, 16384):
        for k, n in ((384, 1152), (384, 384), (384, 1536), (1536, 384)):
            x = mx.random.normal((t, k))
            w = mx.random.normal((n, k)) * 0.05
            mx.eval(x, w)
            blocks = mx.view(w, mx.uint8)
            tx, tw = torch.from_numpy(np.array(x)), torch.from_numpy(np.array(w))
            ours = best(lambda: mx.eval(ops.gguf_matmul(x, blocks, "F32", [n, k], exact=True)), a.reps)
            ref = best(lambda: torch.nn.functional.linear(tx, tw), a.reps)
            rows.append(dict(op="projection", shape=f"T={t} {k}->{n}", macs=t * k * n, ours_s=ours, torch_s=ref))
    for b, length in ((256, 16), (32, 128), (8, 512)):
        t = b * length
        q, k_, v = (mx.random.normal((t, 12, 32)) for _ in range(3))
        mx.eval(q, k_, v)
        cu = mx.array(np.arange(b + 1, dtype=np.int32) * length)
        tq, tk, tv = (torch.from_numpy(np.array(z)).reshape(b, length, 12, 32).transpose(1, 2).contiguous()
                      for z in (q, k_, v))
        ours = best(lambda: mx.eval(ops.varlen_attention(q, k_, v, cu_seqlens=cu, scale=32 ** -0.5)), a.reps)
        ref = best(lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv), a.reps)
        rows.append(dict(op="attention", shape=f"{b} x {length}, 12 heads x 32", macs=b * 12 * length * length * 64,
                         ours_s=ours, torch_s=ref))
    for r in rows:
        r["ours_gmacs"] = r["macs"] / r["ours_s"] / 1e9
        r["torch_gmacs"] = r["macs"] / r["torch_s"] / 1e9
        print(f"| {r['op']} | {r['shape']} | {r['ours_gmacs']:.1f} | {r['torch_gmacs']:.1f} | "
              f"{r['torch_s'] / r['ours_s']:.2f} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(threads=a.threads, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
