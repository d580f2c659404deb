"""apply_token_bitmask against the memory roofline and against MLX ops, in one run.

    copy      numpy copy of a 256 MB buffer, split across threads (read + write bytes
              counted): the roofline every path is compared with (xcopy)
    ours      vllm_metal.ops.apply_token_bitmask(logits, bitmask, rows), logits held by
              the caller: out of place
    donated   the same on logits nothing else holds (a lazy `logits * 1`, the lm head's
              output when serving): in place, only the -infs written; the time includes
              the product
    mul       `logits * 1` alone: subtract it from `donated` for the in-place op's cost
    xgrammar  xgrammar's own MLX kernel (xgrammar.kernels.apply_token_bitmask_mlx: a
              byte-to-8-values table gathered and added, mx.compile'd), all rows masked

Vocab sizes: SmolLM2 (49152), Qwen2.5/Qwen3 (151936), Gemma 3 (262144); 1, 16 and 64 rows,
every row masked; float32 and bfloat16; masks grammar-like (1 token in 200 allowed, whole
words of zeros) and random bits (every word mixed: the worst case of the CPU kernel). GB/s
counts what the op must move out of place: logits read, out written, the mask's words.

    .venv/bin/python benchmarks/token_bitmask_bench.py [--quick] [--json PATH] [--threads N]
                                                       [--reps N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import mlx.core as mx
import numpy as np

from rope_bench import copy_bandwidth, cpu_model, load_average, measure  # noqa: E402
from vllm_metal import _core, ops

VOCABS = [("SmolLM2", 49152), ("Qwen3", 151936), ("Gemma-3", 262144)]
ROWS = [1, 16, 64]
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16}
MASKS = ["grammar", "random"]


def make_mask(kind: str, rows: int, words: int, rng) -> np.ndarray:
    if kind == "random":
        return rng.integers(0, 2**32, size=(rows, words), dtype=np.uint64).astype(np.uint32).view(np.int32)
    allowed = rng.random((rows, words, 32)) < 0.005
    return (allowed.astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(-1).astype(np.uint32).view(np.int32)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="rows <= 16, short repetitions")
    ap.add_argument("--json", help="also write the whole run as one JSON document")
    ap.add_argument("--threads", type=int, default=0, help="kernel threads (0 = all cores)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 7, quick 3)")
    args = ap.parse_args()
    mx.set_default_device(mx.cpu)
    mx.set_cache_limit(2048 << 20)  # outputs recycled, not page-faulted on every call
    reps = args.reps or (3 if args.quick else 7)
    rep_seconds = 0.01 if args.quick else 0.03
    cores = os.cpu_count() or 1
    _core.set_num_threads(args.threads)
    try:
        from xgrammar.kernels.apply_token_bitmask_mlx import apply_token_bitmask_mlx
    except ImportError:
        apply_token_bitmask_mlx = None
    paths = ["ours", "donated", "mul"] + (["xgrammar"] if apply_token_bitmask_mlx else [])

    run = {"cpu": cpu_model(), "cores": cores, "mlx": mx.__version__, "load_before": load_average(),
           "threads": args.threads, "kernel_threads": _core.num_threads()}
    copy_gb_s = copy_bandwidth(256 << 20, cores, reps)
    run["copy_gb_s"] = copy_gb_s
    print(f"# token_bitmask_bench  cpu: {run['cpu']}  cores: {cores}  kernel threads: "
          f"{run['kernel_threads']}  mlx {mx.__version__}  load: {run['load_before']}")
    print(f"# copy 256 MB: {copy_gb_s:.2f} GB/s ({cores} threads)")
    header = f"{'model':8s} {'vocab':>6s} {'rows':>4s} {'mask':7s} |" + "".join(
        f" {p + ' us':>11s} {'xcopy':>5s} |" for p in paths)
    results = []
    rng = np.random.default_rng(0)
    for dname, dtype in DTYPES.items():
        print(f"\n== apply_token_bitmask, {dname} ==")
        print(header)
        for model, vocab in VOCABS:
            for n in [r for r in ROWS if not args.quick or r <= 16]:
                logits = mx.array(rng.standard_normal((n, vocab)).astype(np.float32)).astype(dtype)
                rows = mx.array(np.arange(n, dtype=np.int32))
                for kind in MASKS:
                    mask = mx.array(make_mask(kind, n, (vocab + 31) // 32, rng))
                    mx.eval(logits, mask, rows)
                    nbytes = 2 * logits.nbytes + mask.nbytes
                    fns = {"ours": lambda: mx.eval(ops.apply_token_bitmask(logits, mask, rows)),
                           "donated": lambda: mx.eval(ops.apply_token_bitmask(logits * 1, mask, rows)),
                           "mul": lambda: mx.eval(logits * 1)}
                    if apply_token_bitmask_mlx:
                        fns["xgrammar"] = lambda: mx.eval(apply_token_bitmask_mlx(mask, logits, vocab))
                        theirs = apply_token_bitmask_mlx(mask, logits, vocab)
                        assert mx.array_equal(ops.apply_token_bitmask(logits, mask, rows), theirs).item()
                    timings = measure(fns, reps, rep_seconds)
                    line = f"{model:8s} {vocab:6d} {n:4d} {kind:7s} |"
                    for p in paths:
                        s = timings[p]["median_s"]
                        gb = nbytes / s / 1e9
                        line += f" {s * 1e6:11.1f} {gb / copy_gb_s:5.2f} |"
                        results.append({"op": "apply_token_bitmask", "model": model, "vocab": vocab,
                                        "rows": n, "mask": kind, "dtype": dname, "path": p,
                                        "bytes": nbytes, "us_per_call": s * 1e6,
                                        "us_min": timings[p]["min_s"] * 1e6, "reps": reps,
                                        "gb_s": gb, "ratio_to_copy": gb / copy_gb_s})
                    print(line, flush=True)
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
