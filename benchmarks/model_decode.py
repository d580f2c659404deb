"""SmolLM2-135M Q4_1 decode through vllm_metal.models.generate, before / after
the linear layers moved to ops.gguf_matmul, side by side in one run.

Paths (`--paths`, each `linear:dtype`):
  mlx:float16   before: every GGUF weight dequantized at load to float16, mlx-lm's
                nn.Linear (MLX matmul: scalar reference BLAS on Linux)
  gguf:float16  after: weights in block form, GGUFLinear / GGUFEmbedding on
                ops.gguf_matmul (the default load)
  gguf:float32  after, float32 activations (no float16 conversions in the glue)

Loads: each path once in a fresh process (so RSS and MLX's buffer cache start
clean), after mlx-lm (and the transformers / torch it imports) is imported:
load time, parameter bytes, RSS growth (the file mapping is gone by then:
what stays is the weights). Decode: all paths loaded in this process, runs
interleaved path by path (the machine is shared and its load moves):
greedy_generate (no stop tokens) of `--tokens` tokens for 1 sequence and for
16 sequences packed into every step. Decode tok/s = generated tokens of the
pure decode steps / their time (prefill steps excluded); the median of
`--repeats` runs. One JSON object per line, then a table.

    .venv/bin/python benchmarks/model_decode.py [--tokens 32] [--mlx-tokens 8]
        [--seqs 1,16] [--paths mlx:float16,gguf:float16,gguf:float32] [--repeats 3]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import mlx.core as mx
from mlx.utils import tree_flatten

from vllm_metal.models import load_model
from vllm_metal.models.generate import greedy_generate
from vllm_metal.models.offline import smollm2_gguf

RESULTS: list[dict] = []


def emit(rec: dict) -> dict:
    print(json.dumps(rec), flush=True)
    RESULTS.append(rec)
    return rec


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def prompts(n: int) -> list[list[int]]:
    """n distinct prompts of 12-27 tokens (ids inside the vocabulary, no specials)."""
    return [[100 + (7 * i + 13 * j) % 40000 for j in range(12 + i % 16)] for i in range(n)]


def decode_rate(loaded, n_seqs: int, tokens: int) -> tuple[float, int, float]:
    """(tok/s over the pure decode steps, decode tokens timed, seconds)."""
    steps: list = []
    greedy_generate(loaded, prompts(n_seqs), tokens, stop_ids=[], step_times=steps)
    decode = [(d, s) for d, p, s in steps if p == 0 and d > 0]
    n = sum(d for d, _ in decode)
    secs = sum(s for _, s in decode)
    return n / secs, n, secs


def load_path(spec: str) -> tuple:
    """(loaded model, its load record) for `linear:dtype`."""
    import mlx_lm.models.llama  # noqa: F401  (mlx-lm imports transformers and torch: ~5 s, ~400 MB once)

    linear, dtype = spec.split(":")
    rss0 = rss_mb()
    t0 = time.perf_counter()
    loaded = load_model(str(smollm2_gguf()), dtype, linear=linear)
    load_s = time.perf_counter() - t0
    rss_load = rss_mb() - rss0
    param_mb = sum(p.nbytes for _, p in tree_flatten(loaded.model.parameters())) / 1e6
    return loaded, {"kind": "load", "path": spec, "seconds": round(load_s, 3),
                    "param_mb": round(param_mb, 1), "rss_growth_mb": round(rss_load, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paths", default="mlx:float16,gguf:float16,gguf:float32")
    ap.add_argument("--seqs", default="1,16")
    ap.add_argument("--tokens", type=int, default=32, help="tokens per sequence (gguf paths)")
    ap.add_argument("--mlx-tokens", type=int, default=8, help="tokens per sequence (mlx path: slow)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="also write the whole run here")
    ap.add_argument("--load-only", help=argparse.SUPPRESS)  # internal: measure one load, fresh process
    args = ap.parse_args()
    if args.load_only:
        print(json.dumps(load_path(args.load_only)[1]), flush=True)
        return

    path = smollm2_gguf()
    file_mb = path.stat().st_size / 1e6
    load_before = os.getloadavg()
    emit({"kind": "machine", "load_avg": [round(v, 2) for v in load_before], "file": path.name,
          "file_mb": round(file_mb, 1), "python": sys.version.split()[0], "mlx": mx.__version__,
          "cpus": os.cpu_count()})
    specs = args.paths.split(",")
    seqs = [int(s) for s in args.seqs.split(",")]
    rows = {spec: {"path": spec} for spec in specs}
    for spec in specs:  # loads: each in a fresh process, so RSS and MLX's buffer cache start clean
        out = subprocess.run([sys.executable, __file__, "--load-only", spec], check=True,
                             capture_output=True, text=True).stdout
        rec = emit(json.loads(out.strip().splitlines()[-1]))
        rows[spec].update(load_s=rec["seconds"], param_mb=rec["param_mb"], rss_mb=rec["rss_growth_mb"])

    # Decode: every path loaded here, runs interleaved (the machine is shared; the load moves).
    models = {spec: load_path(spec)[0] for spec in specs}
    for loaded in models.values():
        decode_rate(loaded, 1, 3)  # warm-up
    runs = {(spec, n): [] for spec in specs for n in seqs}
    for _ in range(args.repeats):
        for n in seqs:
            for spec in specs:
                tokens = args.mlx_tokens if spec.startswith("mlx:") else args.tokens
                runs[spec, n].append(decode_rate(models[spec], n, tokens)[0])
    for spec in specs:
        for n in seqs:
            rate = statistics.median(runs[spec, n])
            tokens = args.mlx_tokens if spec.startswith("mlx:") else args.tokens
            emit({"kind": "decode", "path": spec, "seqs": n, "tokens_per_seq": tokens,
                  "tok_s": round(rate, 2), "runs_tok_s": [round(r, 2) for r in runs[spec, n]],
                  "ms_per_step": round(1e3 * n / rate, 1)})
            rows[spec][n] = rate
    load_after = os.getloadavg()
    emit({"kind": "machine_after", "load_avg": [round(v, 2) for v in load_after]})

    table = [rows[spec] for spec in specs]
    base = table[0]
    print(f"\nSmolLM2-135M Q4_1 ({file_mb:.1f} MB), load average {load_before[0]:.1f} -> "
          f"{load_after[0]:.1f}; decode tok/s (median of {args.repeats}), x = over {base['path']}")
    print("| path | load s | params MB | RSS +MB | " + " | ".join(f"{n} seq tok/s | x" for n in seqs) + " |")
    print("|---|" + "---:|" * (3 + 2 * len(seqs)))
    for r in table:
        cells = " | ".join(f"{r[n]:.1f} | {r[n] / base[n]:.1f}x" for n in seqs)
        print(f"| {r['path']} | {r['load_s']:.2f} | {r['param_mb']:.1f} | {r['rss_mb']:.0f} | {cells} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": RESULTS}, f, indent=1)


if __name__ == "__main__":
    main()
