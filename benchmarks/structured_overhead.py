"""What a JSON-schema constraint costs per decode step, against the same requests free.

One server (ours, SmolLM2 Q4_1 GGUF), side by side in one run: for each concurrency
(default 1, 16, 64) `vllm bench serve` sends the same random prompts twice, free and with
`structured_outputs: {"json": SCHEMA}` (through its --extra-body), and reports TPOT and
output tok/s. Both generate exactly --output-len tokens: the free requests ignore EOS, and
SCHEMA (an array of at least 100 records) cannot end sooner, so EOS is never allowed.
Greedy; prefix caching off (the second mode's prompts would hit the first's cache). Why
`vllm bench serve`: its --extra-body adds the constraint to every request, so both modes
share its request loop and metric definitions. The constrained cost is vLLM's (xgrammar fills each step's bitmask on the engine's
host thread) plus ours (the step waits for the mask before sampling; ops.apply_token_bitmask).

    .venv/bin/python benchmarks/structured_overhead.py [--concurrency 1,16,64]
        [--output-len 64] [--input-len 128] [--threads 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "compare"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import servers  # noqa: E402
from bench_serve import run_cell, summarize  # noqa: E402
from rope_bench import cpu_model, load_average  # noqa: E402

# records of a few typed fields, more than any run generates: the grammar never ends
SCHEMA = {"type": "array", "minItems": 100, "items": {
    "type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number"},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["a", "b", "c"]}},
    "required": ["name", "age", "score", "ok", "tag"], "additionalProperties": False}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_constrained(base: str, model: str) -> str:
    """One constrained request: its text must start the schema's array (the constraint
    is applied, not ignored)."""
    r = httpx.post(base + "/v1/completions", timeout=120, json={
        "model": model, "prompt": "Hello", "max_tokens": 24, "temperature": 0,
        "structured_outputs": {"json": SCHEMA}}).json()
    text = r["choices"][0]["text"]
    if not text.lstrip().startswith("[") or r["choices"][0]["finish_reason"] != "length":
        raise SystemExit(f"constraint not applied: {r}")
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prompts-per-slot", type=int, default=1,
                    help="prompts per cell = max(4, concurrency x this)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="also write the run as one JSON document")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from vllm_metal.models import prepare_gguf_dir
    from vllm_metal.models.offline import OFFLINE_GGUF

    gguf = str(OFFLINE_GGUF["smollm2"]())
    tokenizer_dir = prepare_gguf_dir(gguf)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    conc = [int(c) for c in args.concurrency.split(",")]
    port = free_port()
    peer = servers.ours(gguf, port, args.threads, max(conc), int8_activations=False)
    # both modes send the same prompts: no prefix-cache hits for the second
    peer.argv.append("--no-enable-prefix-caching")
    run = {"cpu": cpu_model(), "model": Path(gguf).name, "date": time.strftime("%Y-%m-%d %H:%M"),
           "command": " ".join(sys.argv), "load_before": load_average(), "cells": []}
    server = servers.RunningServer(peer, port)
    try:
        # also the warm-up: the first requests of a server pay one-time costs
        print("constrained sample:", repr(check_constrained(server.base, peer.model)), flush=True)
        httpx.post(server.base + "/v1/completions", timeout=120, json={
            "model": peer.model, "prompt": "Hello", "max_tokens": 8, "temperature": 0})
        mix = f"random-{args.input_len}-{args.output_len}"
        for c in conc:
            n = max(4, c * args.prompts_per_slot)
            for mode, extra in (("free", {}), ("json schema", {"structured_outputs": {"json": SCHEMA}})):
                result = run_cell(server.base, peer.model, tokenizer_dir, tokenizer, mix, n, c,
                                  {"ignore_eos": True, **extra}, seed=0)
                cell = {"concurrency": c, "mode": mode, **summarize(result)}
                run["cells"].append(cell)
                print(f"c={c:3d} {mode:12s} TPOT {cell['tpot_mean_ms']:7.1f} ms  "
                      f"{cell['output_tok_s']:7.1f} out tok/s  TTFT {cell['ttft_mean_s']:.2f} s  "
                      f"({cell['completed']} done, {cell['output_tokens']} tokens)", flush=True)
    finally:
        server.stop()
    run["load_after"] = load_average()
    print(f"\n{run['cpu']}; {run['model']}; {run['date']}; load {run['load_before']} -> "
          f"{run['load_after']}\n`{run['command']}`\n")
    print("| conc. | TPOT free (ms) | TPOT json (ms) | json / free | out tok/s free | "
          "out tok/s json | json / free |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    by = {(x["concurrency"], x["mode"]): x for x in run["cells"]}
    for c in conc:
        f, j = by[(c, "free")], by[(c, "json schema")]
        print(f"| {c} | {f['tpot_mean_ms']:.1f} | {j['tpot_mean_ms']:.1f} | "
              f"{j['tpot_mean_ms'] / f['tpot_mean_ms']:.2f} | {f['output_tok_s']:.1f} | "
              f"{j['output_tok_s']:.1f} | {j['output_tok_s'] / f['output_tok_s']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(run, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
