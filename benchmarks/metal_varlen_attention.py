"""The tiled Metal varlen_attention against the one-simdgroup-per-row kernel, from the
emulator's counts.

Encoder attention (BERT family, EmbeddingGemma) at embedding shapes: one sequence per case,
one q head of each kv head, float16. Each case runs the planner's launch (the tiled kernel for
head sizes in ``_core.varlen_attention_tiled_head_sizes()``) and the same problem on the
simd kernel in the emulator's counting build, checks that both give the same output, and
reports per kernel: threadgroups, device loads issued (every load of every lane, a
simdgroup's broadcast counted once: cache traffic), distinct device bytes (the DRAM floor),
simd collectives (the per-key ``simd_sum``), simdgroup-matrix multiply-accumulates and
threadgroup barriers. Counts scale linearly with the number of sequences and heads of a
batch. No Mac was used: these are counts, not times.

    .venv/bin/python benchmarks/metal_varlen_attention.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import types

import numpy as np

from vllm_metal import _core, emulation

DTYPE = "float16"

CASES = [
    # (label, sequence length, head size, window)
    ("MiniLM, 16 tokens", 16, 32, 0),
    ("MiniLM, 128 tokens", 128, 32, 0),
    ("MiniLM, 512 tokens", 512, 32, 0),
    ("BERT-base / BGE, 512 tokens", 512, 64, 0),
    ("EmbeddingGemma, 512 tokens, window 257", 512, 256, 257),
]


def _simd_launch(tiled, num_tokens: int, num_q_heads: int):
    """The tiled plan's launch, on the simd kernel: one simdgroup per (row, q head)."""
    return types.SimpleNamespace(
        source=tiled.source, constants=tiled.constants, buffers=tiled.buffers, args=tiled.args,
        args_index=tiled.args_index, threadgroup=tiled.threadgroup,
        threadgroup_memory=tiled.threadgroup_memory,
        kernel=f"varlen_attention_{DTYPE}", grid=[num_tokens, num_q_heads, 1])


def _counts(plan, arrays):
    counts: list = []
    emulation.run_plan(plan, arrays, counts=counts)
    (c,) = counts
    d = c.device
    return {"threadgroups": c.threadgroups, "loads_simd_bytes": d.read_simd,
            "unique_bytes": d.read_unique + d.written_unique, "simd_ops": c.simd_ops,
            "matrix_macs": c.matrix_macs, "barriers": c.barriers}


def run_case(length: int, d: int, window: int) -> dict:
    rng = np.random.default_rng(length + d)
    hq = hkv = 1
    q, k, v = (rng.standard_normal((length, h, d)).astype(np.float16) for h in (hq, hkv, hkv))
    cu = np.array([0, length], np.int32)
    (tiled,) = _core.plan_varlen_attention(DTYPE, length, 1, hq, hkv, d, d ** -0.5,
                                           window=window, max_seq_len=length)
    assert "tiled" in tiled.kernel, tiled.kernel
    outs, rows = [], {}
    for name, launch in (("simd", _simd_launch(tiled, length, hq)), ("tiled", tiled)):
        out = np.zeros_like(q)
        rows[name] = _counts([launch], [q, k, v, cu, out])
        outs.append(out.astype(np.float32))
    np.testing.assert_allclose(outs[1], outs[0], atol=2e-3, rtol=2e-3)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results = []
    print("| case | kernel | threadgroups | loads (simd, MB) | distinct (MB) | simd ops (M) | matrix MACs (M) | barriers |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for label, length, d, window in CASES:
        rows = run_case(length, d, window)
        results.append({"case": label, "length": length, "head_size": d, "window": window, **rows})
        for name, r in rows.items():
            print(f"| {label} | {name} | {r['threadgroups']} | {r['loads_simd_bytes'] / 1e6:.2f} | "
                  f"{r['unique_bytes'] / 1e6:.3f} | {r['simd_ops'] / 1e6:.2f} | "
                  f"{r['matrix_macs'] / 1e6:.2f} | {r['barriers']} |", flush=True)
        s, t = rows["simd"], rows["tiled"]
        print(f"| {label} | simd / tiled loads | | {s['loads_simd_bytes'] / t['loads_simd_bytes']:.1f}x | | | | |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
