"""Single-stream decode tok/s: vllm-metal's model (block-form GGUF weights on
ops.gguf_matmul, float32 and 8-bit activations) against llama.cpp's llama-bench
(tg: token generation) on the same GGUF file with the same thread count, runs
interleaved (the machine is shared: compare within a run).

    benchmarks/peers/setup        # builds llama-bench once
    .venv/bin/python benchmarks/decode_vs_llama_cpp.py [--models smollm2,gemma3]
        [--tokens 64] [--repeats 3] [--threads 2] [--no-docs]

Ours: greedy_generate of one sequence, tok/s over the pure decode steps (the
forward, sampling and host glue of each step, no HTTP server). llama-bench: its
tg figure for --tokens tokens after an empty prompt. The table goes into
docs/benchmarks.md between the decode-vs-llama.cpp markers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_sections import write_section  # noqa: E402
from model_decode import decode_rate  # noqa: E402

from vllm_metal import _core  # noqa: E402
from vllm_metal.models import load_model  # noqa: E402
from vllm_metal.models.gguf_linear import set_exact_activations  # noqa: E402
from vllm_metal.models.offline import OFFLINE_GGUF  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LLAMA_BENCH = ROOT / "build" / "peers" / "llama.cpp" / "bin" / "llama-bench"


def llama_bench_tg(gguf: str, tokens: int, threads: int, prompt: int = 0) -> float:
    """llama-bench's tokens/s: decoding `tokens` (tg), or with tokens=0 a `prompt`-token
    prefill (pp)."""
    out = subprocess.run([str(LLAMA_BENCH), "-m", gguf, "-t", str(threads), "-p", str(prompt),
                          "-n", str(tokens), "-r", "1", "-o", "json"],
                         check=True, capture_output=True, text=True).stdout
    (rec,) = json.loads(out)
    return float(rec["avg_ts"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-docs", action="store_true")
    args = ap.parse_args()
    if not LLAMA_BENCH.exists():
        raise SystemExit("llama-bench missing: run benchmarks/peers/setup first")
    _core.set_num_threads(args.threads)
    rows = []
    for name in args.models.split(","):
        gguf = str(OFFLINE_GGUF[name]())
        loaded = load_model(gguf)
        runs = {"llama.cpp": [], "vllm-metal float32 act.": [], "vllm-metal int8 act.": []}
        decode_rate(loaded, 1, 4)  # warm-up
        for _ in range(args.repeats):
            runs["llama.cpp"].append(llama_bench_tg(gguf, args.tokens, args.threads))
            for label, exact in (("vllm-metal float32 act.", True), ("vllm-metal int8 act.", False)):
                set_exact_activations(loaded.model, exact)
                runs[label].append(decode_rate(loaded, 1, args.tokens)[0])
        ref = statistics.median(runs["llama.cpp"])
        for label, r in runs.items():
            rate = statistics.median(r)
            rows.append((Path(gguf).name, label, rate, rate / ref, r))
            print(json.dumps({"model": Path(gguf).name, "engine": label, "tok_s": round(rate, 2),
                              "vs_llama_cpp": round(rate / ref, 2),
                              "runs": [round(v, 2) for v in r]}), flush=True)
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    table = [f"{cpu}, {args.threads} threads, {time.strftime('%Y-%m-%d')}; "
             f"`{' '.join(['benchmarks/decode_vs_llama_cpp.py', *sys.argv[1:]])}`; "
             f"median of {args.repeats} interleaved runs of {args.tokens} tokens.", "",
             "| model | engine | decode tok/s | vs llama.cpp |", "|---|---|---:|---:|"]
    table += [f"| {m} | {e} | {t:.1f} | {x:.2f}x |" for m, e, t, x, _ in rows]
    text = "\n".join(table)
    print(text)
    if not args.no_docs:
        write_section(ROOT / "docs" / "benchmarks.md", "decode-vs-llama.cpp", text,
                      "Single-stream decode against llama.cpp (benchmarks/decode_vs_llama_cpp.py)")


if __name__ == "__main__":
    main()
