"""Fused MoE (ops.fused_moe / fused_moe_gguf) against one matmul per (token, expert) pair,
on the CPU, side by side.

Synthetic MoE layer of a realistic shape (default: 64 experts, top-8, hidden 1024, expert
width 512, random weights), experts as bfloat16 (dense op) and as Q4_K / Q6_K blocks
(Qwen3-MoE Q4_K_M layout: gate/up Q4_K, down Q6_K) and as MXFP4 blocks (gpt-oss). The baseline runs our own GEMM
(ops.gguf_matmul) per pair, i.e. the same kernels, but each pair re-reads its expert's
weights and pays a dispatch: what a model without a fused op does. The baseline gets its
routing for free (computed outside the timing). Prints one JSON line per case: medians
in ms, ratio = pairs / fused, and the fused op's weight bandwidth (active experts' bytes
read once / time).

    .venv/bin/python benchmarks/moe_bench.py [--experts 64 --top-k 8 --hidden 1024
                                              --inter 512 --tokens 1 8 64 --repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
import numpy as np

from vllm_metal import _core, ops


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def route(logits: np.ndarray, k: int):
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    ids = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, 1)
    return ids, w / w.sum(1, keepdims=True)


def quantized_experts(rng, qtype: str, e: int, rows: int, cols: int) -> np.ndarray:
    """Random valid blocks (uint8 [E * rows, row_bytes]) of a K-quant type."""
    from test_gguf_fixtures import random_blocks  # tests/py helper: sane scales
    import gguf

    return random_blocks(gguf.GGMLQuantizationType[qtype], e * rows, cols, int(rng.integers(1 << 30)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cases", nargs="+", default=["bfloat16", "Q4_K/Q6_K", "MXFP4"])
    args = ap.parse_args()
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "py"))
    e, k, h, i = args.experts, args.top_k, args.hidden, args.inter
    rng = np.random.default_rng(0)
    bf = lambda a: mx.array(a.astype(np.float32)).astype(mx.bfloat16)  # noqa: E731
    wg = bf(rng.standard_normal((e, i, h)) / np.sqrt(h))
    wu = bf(rng.standard_normal((e, i, h)) / np.sqrt(h))
    wd = bf(rng.standard_normal((e, h, i)) / np.sqrt(i))
    gq = mx.array(quantized_experts(rng, "Q4_K", e, i, h))
    uq = mx.array(quantized_experts(rng, "Q4_K", e, i, h))
    dq = mx.array(quantized_experts(rng, "Q6_K", e, h, i))
    mg, mu, md = (mx.array(quantized_experts(rng, "MXFP4", e, r, c)) for r, c in ((i, h), (i, h), (h, i)))
    mx.eval(wg, wu, wd, gq, uq, dq, mg, mu, md)
    # per-expert views for the baseline: the bfloat16 rows as BF16 "blocks", K-quant row slices
    as_bytes = lambda w: w.view(mx.uint8).reshape(w.shape[0], w.shape[1], -1)  # noqa: E731
    dense_views = [as_bytes(w) for w in (wg, wu, wd)]
    q_rows = [gq.reshape(e, i, -1), uq.reshape(e, i, -1), dq.reshape(e, h, -1)]
    mx_rows = [mg.reshape(e, i, -1), mu.reshape(e, i, -1), md.reshape(e, h, -1)]

    for t in args.tokens:
        x = bf(rng.standard_normal((t, h)))
        logits = mx.array(rng.standard_normal((t, e)).astype(np.float32))
        ids, rw = route(np.array(logits), k)
        active = len(set(ids.ravel().tolist()))

        def pairs(views, types):
            out = []
            for ti in range(t):
                xt = x[ti:ti + 1]
                acc = None
                for j in range(k):
                    ex = int(ids[ti, j])
                    g = ops.gguf_matmul(xt, views[0][ex], types[0], [i, h])
                    u = ops.gguf_matmul(xt, views[1][ex], types[1], [i, h])
                    d = ops.gguf_matmul((g * mx.sigmoid(g)) * u, views[2][ex], types[2], [h, i])
                    d = d * float(rw[ti, j])
                    acc = d if acc is None else acc + d
                out.append(acc)
            return mx.concatenate(out)

        cases = {
            "bfloat16": (lambda: ops.fused_moe(x, logits, wg, wu, wd, top_k=k),
                         lambda: pairs(dense_views, ["BF16"] * 3), 2 * 3 * i * h),
            "Q4_K/Q6_K": (lambda: ops.fused_moe_gguf(x, logits, gq, "Q4_K", uq, "Q4_K", dq, "Q6_K",
                                                     inter=i, top_k=k),
                          lambda: pairs(q_rows, ["Q4_K", "Q4_K", "Q6_K"]),
                          2 * i * h * 144 // 256 + h * i * 210 // 256),
            "MXFP4": (lambda: ops.fused_moe_gguf(x, logits, mg, "MXFP4", mu, "MXFP4", md, "MXFP4",
                                                 inter=i, top_k=k),
                      lambda: pairs(mx_rows, ["MXFP4"] * 3), 3 * i * h * 17 // 32),
        }
        for name, (fused, baseline, expert_bytes) in cases.items():
            if name not in args.cases:
                continue
            f_ms = median_ms(fused, args.repeats)
            b_ms = median_ms(baseline, args.repeats)
            print(json.dumps({
                "case": name, "tokens": t, "experts": e, "top_k": k, "hidden": h, "inter": i,
                "active_experts": active, "fused_ms": round(f_ms, 3), "pairs_ms": round(b_ms, 3),
                "ratio": round(b_ms / f_ms, 2),
                "fused_weight_GBps": round(active * expert_bytes / (f_ms * 1e-3) / 1e9, 2),
                "threads": _core.num_threads() if hasattr(_core, "num_threads") else None,
            }), flush=True)


if __name__ == "__main__":
    main()
