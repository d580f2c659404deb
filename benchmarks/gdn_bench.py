"""Gated delta rule (and its causal conv1d) on the CPU against the memory bound of the state.

A GDN layer must read and write every scheduled request's float32 state [Hv, Dv, Dk] once
per step, so a decode step can be no faster than 2 * state bytes / memory bandwidth. The
bandwidth is measured here as a numpy copy split across threads (read + write bytes).

    decode    N requests x 1 token, recurrent kernel; GB/s = 2 * N * state bytes / time
    prefill   1 request x T tokens, recurrent and chunked (64) forms; tokens/s, and the
              state bound (state read + written once: negligible) is not the limit -- the
              flops are, so GFLOP/s is reported (4 Dv Dk flops per token and head for the
              recurrence)
    conv      causal_conv1d over the same rows (channels = 2 Hk Dk + Hv Dv)

Shapes: Qwen3.5/Qwen3-Next linear attention (Hk 16, Hv 32, Dk = Dv = 128: 2 MiB of state
per request and layer), and a small one (Hk 2, Hv 4, Dk = Dv = 64).

    .venv/bin/python benchmarks/gdn_bench.py [--quick] [--json PATH] [--reps N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import mlx.core as mx
import numpy as np

from vllm_metal import _core, ops

SHAPES = {"qwen3.5": (16, 32, 128, 128), "small": (2, 4, 64, 64)}


def copy_bandwidth(threads: int, mb: int = 256) -> float:
    """GB/s of a numpy copy (read + write bytes), split across `threads`."""
    src = np.ones(mb * 2**20 // 4, np.float32)
    dst = np.empty_like(src)
    parts = np.array_split(np.arange(src.size), threads)
    bounds = [(p[0], p[-1] + 1) for p in parts]

    def work(lo, hi):
        np.copyto(dst[lo:hi], src[lo:hi])

    best = float("inf")
    for _ in range(5):
        ts = [threading.Thread(target=work, args=b) for b in bounds]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best / 1e9


def timed(fn, reps: int) -> float:
    """median seconds of fn() (evaluated), after one warm-up."""
    mx.eval(fn())
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def inputs(lengths, hk, hv, dk, dv, seed=0):
    rng = np.random.default_rng(seed)
    t = int(sum(lengths))
    f = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    cu = mx.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    slots = mx.arange(len(lengths), dtype=mx.int32)
    state = mx.zeros((len(lengths), hv, dv, dk))
    args = dict(q=f(t, hk, dk), k=f(t, hk, dk), v=f(t, hv, dv), a=f(t, hv), b=f(t, hv),
                A_log=f(hv), dt_bias=f(hv))
    mx.eval(state, cu, slots, *args.values())
    return args, state, cu, slots


def bench_gdn(shape, lengths, method, reps):
    hk, hv, dk, dv = SHAPES[shape]
    args, state, cu, slots = inputs(lengths, hk, hv, dk, dv)
    holder = {"state": state}

    def step():
        # the state is updated in place (inplace=True), as a serving loop would
        y, holder["state"] = ops.gated_delta_rule(**args, state=holder.pop("state"),
                                                  cu_seqlens=cu, slots=slots, method=method,
                                                  inplace=True)
        return y, holder["state"]

    return timed(step, reps), len(lengths) * hv * dv * dk * 4


def bench_conv(shape, lengths, reps):
    hk, hv, dk, dv = SHAPES[shape]
    c = 2 * hk * dk + hv * dv
    rng = np.random.default_rng(1)
    t = int(sum(lengths))
    x = mx.array(rng.standard_normal((t, c)).astype(np.float32))
    w = mx.array(rng.standard_normal((c, 4)).astype(np.float32))
    cu = mx.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    slots = mx.arange(len(lengths), dtype=mx.int32)
    holder = {"state": mx.zeros((len(lengths), c, 3))}
    mx.eval(x, w, cu, slots, holder["state"])

    def step():
        out, holder["state"] = ops.causal_conv1d(x, w, None, conv_state=holder.pop("state"),
                                                 cu_seqlens=cu, slots=slots, inplace=True)
        return out, holder["state"]

    return timed(step, reps), 2 * x.nbytes + 2 * holder["state"].nbytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    threads = _core.num_threads()
    bw = copy_bandwidth(threads, 64 if a.quick else 256)
    rows = []
    print(f"kernel threads {threads}; numpy copy bandwidth {bw:.1f} GB/s (read + write)")
    print("\n| shape | step | requests x tokens | method | ms | GB/s state | % of copy | tokens/s | GFLOP/s |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|")
    decode_ns = [1, 4, 16] if a.quick else [1, 4, 16, 64]
    prefill_ts = [256] if a.quick else [256, 2048]
    for shape in SHAPES:
        hk, hv, dk, dv = SHAPES[shape]
        cases = [("decode", [1] * n, "recurrent") for n in decode_ns]
        cases += [("prefill", [t], m) for t in prefill_ts for m in ("recurrent", "chunked")]
        for kind, lengths, method in cases:
            sec, state_bytes = bench_gdn(shape, lengths, method, a.reps)
            tokens = sum(lengths)
            gbs = 2 * state_bytes / sec / 1e9
            gflops = 4 * hv * dv * dk * tokens / sec / 1e9
            row = dict(shape=shape, step=kind, requests=len(lengths), tokens=tokens,
                       method=method, ms=sec * 1e3, state_gbs=gbs, pct_copy=100 * gbs / bw,
                       tokens_per_s=tokens / sec, gflops=gflops)
            rows.append(row)
            print(f"| {shape} | {kind} | {len(lengths)} x {tokens // len(lengths)} | {method} | "
                  f"{sec * 1e3:.3f} | {gbs:.1f} | {100 * gbs / bw:.0f}% | {tokens / sec:,.0f} | "
                  f"{gflops:.1f} |")
    print("\n| shape | conv1d rows | requests | ms | GB/s (x, out, state) | % of copy |")
    print("|---|---:|---:|---:|---:|---:|")
    for shape in SHAPES:
        for lengths in ([1] * 16, [2048] if not a.quick else [256]):
            sec, nbytes = bench_conv(shape, lengths, a.reps)
            gbs = nbytes / sec / 1e9
            rows.append(dict(shape=shape, step="conv1d", requests=len(lengths),
                             tokens=sum(lengths), ms=sec * 1e3, gbs=gbs))
            print(f"| {shape} | {sum(lengths)} | {len(lengths)} | {sec * 1e3:.3f} | {gbs:.1f} | "
                  f"{100 * gbs / bw:.0f}% |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(copy_gbs=bw, threads=threads, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
