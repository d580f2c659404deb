"""MoE decode tok/s against llama.cpp on the same GGUF file, in one run.

The synthetic Qwen3-MoE of benchmarks/moe_decode.py (random weights; default 4 layers,
hidden 1024, 64 experts, top-8, expert width 512, 16 query / 4 KV heads of 64) written as a
qwen3moe GGUF file per expert type (the rest F32), which llama.cpp loads as it is. Ours:
load_model + greedy_generate (block-form experts on ops.fused_moe_gguf; float32
activations by default, 8-bit ones in the -int8 rows, as llama.cpp rounds them), median
tok/s over the decode-only steps at batch 1 (and the batch sizes asked; llama-bench has no
multi-sequence decode, so llama.cpp is batch 1 only). llama.cpp:
llama-bench's tg figure (--tokens tokens after an empty prompt), the same thread count.
Prefill: one --prompt-token prompt in one step (ours at batch 1, float32 sums and int8),
against llama-bench's pp figure.
Runs interleaved (the machine is shared: compare within a run).

    benchmarks/peers/setup        # builds llama-bench once
    .venv/bin/python benchmarks/moe_vs_llama_cpp.py [--types Q4_0 MXFP4] [--tokens 32] [--prompt 256]
        [--repeats 3] [--threads 2] [--batch 1 4] [--no-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "py"))
from decode_vs_llama_cpp import LLAMA_BENCH, llama_bench_tg  # noqa: E402
from doc_sections import write_section  # noqa: E402
import moe_decode  # noqa: E402

from vllm_metal import _core  # noqa: E402
from vllm_metal.models import load_model  # noqa: E402
from vllm_metal.models.gguf_linear import set_exact_activations  # noqa: E402

ROOT = HERE.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", nargs="+", default=["Q4_0", "MXFP4"])
    moe_decode.add_shape_args(ap)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=256, help="prefill: a prompt this long")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-docs", action="store_true")
    a = ap.parse_args()
    if not LLAMA_BENCH.exists():
        raise SystemExit("llama-bench missing: run benchmarks/peers/setup first")
    _core.set_num_threads(a.threads)
    cfg = moe_decode.config(a)
    w = moe_decode.weights(cfg, np.random.default_rng(0))
    rng = np.random.default_rng(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for qtype in a.types:
            path = moe_decode.write_gguf(cfg, w, Path(tmp) / f"moe-{qtype}.gguf", qtype)
            size = os.path.getsize(path) / 2**20
            loaded = load_model(str(path), "float32")
            # ours with float32 sums (the default) and with 8-bit activations
            # (VLLM_METAL_INT8_ACTIVATIONS=1), llama.cpp's own scheme for these types
            ours = [(f"vllm-metal{tag} batch {b}", exact, b)
                    for tag, exact in (("", True), ("-int8", False)) for b in a.batch]
            runs = {"llama.cpp": []} | {name: [] for name, _, _ in ours}
            # prefill of one prompt: llama.cpp and ours at batch 1 (exact and int8)
            prefill = {name: [] for name in runs if name == "llama.cpp" or name.endswith(" 1")}
            for _ in range(a.repeats):
                runs["llama.cpp"].append(llama_bench_tg(str(path), a.tokens, a.threads))
                prefill["llama.cpp"].append(llama_bench_tg(str(path), 0, a.threads, a.prompt))
                for name, exact, b in ours:
                    set_exact_activations(loaded.model, exact)
                    runs[name].append(moe_decode.decode_rate(loaded, b, a.tokens, rng))
                    if name in prefill:
                        prefill[name].append(moe_decode.prefill_rate(loaded, a.prompt, rng))
            ref = statistics.median(runs["llama.cpp"])
            ref_pp = statistics.median(prefill["llama.cpp"])
            for engine, r in runs.items():
                rate = statistics.median(r)
                pp = statistics.median(prefill[engine]) if engine in prefill else None
                rows.append((qtype, size, engine, rate, rate / ref, pp, pp and pp / ref_pp))
                print(json.dumps({"experts": qtype, "file_mib": round(size), "engine": engine,
                                  "tok_s": round(rate, 2), "vs_llama_cpp_b1": round(rate / ref, 2),
                                  "runs": [round(v, 2) for v in r],
                                  "prefill_tok_s": pp and round(pp, 1)}), flush=True)
            del loaded
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    load = os.getloadavg()[0]
    table = [f"{cpu}, {a.threads} threads, {time.strftime('%Y-%m-%d %H:%M')} UTC, load average "
             f"{load:.1f} at the end; `{' '.join(['benchmarks/moe_vs_llama_cpp.py', *sys.argv[1:]])}`; "
             f"synthetic qwen3moe GGUF ({a.layers} layers, hidden {a.hidden}, {a.experts} experts, "
             f"top-{a.top_k}, expert width {a.inter}, the rest F32); median of {a.repeats} "
             f"interleaved runs of {a.tokens} decoded tokens and of a {a.prompt}-token prefill.",
             "",
             "| experts | file MiB | engine | decode tok/s | vs llama.cpp batch 1 | prefill tok/s "
             "| vs llama.cpp |",
             "|---|---:|---|---:|---:|---:|---:|"]
    table += [f"| {q} | {s:.0f} | {e} | {t:.1f} | {x:.2f}x | "
              + (f"{pp:.0f} | {px:.2f}x |" if pp else "- | - |")
              for q, s, e, t, x, pp, px in rows]
    text = "\n".join(table)
    print(text)
    if not a.no_docs:
        write_section(ROOT / "docs" / "benchmarks.md", "moe-vs-llama.cpp", text,
                      "MoE decode against llama.cpp (benchmarks/moe_vs_llama_cpp.py)")


if __name__ == "__main__":
    main()
