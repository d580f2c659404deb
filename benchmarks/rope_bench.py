"""rope against the memory roofline and against what plain MLX offers, in one run.

    copy    numpy copy of a 256 MB buffer, split across threads (read + write
            bytes counted): the roofline every path is compared with (xcopy)
    ours    vllm_metal.ops.rope(x, positions, ...): kernel threads = all cores
    ours1t  the same with one kernel thread
    mlx     mx.fast.rope on the heads-major view mlx-lm uses, one offset per call
            (cannot express per-token positions: timed for cost only)
    gather  plain MLX ops: cos/sin caches gathered by positions, then the NeoX
            rotation -- what per-token positions cost without our op

Shapes: q and k of SmolLM2-135M (9/3 heads x 64, theta 1e5) and Llama-3-8B (32/8
heads x 128, theta 5e5, llama3 scaling) x 1, 16, 512, 4096 tokens, float32 and
bfloat16. Up to 16 tokens model a decode batch (random positions below 4096),
more a prefill (0..T-1). Every call is built and mx.eval'ed from Python, so all
paths pay the same Python and graph overhead. GB/s counts the bytes rope must
move: read x, write out, read positions.

    .venv/bin/python benchmarks/rope_bench.py [--quick] [--json PATH] [--threads N]
                                              [--reps N] [--mlx-cache-limit MB]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time

import mlx.core as mx
import numpy as np

from vllm_metal import _core, ops

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# (model, which, heads, head_size, base, scaling)
SHAPES = [
    ("SmolLM2-135M", "q", 9, 64, 100000.0, None),
    ("SmolLM2-135M", "k", 3, 64, 100000.0, None),
    ("Llama-3-8B", "q", 32, 128, 500000.0, LLAMA3),
    ("Llama-3-8B", "k", 8, 128, 500000.0, LLAMA3),
]
TOKENS = [1, 16, 512, 4096]
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16}
PATHS = ["ours", "ours1t", "mlx", "gather"]
MAX_POSITION = 8192


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


def calibrate(fn, rep_seconds: float) -> int:
    """Calls per repetition of about rep_seconds (after a warm-up call)."""
    fn()  # warm-up: first-call allocations, table cache
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= rep_seconds / 4 or n >= 100000:
            break
    return max(1, int(rep_seconds / (elapsed / n)))


def measure(fns: dict, reps: int, rep_seconds: float) -> dict:
    """Median seconds per call of each function; the repetitions of all functions are
    interleaved (round robin), so a shared machine's load hits every path alike."""
    iters = {name: calibrate(fn, rep_seconds) for name, fn in fns.items()}
    per_call = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(iters[name]):
                fn()
            per_call[name].append((time.perf_counter() - t0) / iters[name])
    return {name: {"median_s": statistics.median(v), "min_s": min(v), "iters": iters[name],
                   "reps": reps} for name, v in per_call.items()}


def copy_bandwidth(nbytes: int, threads: int, reps: int) -> float:
    """GB/s of a threaded numpy copy (read + write counted); numpy drops the GIL."""
    src = np.full(nbytes, 0x5A, dtype=np.uint8)
    dst = np.zeros_like(src)
    bounds = np.linspace(0, nbytes, threads + 1, dtype=np.int64)

    def part(i):
        np.copyto(dst[bounds[i]:bounds[i + 1]], src[bounds[i]:bounds[i + 1]])

    def copy():
        workers = [threading.Thread(target=part, args=(i,)) for i in range(1, threads)]
        for w in workers:
            w.start()
        part(0)
        for w in workers:
            w.join()

    t = measure({"copy": copy}, reps, 0.3)["copy"]
    return 2 * nbytes / t["median_s"] / 1e9


def gather_rope(x, positions, cos_cache, sin_cache):
    """NeoX rope from per-token cos/sin rows, in plain MLX ops (float32 math)."""
    half = cos_cache.shape[-1]
    cos = cos_cache[positions][:, None, :]  # [T, 1, half]
    sin = sin_cache[positions][:, None, :]
    x1 = x[..., :half].astype(mx.float32)
    x2 = x[..., half:].astype(mx.float32)
    out = mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tokens <= 512, short repetitions")
    ap.add_argument("--json", help="also write the whole run as one JSON document")
    ap.add_argument("--threads", type=int, default=0, help="kernel threads (0 = all cores)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 7, quick 3)")
    ap.add_argument("--mlx-cache-limit", type=int, default=2048,
                    help="MLX buffer cache in MB (default 2048, so the 4096-token outputs are "
                         "recycled instead of freshly page-faulted on every call)")
    args = ap.parse_args()
    mx.set_cache_limit(args.mlx_cache_limit << 20)
    reps = args.reps or (3 if args.quick else 7)
    rep_seconds = 0.01 if args.quick else 0.03
    tokens = [t for t in TOKENS if not args.quick or t <= 512]
    cores = os.cpu_count() or 1
    _core.set_num_threads(args.threads)

    run = {"cpu": cpu_model(), "cores": cores, "mlx": mx.__version__,
           "load_before": load_average(), "threads": args.threads,
           "kernel_threads": _core.num_threads(), "avx2_fma": _core.has_avx2_fma(),
           "mlx_cache_limit_mb": args.mlx_cache_limit}
    copy_gb_s = copy_bandwidth(256 << 20, cores, reps)
    copy1_gb_s = copy_bandwidth(256 << 20, 1, reps)
    run["copy_gb_s"] = copy_gb_s
    run["copy_1t_gb_s"] = copy1_gb_s
    print(f"# rope_bench  cpu: {run['cpu']}  cores: {cores}  kernel threads: "
          f"{run['kernel_threads']}  mlx {mx.__version__}  load: {run['load_before']}")
    print(f"# copy 256 MB: {copy_gb_s:.2f} GB/s ({cores} threads), {copy1_gb_s:.2f} GB/s (1 thread)")

    results = []
    rng = np.random.default_rng(0)
    header = f"{'model':13s} {'x':2s} {'shape':7s} {'dtype':8s} {'toks':>5s} |" + "".join(
        f" {p + ' us':>10s} {'GB/s':>6s} {'xcopy':>5s} |" for p in PATHS)
    for dname, dtype in DTYPES.items():
        print(f"\n== rope, {dname} ==")
        print(header)
        for model, which, heads, d, base, scaling in SHAPES:
            inv, _ = _core.rope_inv_freq(d, base=base, scaling=scaling)
            angles = np.arange(MAX_POSITION)[:, None] * np.array(inv)[None, :]
            cos_cache = mx.array(np.cos(angles).astype(np.float32))
            sin_cache = mx.array(np.sin(angles).astype(np.float32))
            for t in tokens:
                x = mx.array(rng.standard_normal((t, heads, d)).astype(np.float32)).astype(dtype)
                if t <= 16:
                    pos_np = rng.integers(0, 4096, size=t)
                else:
                    pos_np = np.arange(t)
                positions = mx.array(pos_np.astype(np.int64))
                offset = int(pos_np[0])
                x_heads_major = x.transpose(1, 0, 2)  # what mlx-lm hands fast.rope
                mx.eval(x, positions, cos_cache, sin_cache)
                nbytes = 2 * x.nbytes + positions.nbytes

                def ours():
                    mx.eval(ops.rope(x, positions, base=base, scaling=scaling))

                def mlx_rope():
                    if scaling is None:
                        y = mx.fast.rope(x_heads_major, d, traditional=False, base=base,
                                         scale=1.0, offset=offset)
                    else:
                        y = mx.fast.rope(x_heads_major, d, traditional=False, base=None,
                                         scale=1.0, offset=offset, freqs=periods)
                    mx.eval(y)

                def gather():
                    mx.eval(gather_rope(x, positions, cos_cache, sin_cache))

                def ours1t():
                    _core.set_num_threads(1)
                    ours()
                    _core.set_num_threads(args.threads)

                periods = mx.array(1.0 / np.array(inv), dtype=mx.float32)
                timings = measure({"ours": ours, "ours1t": ours1t, "mlx": mlx_rope,
                                   "gather": gather}, reps, rep_seconds)
                # sanity: ours against the gather path (same definition, float32 caches)
                y = ops.rope(x, positions, base=base, scaling=scaling).astype(mx.float32)
                g = gather_rope(x, positions, cos_cache, sin_cache).astype(mx.float32)
                diff = float(mx.abs(y - g).max().item())
                line = f"{model:13s} {which:2s} {f'{heads}x{d}':7s} {dname:8s} {t:5d} |"
                for p in PATHS:
                    s = timings[p]["median_s"]
                    gb = nbytes / s / 1e9
                    line += f" {s * 1e6:10.2f} {gb:6.2f} {gb / copy_gb_s:5.2f} |"
                    results.append({"op": "rope", "model": model, "x": which, "heads": heads,
                                    "head_size": d, "dtype": dname, "tokens": t, "path": p,
                                    "bytes": nbytes, "us_per_call": s * 1e6,
                                    "us_min": timings[p]["min_s"] * 1e6,
                                    "iters": timings[p]["iters"], "reps": reps,
                                    "gb_s": gb, "ratio_to_copy": gb / copy_gb_s,
                                    "max_abs_diff_vs_gather": diff})
                print(line, flush=True)
    copy_end_gb_s = copy_bandwidth(256 << 20, cores, reps)
    run["copy_end_gb_s"] = copy_end_gb_s
    print(f"\n# copy 256 MB at the end: {copy_end_gb_s:.2f} GB/s ({cores} threads); xcopy used "
          f"{copy_gb_s:.2f} (the start)")
    run["load_after"] = load_average()
    run["results"] = results
    print(f"\n# load average after: {run['load_after']}")
    print("# JSON")
    print(json.dumps({k: v for k, v in run.items() if k != "results"}))
    for r in results:
        print(json.dumps(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(run, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
