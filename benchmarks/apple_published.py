"""Published Apple GPU figures the step model uses: the cost of a dispatch, llama.cpp's
measured decode rates, and the chips of that table. Facts with their sources; no code
or prose copied.
"""

from __future__ import annotations

# Per-dispatch cost. ml-explore/mlx issue #4521 (M3 Ultra, mlx 0.32.2): "a synthetic chain
# of 3,200 tiny dependent kernels goes from 8.8 ms to 7.7 ms per step at 200 ops per
# buffer", i.e. 2.75 us per dependent dispatch with MLX's default command-buffer limits
# (2.4 us with fewer command-buffer boundaries). Our steps run under the defaults.
DISPATCH_US = 8.8e3 / 3200
DISPATCH_SOURCE = "https://github.com/ml-explore/mlx/issues/4521"

# llama.cpp, "Performance of llama.cpp on Apple Silicon M-series" (ggml-org/llama.cpp
# discussion #4167): LLaMA-2 7B, llama-bench tg128 (batch 1, 128 generated tokens from an
# empty context), Metal, all layers on the GPU. Q4_0 TG in tokens/s, with the table's
# bandwidth and GPU cores. Values as transcribed from the discussion's summary table
# (rows cross-checked: M1 7c/8c, M1 Pro 14c, M3 Pro 18c appear verbatim in excerpts).
LLAMA_CPP_SOURCE = "https://github.com/ggml-org/llama.cpp/discussions/4167"
# (chip, GPU cores, GB/s, Q4_0 tg128 tok/s)
LLAMA_CPP_Q4_0_TG = [
    ("M1", 8, 68, 14.15),
    ("M1 Pro", 16, 200, 36.41),
    ("M1 Max", 32, 400, 61.19),
    ("M2", 10, 100, 21.91),
    ("M2 Pro", 19, 200, 38.86),
    ("M2 Max", 38, 400, 65.95),
    ("M2 Ultra", 76, 800, 94.27),
    ("M3", 10, 100, 21.34),
    ("M3 Pro", 18, 150, 30.74),
    ("M3 Max", 40, 400, 66.31),
    ("M4", 10, 120, 24.11),
    ("M4 Pro", 20, 273, 50.74),
    ("M4 Max", 40, 546, 83.06),
]

# GPU clock per generation (GHz) for the fp16 rate = cores x 128 ALUs x 2 x clock; Apple
# GPUs issue fp16 FMAs at the fp32 rate (philipturner/metal-benchmarks). M1 1.278 (M1
# Pro/Max 1.296), M2 1.398, M3 1.38 and M4 1.578 are the figures metal_roofline.py uses
# (M3 and M4: estimates, no Apple figure).
_CLOCK_GHZ = {"M1": 1.278, "M1 Pro": 1.296, "M1 Max": 1.296, "M2": 1.398, "M3": 1.38, "M4": 1.578}


def fp16_tflops(chip: str, cores: int) -> float:
    clock = _CLOCK_GHZ.get(chip) or _CLOCK_GHZ[chip.split()[0]]
    return cores * 128 * 2 * clock / 1e3


def llama_cpp_machines():
    """(name, GB/s, fp16 TFLOP/s, llama.cpp Q4_0 tg128 tok/s) for every chip of the table."""
    return [(f"{chip} {cores}c", gbs, round(fp16_tflops(chip, cores), 1), tg)
            for chip, cores, gbs, tg in LLAMA_CPP_Q4_0_TG]
