"""Our rms_norm / add_rms_norm against MLX's own, side by side in one run.

    ours: vllm_metal.ops.rms_norm(x, w, eps)
          vllm_metal.ops.add_rms_norm(x, r, w, eps) -> (out, h)
    mlx:  mx.fast.rms_norm(x, w, eps)
          h = x + r; mx.fast.rms_norm(h, w, eps)   (plain MLX ops, then fast.rms_norm)

Same arrays, same shapes (SmolLM2-135M hidden 576, Llama-3-8B hidden 4096;
1/16/512/4096 rows), float32/float16/bfloat16, default (CPU) stream. Each call
is built and mx.eval'ed from Python, so both sides pay the same Python and
graph overhead; repetitions of the two sides are interleaved. MLX's buffer
cache is raised to 4 GB (--mlx-cache-limit) so both sides time their kernels,
not page faults on fresh outputs. Reports the median time per call, GB/s of the minimal bytes
the op moves and ratio = mlx time / our time (> 1: ours is faster).

    .venv/bin/python benchmarks/ops_vs_mlx.py [--quick] [--json PATH] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import mlx.core as mx

from vllm_metal import _core, ops

MODELS = [("SmolLM2-135M", 576), ("Llama-3-8B", 4096)]
ROWS = [1, 16, 512, 4096]
DTYPES = [mx.float32, mx.float16, mx.bfloat16]
EPS = 1e-5


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


def measure_group(fns, reps: int, rep_seconds: float) -> list[dict]:
    """Median seconds per call of each fn. Every fn is warmed up and its repetition sized
    to about rep_seconds; then `reps` rounds run one repetition of each fn in turn, so
    load from elsewhere on a shared machine lands on all of them alike."""
    iters = []
    for fn in fns:
        t0 = time.perf_counter()
        fn()  # warm-up: first-call allocations
        estimate = time.perf_counter() - t0
        if estimate < rep_seconds:
            n = 0
            t0 = time.perf_counter()
            while True:
                fn()
                n += 1
                elapsed = time.perf_counter() - t0
                if elapsed >= rep_seconds / 4 or n >= 100000:
                    break
            estimate = elapsed / n
        iters.append(max(1, int(rep_seconds / estimate)))
    per_call = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            for _ in range(iters[i]):
                fn()
            per_call[i].append((time.perf_counter() - t0) / iters[i])
    return [{"median_s": statistics.median(v), "min_s": min(v), "iters": n, "reps": reps}
            for v, n in zip(per_call, iters)]


def max_rel_diff(a: mx.array, b: mx.array) -> float:
    a32, b32 = a.astype(mx.float32), b.astype(mx.float32)
    scale = mx.maximum(mx.max(mx.abs(b32)), mx.array(1e-30))
    return float(mx.max(mx.abs(a32 - b32)) / scale)


def dtype_name(dt) -> str:
    return str(dt).split(".")[-1]


def bench_case(model: str, hidden: int, rows: int, dt, fused: bool, args) -> dict:
    isz = dt.size
    key = mx.random.key(rows * 7 + hidden)
    k1, k2 = mx.random.split(key)
    x = mx.random.uniform(-1, 1, (rows, hidden), key=k1).astype(dt)
    r = mx.random.uniform(-1, 1, (rows, hidden), key=k2).astype(dt)
    w = (1.0 + 0.1 * mx.random.uniform(-1, 1, (hidden,), key=key)).astype(dt)
    mx.eval(x, r, w)

    if fused:
        def ours():
            mx.eval(*ops.add_rms_norm(x, r, w, EPS))

        def theirs():
            h = x + r
            mx.eval(mx.fast.rms_norm(h, w, EPS), h)

        y_ours, h_ours = ops.add_rms_norm(x, r, w, EPS)
        h_ref = x + r
        y_ref = mx.fast.rms_norm(h_ref, w, EPS)
        diff = max(max_rel_diff(y_ours, y_ref), max_rel_diff(h_ours, h_ref))
        nbytes = 4 * rows * hidden * isz + hidden * isz
    else:
        def ours():
            mx.eval(ops.rms_norm(x, w, EPS))

        def theirs():
            mx.eval(mx.fast.rms_norm(x, w, EPS))

        diff = max_rel_diff(ops.rms_norm(x, w, EPS), mx.fast.rms_norm(x, w, EPS))
        nbytes = 2 * rows * hidden * isz + hidden * isz

    t_ours, t_mlx = measure_group([ours, theirs], args.reps, args.rep_seconds)
    mx.clear_cache()
    return {
        "bench": "ops_vs_mlx",
        "op": "add_rms_norm" if fused else "rms_norm",
        "model": model,
        "hidden": hidden,
        "rows": rows,
        "dtype": dtype_name(dt),
        "bytes": nbytes,
        "ours_us": t_ours["median_s"] * 1e6,
        "mlx_us": t_mlx["median_s"] * 1e6,
        "ours_gb_s": nbytes / t_ours["median_s"] / 1e9,
        "mlx_gb_s": nbytes / t_mlx["median_s"] / 1e9,
        "ratio_mlx_over_ours": t_mlx["median_s"] / t_ours["median_s"],
        "max_rel_diff": diff,
        "reps": args.reps,
        "ours_us_min": t_ours["min_s"] * 1e6,
        "mlx_us_min": t_mlx["min_s"] * 1e6,
        "ours_iters": t_ours["iters"],
        "mlx_iters": t_mlx["iters"],
    }


def human_bytes(b: float) -> str:
    if b >= 1e6:
        return f"{b / 1e6:.1f} MB"
    if b >= 1e3:
        return f"{b / 1e3:.1f} KB"
    return f"{b:.0f} B"


def print_table(results: list[dict]) -> None:
    for op in ("rms_norm", "add_rms_norm"):
        mlx_side = "mx.fast.rms_norm" if op == "rms_norm" else "x + r, then mx.fast.rms_norm"
        print(f"\n== {op}: ours vs MLX ({mlx_side}) ==")
        print(f"{'model':<13} {'dtype':<8} {'rows':>5} {'moved':>9} | {'ours us':>9} {'GB/s':>7} | "
              f"{'mlx us':>9} {'GB/s':>7} | {'mlx/ours':>8} {'max rel diff':>12}")
        for r in results:
            if r["op"] != op:
                continue
            print(f"{r['model']:<13} {r['dtype']:<8} {r['rows']:>5} {human_bytes(r['bytes']):>9} | "
                  f"{r['ours_us']:>9.2f} {r['ours_gb_s']:>7.2f} | {r['mlx_us']:>9.2f} "
                  f"{r['mlx_gb_s']:>7.2f} | {r['ratio_mlx_over_ours']:>7.2f}x {r['max_rel_diff']:>12.2e}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="~5 s run: shorter repetitions, rows up to 512")
    p.add_argument("--json", metavar="PATH", help="also write the whole run as one JSON document")
    p.add_argument("--threads", type=int, default=None,
                   help="kernel threads of our ops (default: VLLM_METAL_NUM_THREADS, 0 = all cores)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per case (median reported)")
    p.add_argument("--mlx-cache-limit", type=int, default=4096, metavar="MB",
                   help="MLX's buffer cache limit (default 4096, so outputs beyond MLX's own 32 MB "
                        "are recycled instead of page-faulted on every call; -1 keeps MLX's own)")
    args = p.parse_args(argv)
    args.rep_seconds = 0.003 if args.quick else 0.03
    if args.reps is None:
        args.reps = 3 if args.quick else 7
    if args.threads is not None:
        _core.set_num_threads(args.threads)
    if args.mlx_cache_limit >= 0:
        mx.set_cache_limit(args.mlx_cache_limit << 20)
    mx.set_default_device(mx.cpu)
    cache_limit = mx.set_cache_limit(0)
    mx.set_cache_limit(cache_limit)

    load_before = load_average()
    t_start = time.perf_counter()
    machine = {
        "cpu": cpu_model(),
        "hw_threads": os.cpu_count(),
        "kernel_threads": _core.num_threads(),
        "avx2_fma": bool(_core.has_avx2_fma()),
        "mlx": mx.__version__,
        "python": platform.python_version(),
        "mlx_cache_limit_bytes": cache_limit,
        "load_before": load_before,
    }
    print(f"ops_vs_mlx  cpu: {machine['cpu']}  hw threads: {machine['hw_threads']}  "
          f"kernel threads: {machine['kernel_threads']}  avx2+fma: {'yes' if machine['avx2_fma'] else 'no'}")
    print(f"mlx {mx.__version__}  device: {mx.default_device()}  mlx cache limit: {cache_limit >> 20} MB  "
          f"mode: {'quick' if args.quick else 'full'}  load average: {load_before}")

    results = []
    for model, hidden in MODELS:
        for rows in ROWS:
            if args.quick and rows > 512:
                continue  # --quick: decode and mid-size steps only
            for dt in DTYPES:
                for fused in (False, True):
                    results.append(bench_case(model, hidden, rows, dt, fused, args))
            print(".", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)

    print(f"\nmedian of {args.reps} repetitions; us = microseconds per call (Python call + graph + "
          f"mx.eval); GB/s of the minimal bytes moved; mlx/ours > 1 means ours is faster")
    print_table(results)
    total = time.perf_counter() - t_start
    machine["load_after"] = load_average()

    print("\n# JSON (one object per line)")
    for r in results:
        print(json.dumps(r))
    print(f"\ntotal {total:.1f} s  load average before: {load_before}  after: {machine['load_after']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "mode": "quick" if args.quick else "full",
                       "results": results, "seconds": total}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
