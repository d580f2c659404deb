"""Generation throughput under one JSON schema: ours against llama.cpp's llama-server, same GGUF.

SmolLM2 Q4_1 GGUF (the offline file); the two servers one after the other on the same
cores. For each concurrency (default 1, 16) `vllm bench serve` sends the same random prompts
(workload.py's random-128-64 words, custom dataset) to each server twice, free and
constrained by structured_overhead.SCHEMA (an array of at least 100 five-field records, so
no request can end inside 64 tokens): ours through `structured_outputs: {"json": SCHEMA}`,
llama-server through its `json_schema` request field (which it compiles to a GBNF grammar).
Both generate exactly --output-len tokens (`ignore_eos`; the schema allows no EOS anyway),
greedy; prompt caches off (ours `--no-enable-prefix-caching`, llama-server `cache_prompt:
false`) since each prompt is sent twice.

Before measuring, each engine must show that it constrains: a finite variant of SCHEMA
(exactly two records) must come back as JSON that validates (jsonschema), and the records
completed within 64 tokens under SCHEMA itself must each validate against its item schema.

    .venv/bin/python benchmarks/structured_vs_llama_cpp.py [--concurrency 1,16]
        [--output-len 64] [--input-len 128] [--threads 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx
import jsonschema

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "compare"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import servers  # noqa: E402
from bench_serve import run_cell, summarize  # noqa: E402
from rope_bench import cpu_model, load_average  # noqa: E402
from structured_overhead import SCHEMA, free_port  # noqa: E402
from workload import make_requests  # noqa: E402

FINITE = {**SCHEMA, "minItems": 2, "maxItems": 2}
PROMPT = "A JSON list of people with their name, age, score, ok flag and tag:\n"


def constraint(engine: str, schema: dict) -> dict:
    """The request fields that apply `schema` on this engine."""
    return {"structured_outputs": {"json": schema}} if engine == "vllm-metal" else {"json_schema": schema}


def complete_records(text: str) -> list:
    """The records of a JSON array prefix that are complete (the array may be cut off)."""
    dec, s = json.JSONDecoder(), text.lstrip()
    if not s.startswith("["):
        raise ValueError(f"not an array: {text[:60]!r}")
    i, out = 1, []
    while True:
        while i < len(s) and s[i] in " \t\n\r,":
            i += 1
        try:
            item, i = dec.raw_decode(s, i)
        except json.JSONDecodeError:
            return out
        out.append(item)


def check_constrains(engine: str, base: str, model: str, extra: dict) -> dict:
    """The engine applies the schema: the finite schema's output validates, and the complete
    records of a 64-token output under SCHEMA validate against its items."""
    r = httpx.post(base + "/v1/completions", timeout=300, json={
        "model": model, "prompt": PROMPT, "max_tokens": 400, "temperature": 0, **extra,
        **constraint(engine, FINITE)}).json()
    text = r["choices"][0]["text"]
    jsonschema.validate(json.loads(text), FINITE)
    r2 = httpx.post(base + "/v1/completions", timeout=300, json={
        "model": model, "prompt": PROMPT, "max_tokens": 64, "temperature": 0, **extra,
        **constraint(engine, SCHEMA)}).json()
    records = complete_records(r2["choices"][0]["text"])
    if not records:
        raise SystemExit(f"{engine}: no complete record in {r2['choices'][0]['text']!r}")
    for rec in records:
        jsonschema.validate(rec, SCHEMA["items"])
    free = httpx.post(base + "/v1/completions", timeout=300, json={
        "model": model, "prompt": PROMPT, "max_tokens": 64, "temperature": 0, **extra}).json()
    return {"finite_schema_output": text, "schema_output_64": r2["choices"][0]["text"],
            "records_complete_in_64": len(records), "free_output_64": free["choices"][0]["text"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prompts-per-slot", type=int, default=2,
                    help="prompts per cell = max(8, concurrency x this)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--int8-activations", action="store_true",
                    help="ours with VLLM_METAL_INT8_ACTIVATIONS=1 (llama.cpp's CPU path is int8)")
    ap.add_argument("--llama-bin", default=str(ROOT / "build" / "peers" / "llama.cpp" / "bin"))
    ap.add_argument("--json", help="also write the run as one JSON document")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from vllm_metal.models import prepare_gguf_dir
    from vllm_metal.models.offline import OFFLINE_GGUF

    gguf = str(OFFLINE_GGUF["smollm2"]())
    tokenizer_dir = prepare_gguf_dir(gguf)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    conc = [int(c) for c in args.concurrency.split(",")]
    mix = f"random-{args.input_len}-{args.output_len}"
    prompts = {c: make_requests(tokenizer, mix, max(8, c * args.prompts_per_slot), seed=300 + c)
               for c in conc}
    run = {"cpu": cpu_model(), "model": Path(gguf).name, "date": time.strftime("%Y-%m-%d %H:%M"),
           "command": " ".join(sys.argv), "load_before": load_average(), "schema": SCHEMA,
           "int8_activations": args.int8_activations,
           "checks": {}, "cells": []}
    for engine in ("vllm-metal", "llama.cpp"):
        port = free_port()
        if engine == "vllm-metal":
            peer = servers.ours(gguf, port, args.threads, max(conc),
                                int8_activations=args.int8_activations)
            peer.argv.append("--no-enable-prefix-caching")
            no_cache = {}
        else:
            peer = servers.llama_cpp(args.llama_bin, gguf, port, args.threads, max(conc))
            no_cache = {"cache_prompt": False}
        server = servers.RunningServer(peer, port)
        try:
            check = check_constrains(engine, server.base, peer.model, no_cache)
            run["checks"][engine] = check
            print(f"{engine}: constrains; finite schema -> {check['finite_schema_output'][:100]!r}; "
                  f"{check['records_complete_in_64']} records complete in 64 tokens; free -> "
                  f"{check['free_output_64'][:60]!r}", flush=True)
            for c in conc:
                for mode, extra in (("free", {}), ("json schema", constraint(engine, SCHEMA))):
                    result = run_cell(server.base, peer.model, tokenizer_dir, tokenizer, mix,
                                      len(prompts[c]), c, {"ignore_eos": True, **no_cache, **extra},
                                      seed=0, requests=prompts[c])
                    cell = {"engine": engine, "concurrency": c, "mode": mode, **summarize(result)}
                    run["cells"].append(cell)
                    print(f"{engine:10s} c={c:3d} {mode:12s} TPOT p50 {cell['tpot_p50_ms']:7.1f} ms "
                          f"(mean {cell['tpot_mean_ms']:7.1f})  {cell['output_tok_s']:7.1f} out tok/s  "
                          f"TTFT {cell['ttft_mean_s']:.2f} s  ({cell['completed']}/{len(prompts[c])} "
                          f"done, {cell['output_tokens']} tokens)", flush=True)
        finally:
            server.stop()
    run["load_after"] = load_average()
    if args.json:
        Path(args.json).write_text(json.dumps(run, indent=1))
    by = {(x["engine"], x["concurrency"], x["mode"]): x for x in run["cells"]}
    print(f"\n{run['cpu']}; {run['model']}; {run['date']}; load {run['load_before']} -> "
          f"{run['load_after']}\n`{run['command']}`\n")
    print("| conc. | engine | TPOT p50 free (ms) | TPOT p50 json (ms) | out tok/s free | "
          "out tok/s json | json / free |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for c in conc:
        for engine in ("vllm-metal", "llama.cpp"):
            f, j = by.get((engine, c, "free")), by.get((engine, c, "json schema"))
            if f and j:
                print(f"| {c} | {engine} | {f['tpot_p50_ms']:.1f} | {j['tpot_p50_ms']:.1f} | "
                      f"{f['output_tok_s']:.1f} | {j['output_tok_s']:.1f} | "
                      f"{j['output_tok_s'] / f['output_tok_s']:.2f} |")
        a, b = by.get(("vllm-metal", c, "json schema")), by.get(("llama.cpp", c, "json schema"))
        if a and b:
            print(f"| {c} | json: ours / llama.cpp (out tok/s) | | | | | "
                  f"{a['output_tok_s'] / b['output_tok_s']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
