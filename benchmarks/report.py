"""Markdown tables from the --json files of kernel_bench and ops_vs_mlx.py.

    .venv/bin/python benchmarks/report.py kernel.json [ops_vs_mlx.json]

Used to write docs/benchmarks.md; prints to stdout.
"""

from __future__ import annotations

import json
import sys

PATHS = ("mlx", "raw", "raw1t")


def human_bytes(b: float) -> str:
    if b >= 1e6:
        return f"{b / 1e6:.1f} MB"
    if b >= 1e3:
        return f"{b / 1e3:.1f} KB"
    return f"{b:.0f} B"


def kernel_tables(doc: dict) -> None:
    m = doc["machine"]
    print(f"Run: {doc['mode']}, kernel threads {m['kernel_threads']} (--threads {m.get('threads_flag', 0)}), "
          f"MLX cache limit {m.get('mlx_cache_limit_bytes', 0) >> 20} MB, load average before "
          f"{m.get('load_before', '?')}, after {m.get('load_after', '?')}, {doc['seconds']:.1f} s.\n")
    print("| kind | buffer | threads | ms/pass | GB/s |")
    print("|---|---:|---:|---:|---:|")
    for b in doc["bandwidth"]:
        print(f"| {b['kind']} | {human_bytes(b['buffer_bytes'])} | {b['threads']} | "
              f"{b['us_per_call'] / 1e3:.2f} | {b['gb_s']:.2f} |")
    if doc.get("dispatch"):
        print("\n| parallel_for, no work: set_num_threads | threads | µs/call |")
        print("|---|---:|---:|")
        for d in doc["dispatch"]:
            label = f"{d['threads_setting']}" + (" (auto)" if d["threads_setting"] == 0 else "")
            print(f"| {label} | {d['threads']} | {d['us_per_call']:.2f} |")
    results = doc["results"]
    index = {(r["op"], r["model"], r["rows"], r["dtype"], r["path"]): r for r in results}
    for op in ("rms_norm", "add_rms_norm", "reshape_and_cache"):
        rows_word = "tokens" if op == "reshape_and_cache" else "rows"
        print(f"\n**{op}** (µs per call, GB/s, × copy roofline)\n")
        print(f"| model | dtype | {rows_word} | moved | mlx µs | GB/s | ×copy | raw µs | GB/s | ×copy | "
              f"raw1t µs | GB/s | ×copy |")
        print("|---|---|---:|---:|" + "---:|" * 9)
        seen = []
        for r in results:
            k = (r["model"], r["rows"], r["dtype"])
            if r["op"] != op or k in seen:
                continue
            seen.append(k)
            cells = []
            for p in PATHS:
                x = index.get((op, *k, p))
                if x is None:
                    cells += ["-", "-", "-"]
                    continue
                mark = " !" if x.get("cache_in_place") is False else ""
                cells += [f"{x['us_per_call']:.2f}{mark}", f"{x['gb_s']:.2f}", f"{x['ratio_to_copy']:.2f}"]
            print(f"| {k[0]} | {k[2]} | {k[1]} | {human_bytes(r['bytes'])} | " + " | ".join(cells) + " |")


def mlx_tables(doc: dict) -> None:
    m = doc["machine"]
    print(f"Run: {doc['mode']}, kernel threads {m['kernel_threads']}, MLX cache limit "
          f"{m['mlx_cache_limit_bytes'] >> 20} MB, load average before {m['load_before']}, after "
          f"{m.get('load_after', '?')}, {doc['seconds']:.1f} s.")
    for op in ("rms_norm", "add_rms_norm"):
        theirs = "mx.fast.rms_norm" if op == "rms_norm" else "x + r, then mx.fast.rms_norm"
        print(f"\n**{op}** — ours vs {theirs}\n")
        print("| model | dtype | rows | moved | ours µs | GB/s | MLX µs | GB/s | MLX/ours | max rel diff |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in doc["results"]:
            if r["op"] != op:
                continue
            print(f"| {r['model']} | {r['dtype']} | {r['rows']} | {human_bytes(r['bytes'])} | "
                  f"{r['ours_us']:.1f} | {r['ours_gb_s']:.2f} | {r['mlx_us']:.1f} | {r['mlx_gb_s']:.2f} | "
                  f"{r['ratio_mlx_over_ours']:.2f}× | {r['max_rel_diff']:.1e} |")


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    for path in argv:
        with open(path) as f:
            doc = json.load(f)
        if doc["results"] and doc["results"][0].get("bench") == "ops_vs_mlx":
            mlx_tables(doc)
        else:
            kernel_tables(doc)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
