"""Lane use of the fused Metal decoder layer's kernels, counted in the emulator.

For one decoder layer of SmolLM2-135M (Q4_1, and Q8_0) and of Gemma-3-270M (Q4_K_M: each
projection in the type its file stores), at 1 and 8 decode rows, runs plan_decoder_layer
once in the emulator's counting build and prints each launch's lane use (device loads
summed over lanes / (32 x the busiest lane's, per simdgroup); 1.0: no lane idles while a
sibling loads; mslemu.accounting.LaunchCounts.lane_use) next to the per-op gguf_matvec
kernel's at the same k. Nothing is timed: the counts are exact and machine-independent.

    .venv/bin/python benchmarks/metal_decoder_layer_lanes.py [--m 1 8] [--dtype float16]
"""

from __future__ import annotations

import argparse

from vllm_metal import kernel_traffic as kt

# (model, types of q, k, v, o, gate, up, down, hidden, heads, kv heads, head_dim, intermediate,
#  gemma layout)
MODELS = [
    ("SmolLM2-135M Q4_1", ("Q4_1",) * 7, 576, 9, 3, 64, 1536, False),
    ("SmolLM2-135M Q8_0", ("Q8_0",) * 7, 576, 9, 3, 64, 1536, False),
    ("Gemma-3-270M Q4_K_M", ("Q5_0", "Q5_0", "Q8_0", "Q4_K", "Q5_0", "Q5_0", "Q6_K"), 640, 4, 1,
     256, 2048, True),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8], help="decode rows")
    ap.add_argument("--dtype", default="float16")
    a = ap.parse_args()
    print("| model | m | kernel | k | lane use | gguf_matvec at k |")
    print("|---|---|---|---|---|---|")
    for model, types, *dims in MODELS:
        for m in a.m:
            hidden, heads, kv_heads, head_dim, inter, gemma = dims
            case = kt.decoder_layer(types, a.dtype, m, hidden, heads, kv_heads, head_dim, inter,
                                    ctx=40, sandwich=gemma)
            for r in kt.decoder_layer_lanes(case):
                print(f"| {model} | {m} | {r['kernel']} | {r['k']} | {r['lane_use']:.3f} "
                      f"| {r['gguf_matvec']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
