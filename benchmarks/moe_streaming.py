"""MoE expert streaming (--additional-config moe_expert_offload): decode tok/s and peak
memory with the expert cache at 25%, 50% and 100% of the experts, against the model
fully resident; also 25% with prefetch (router guess, last-step guess) and 50% with FIFO
instead of LRU.

Synthetic Qwen3-MoE of a realistic-ish shape with random weights (default: 6 layers,
64 experts, top-8, hidden 1024, expert width 512, float16: 1.2 GB of experts, 2.5% of
the weights outside them), written once with NumPy (models/synthetic_moe.py). Each case
runs in a fresh process (--repeats rounds over the cases, median tok/s): load, a 32-token prompt, 32 greedy tokens for one sequence
(models.generate.greedy_generate, the runner's packed step). Peak RSS is counted from
after the imports (VmHWM reset), MLX peak from load. Random routers pick experts about
uniformly: the worst locality, so hit rates are near the cache fraction; real routers
are skewed. The file sits in the page cache after it is written: "disk" reads here are
memory copies (a cold SSD adds its latency).

    .venv/bin/python benchmarks/moe_streaming.py [--dir /tmp/moe-streaming-bench]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

_CASE = r"""
import json, sys, time
import psutil
import mlx.core as mx
import mlx_lm.utils, vllm_metal.ops, vllm_metal.models.loader, vllm_metal.models.generate  # noqa
from vllm_metal.models import load_model
from vllm_metal.models.expert_offload import OffloadConfig
from vllm_metal.models.generate import greedy_generate
path, option, new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
rss0 = psutil.Process().memory_info().rss
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # restart the peak RSS after the imports
mx.reset_peak_memory()
t0 = time.perf_counter()
lo = load_model(path, "float16", expert_offload=OffloadConfig.parse(option) if option else None)
load_s = time.perf_counter() - t0
steps = []
prompt = [[(7 * i) % 4000 + 3 for i in range(32)]]
out = greedy_generate(lo, prompt, new, block_size=16, prefill_chunk=64, stop_ids=[],
                      step_times=steps)
decode = [s[2] for s in steps if s[1] == 0]
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
s = lo.expert_cache.stats.as_dict() if lo.expert_cache else {}
print(json.dumps(dict(load_s=load_s, decode_tok_s=len(decode) / sum(decode), tokens=out[0],
                      peak_rss=hwm * 1024 - rss0, mlx_peak=mx.get_peak_memory(),
                      cache=lo.expert_cache.nbytes() if lo.expert_cache else 0, **s)))
"""

CASES = [
    ("resident", None),
    ("100%", {"cache_fraction": 1.0}),
    ("50%", {"cache_fraction": 0.5}),
    ("50% fifo", {"cache_fraction": 0.5, "policy": "fifo"}),
    ("25%", {"cache_fraction": 0.25}),
    ("25% fifo", {"cache_fraction": 0.25, "policy": "fifo"}),
    ("25% prefetch", {"cache_fraction": 0.25, "prefetch": True}),
    ("25% prefetch last", {"cache_fraction": 0.25, "prefetch": True, "prefetch_guess": "last"}),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/moe-streaming-bench")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3,
                    help="rounds over all cases (interleaved: drift hits every case alike); "
                         "tok/s is the median")
    ap.add_argument("--cases", nargs="*", help="names of CASES to run (default all)")
    ap.add_argument("--router-skew", type=float, default=0.0,
                    help="> 0: some experts win more often (synthetic_moe.write_qwen3_moe)")
    args = ap.parse_args()
    from vllm_metal.models.synthetic_moe import write_qwen3_moe

    path = Path(args.dir)
    sizes = write_qwen3_moe(path, hidden=args.hidden, inter=args.inter, experts=args.experts,
                            top_k=args.top_k, layers=args.layers, vocab=4096, heads=8, kv_heads=2,
                            head_dim=128, dtype="float16", router_skew=args.router_skew)
    head = {"model": vars(args), **sizes}
    cases = [c for c in CASES if not args.cases or c[0] in args.cases]
    runs = {name: [] for name, _ in cases}
    for _ in range(args.repeats):
        for name, option in cases:
            r = subprocess.run([sys.executable, "-c", _CASE, str(path), json.dumps(option),
                                str(args.new_tokens)], capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"{name}: {r.stderr[-2000:]}")
            runs[name].append(json.loads(r.stdout.strip().splitlines()[-1]))
            print(f"{name}: {runs[name][-1]['decode_tok_s']:.2f} tok/s", file=sys.stderr, flush=True)
    rows, reference, mib = [], None, 2**20
    for name, _ in cases:
        d = runs[name][-1]
        reference = reference or d["tokens"]
        lookups = d.get("hits", 0) + d.get("misses", 0)
        rows.append({
            "case": name,
            "decode_tok_s": round(statistics.median(x["decode_tok_s"] for x in runs[name]), 2),
            "load_s": round(statistics.median(x["load_s"] for x in runs[name]), 2),
            "peak_rss_mib": round(max(x["peak_rss"] for x in runs[name]) / mib),
            "mlx_peak_mib": round(max(x["mlx_peak"] for x in runs[name]) / mib),
            "cache_mib": round(d["cache"] / mib),
            "hit_rate": round(d["hits"] / lookups, 3) if lookups else None,
            "gib_streamed": round(d.get("bytes_streamed", 0) / 2**30, 2),
            "prefetched": d.get("prefetched"), "prefetch_wasted": d.get("prefetch_wasted"),
            "same_tokens": all(x["tokens"] == reference for x in runs[name])})
    print(f"experts {sizes['expert_bytes'] / 2**20:.0f} MiB, other weights "
          f"{sizes['other_bytes'] / 2**20:.0f} MiB")
    print("| " + " | ".join(rows[0]) + " |")
    print("|" + "---|" * len(rows[0]))
    for row in rows:
        print("| " + " | ".join(str(v) for v in row.values()) + " |")
    print("# JSON")
    print(json.dumps(head))
    for row in rows:
        print(json.dumps(row))

if __name__ == "__main__":
    main()
