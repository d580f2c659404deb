"""What batch-invariant mode costs the Metal kernels, from the emulator's counts.

For SmolLM2-135M shapes (Q4_1, float16 activations, 9/3 heads of 64) every case runs its
real plan in the emulator's counting build twice, with ``ops.set_batch_invariant`` off and
on, and reports per case: launches, threadgroups, unique device bytes (the DRAM floor with
perfect caches), re-read bytes (every load and store, simdgroup broadcasts once: cache
traffic), simdgroup-matrix multiply-accumulates and the longest run of keys one simdgroup
walks (attention's critical path). No Mac was used: these are counts, not times.

    .venv/bin/python benchmarks/metal_batch_invariance.py            # JSON + rewrites the table
    .venv/bin/python benchmarks/metal_batch_invariance.py --no-write

The table goes into docs/kernels.md between the metal_batch_invariance marker comments.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vllm_metal import _core
from vllm_metal import kernel_traffic as kt

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "kernels.md"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_sections import write_section  # noqa: E402

HIDDEN, HQ, HKV, HEAD, FFN = 576, 9, 3, 64, 1536
DT = "float16"
SAMPLED_N = 128  # weight rows of ffn_up emulated (counts scale linearly with n)
DEFAULT_PARTITION, INVARIANT_PARTITION = 512, 1024  # paged_attention.h


def gguf_case(m: int):
    return lambda: kt.gguf_matvec("Q4_1", DT, m, SAMPLED_N, HIDDEN)


def attention_case(q_lens, seq_lens):
    def make():
        ps = INVARIANT_PARTITION if _core.batch_invariant() else DEFAULT_PARTITION
        return kt.paged_attention(DT, q_lens, seq_lens, HQ, HKV, HEAD, partition_size=ps)
    return make


CASES = [
    # (label, factory, scale of the counts to the full op)
    ("ffn_up 1536x576 m=1 (decode, batch 1)", gguf_case(1), FFN / SAMPLED_N),
    ("ffn_up m=16 (decode, concurrency 16)", gguf_case(16), FFN / SAMPLED_N),
    ("ffn_up m=64", gguf_case(64), FFN / SAMPLED_N),
    ("ffn_up m=512 (prefill chunk)", gguf_case(512), FFN / SAMPLED_N),
    ("attention 16 decode rows, ctx 1024", attention_case([1] * 16, [1024] * 16), 1.0),
    ("attention 1 decode row, ctx 4096", attention_case([1], [4096]), 1.0),
    ("attention 16 decode rows, ctx 4096", attention_case([1] * 16, [4096] * 16), 1.0),
    ("attention prefill chunk of 256, ctx 256", attention_case([256], [256]), 1.0),
    ("attention 15 decode rows ctx 512 + chunk of 64 at ctx 512",
     attention_case([1] * 15 + [64], [512] * 16), 1.0),
]


def longest_key_run(case) -> int:
    """Keys one simdgroup walks at most: 4 simdgroups share a decode row's partition, a
    prefill simdgroup walks its tile's keys alone."""
    span = int(max(case.arrays[4]))  # the longest context (seq_lens)
    runs = []
    for launch in case.plan:
        if "decode" in launch.kernel:
            parts = launch.grid[2]
            runs.append(-(-min(span, -(-span // parts) if parts > 1 else span) // 4))
        elif "prefill" in launch.kernel:
            runs.append(span)
    return max(runs, default=0)


def measure_case(label, make, scale):
    out = {"case": label}
    for mode in ("off", "on"):
        _core.set_batch_invariant(mode == "on")
        case = make()
        m = kt.measure(case)
        out[mode] = {
            "kernels": [l.kernel for l in case.plan],
            "launches": len(case.plan),
            "threadgroups": round(sum(c.threadgroups for c in m.launches) * scale),
            "unique": round(m.unique * scale),
            "simd": round(m.simd * scale),
            "matrix_macs": round(sum(c.matrix_macs for c in m.launches) * scale),
            "simd_ops": round(sum(c.simd_ops for c in m.launches) * scale),
            "key_run": longest_key_run(case) if "attention" in label else None,
        }
    _core.set_batch_invariant(False)
    return out


def table(rows) -> str:
    out = [
        "SmolLM2-135M shapes, float16, counted in the emulator (`benchmarks/metal_batch_invariance.py`); "
        "ffn_up counts scaled from 128 of its 1536 weight rows. unique: distinct device bytes "
        "(DRAM floor); re-read: every load and store, simdgroup broadcasts once (cache traffic); "
        "MACs: simdgroup-matrix multiply-adds; key run: keys one simdgroup walks in sequence.",
        "",
        "| case | kernels off → on | threadgroups off / on | unique MB off / on | re-read MB off / on "
        "| matrix MACs off / on | key run off / on |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    short = lambda ks: "+".join(k.split("_")[1] if k.startswith("gguf") else k.split("_")[2] for k in ks)  # noqa: E731
    for r in rows:
        a, b = r["off"], r["on"]
        mb = lambda x: f"{x / 2**20:.2f}"  # noqa: E731
        run = "" if a["key_run"] is None else f"{a['key_run']} / {b['key_run']}"
        out.append(
            f"| {r['case']} | {short(a['kernels'])} → {short(b['kernels'])} | {a['threadgroups']} / "
            f"{b['threadgroups']} | {mb(a['unique'])} / {mb(b['unique'])} | {mb(a['simd'])} / "
            f"{mb(b['simd'])} | {a['matrix_macs']} / {b['matrix_macs']} | {run} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/kernels.md")
    args = ap.parse_args()
    rows = [measure_case(*c) for c in CASES]
    print(json.dumps(rows, indent=1))
    text = table(rows)
    print(text)
    if not args.no_write:
        write_section(DOC, "metal_batch_invariance", text)


if __name__ == "__main__":
    main()
