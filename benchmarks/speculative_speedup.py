"""What n-gram speculative decoding buys, ours and llama.cpp's, without and with, in one run.

SmolLM2 Q4_1 GGUF (the offline file), four servers one after another on the same cores:
ours without and with `--speculative-config '{"method": "ngram", ...}'` (async scheduling on),
llama.cpp's llama-server without and with its prompt-lookup method (`--spec-type ngram-simple`:
the n-gram ending at the last token is looked up in the sequence's own tokens, the tokens
after the match are the draft; no second model). For each concurrency (default 1, 4, 16)
and workload, `vllm bench serve` sends the same prompts to every server (its `custom`
dataset, greedy, `--ignore-eos`, so every request generates exactly --output-len tokens)
and reports its TPOT and output tok/s. Workloads:

  repetitive  prompts that contain most of the answer: a generated Python module or an
              inventory list, "rewrite it with one change", ending where the rewrite starts
  free text   random vocabulary words (workload.py's random-P-O prompts)

Acceptance rate = accepted / draft tokens, from each server's /metrics counters
(`*spec_decode_num_accepted_tokens_total` / `*spec_decode_num_draft_tokens_total`: vLLM's
names, and llama-server's under its `llamacpp:` prefix with `--metrics`), read before and
after every cell.

    .venv/bin/python benchmarks/speculative_speedup.py [--concurrency 1,4,16]
        [--servers ours,ours-ngram,llama.cpp,llama.cpp-ngram] [--prompts-per-slot 2]
        [--output-len 128] [--threads 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "compare"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import servers  # noqa: E402
from bench_serve import run_cell, summarize  # noqa: E402
from rope_bench import cpu_model, load_average  # noqa: E402
from structured_overhead import free_port  # noqa: E402
from workload import Request, make_requests  # noqa: E402

# ours: vLLM's ngram proposer settings (issue 22's example)
OURS_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
             "prompt_lookup_max": 4}
# llama.cpp's closest: one lookup length N (3, inside our 2..4), drafts of up to M = 4 tokens
LLAMA_SPEC = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
              "--spec-ngram-simple-size-m", "4"]
SERVERS = ("ours", "ours-ngram", "llama.cpp", "llama.cpp-ngram")
WORKLOADS = ("repetitive", "free text")

VERBS = ["scale", "merge", "filter", "count", "parse", "render", "update", "split", "load", "check"]
NOUNS = ["points", "orders", "records", "names", "scores", "rows", "events", "tokens", "files",
         "users"]
ITEMS = ["bolt", "washer", "nut", "screw", "hinge", "bracket", "spring", "gasket", "rivet", "clamp"]


def python_module(rng: np.random.Generator, n_funcs: int) -> tuple[str, str, str]:
    """A listing of small functions of one template; returns (source, old name, new name)."""
    names, funcs = [], []
    for i in range(n_funcs):
        name = f"{rng.choice(VERBS)}_{rng.choice(NOUNS)}_{i}"
        k, off = int(rng.integers(2, 9)), int(rng.integers(0, 50))
        names.append(name)
        funcs.append(
            f"def {name}(values, factor={k}):\n"
            f'    """Return the values times {k} plus {off}, skipping None."""\n'
            f"    result = []\n"
            f"    for value in values:\n"
            f"        if value is None:\n"
            f"            continue\n"
            f"        result.append(value * factor + {off})\n"
            f"    return result\n")
    old = names[int(rng.integers(0, n_funcs))]
    return "\n\n".join(funcs), old, old.replace("_", "_new_", 1)


def inventory(rng: np.random.Generator, n_items: int) -> tuple[str, int]:
    """A structured list of records; returns (text, the item whose price changes)."""
    lines = [f"- item {i:03d}: part={rng.choice(ITEMS)}, size=M{int(rng.integers(2, 20))}, "
             f"qty={int(rng.integers(1, 500))}, price={int(rng.integers(1, 99))}.{int(rng.integers(0, 99)):02d}"
             for i in range(n_items)]
    return "\n".join(lines) + "\n", int(rng.integers(0, n_items))


def repetitive_requests(tokenizer, n: int, output_len: int, seed: int) -> list[Request]:
    """Edit-this prompts: the document, the one change, then the rewrite's first lines, so
    the answer is mostly a copy of the prompt. Half code, half an inventory list."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        if i % 2 == 0:
            src, old, new = python_module(rng, 6)
            # the rewrite's first three lines (after only one, SmolLM2 tends to stop copying)
            first = "\n".join(src.splitlines()[:3]).replace(old, new)
            prompt = (f"# module.py\n\n{src}\n\n# module.py again, with the function `{old}` "
                      f"renamed to `{new}` and nothing else changed:\n\n{first}\n")
        else:
            text, item = inventory(rng, 14)
            prompt = (f"Inventory list:\n\n{text}\nRewrite the list with the quantity of item "
                      f"{item:03d} set to 0 and every other line unchanged.\n\n"
                      f"{text.splitlines()[0]}\n")
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        out.append(Request(prompt, len(ids), output_len))
    return out


def spec_counters(base: str) -> dict[str, float] | None:
    """Sum of the spec-decode counters in /metrics (vLLM's vllm:spec_decode_*, llama-server's
    llamacpp:spec_decode_*); None if the server exports none."""
    try:
        r = httpx.get(base + "/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    got: dict[str, float] = {}
    for line in r.text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split(None, 1)[0].split("{")[0]
        for key in ("num_accepted_tokens_total", "num_draft_tokens_total", "num_drafts_total"):
            if name.endswith("spec_decode_" + key):
                got[key] = got.get(key, 0.0) + float(line.split()[-1])
    return got or None


def make_peer(name: str, gguf: str, port: int, threads: int, max_conc: int, llama_bin: str,
              int8: bool):
    if name.startswith("ours"):
        peer = servers.ours(gguf, port, threads, max_conc, int8_activations=int8)
        if name == "ours-ngram":
            peer.argv += ["--speculative-config", json.dumps(OURS_SPEC)]
    else:
        peer = servers.llama_cpp(llama_bin, gguf, port, threads, max_conc)
        peer.argv.append("--metrics")
        if name == "llama.cpp-ngram":
            peer.argv += LLAMA_SPEC
    peer.name = name
    return peer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--servers", default=",".join(SERVERS))
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=128, help="free-text prompt tokens")
    ap.add_argument("--prompts-per-slot", type=int, default=2,
                    help="prompts per cell = max(--min-prompts, concurrency x this)")
    ap.add_argument("--min-prompts", type=int, default=8)
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
    names = args.servers.split(",")
    # the same prompts for every server; new ones per cell (no prefix-cache hits across cells)
    workload = {}
    for c in conc:
        n = max(args.min_prompts, c * args.prompts_per_slot)
        workload[("repetitive", c)] = repetitive_requests(tokenizer, n, args.output_len, seed=100 + c)
        workload[("free text", c)] = make_requests(
            tokenizer, f"random-{args.input_len}-{args.output_len}", n, seed=200 + c)
    warm = repetitive_requests(tokenizer, 1, 32, seed=7)[0]
    run = {"cpu": cpu_model(), "model": Path(gguf).name, "date": time.strftime("%Y-%m-%d %H:%M"),
           "command": " ".join(sys.argv), "load_before": load_average(), "ours_spec": OURS_SPEC,
           "llama_spec": LLAMA_SPEC, "int8_activations": args.int8_activations, "cells": [],
           "prompt_tokens_mean": {f"{w} c={c}": float(np.mean([r.prompt_tokens for r in rs]))
                                  for (w, c), rs in workload.items()}}
    for name in names:
        port = free_port()
        peer = make_peer(name, gguf, port, args.threads, max(conc), args.llama_bin,
                         args.int8_activations)
        t0 = time.monotonic()
        server = servers.RunningServer(peer, port)
        startup = time.monotonic() - t0
        try:
            # warm-up: the first requests of a server pay one-time costs
            r = httpx.post(server.base + "/v1/completions", timeout=300, json={
                "model": peer.model, "prompt": warm.prompt, "max_tokens": 32, "temperature": 0})
            r.raise_for_status()
            print(f"{name}: up in {startup:.0f} s; warm-up text {r.json()['choices'][0]['text'][:80]!r}",
                  flush=True)
            for w in WORKLOADS:
                for c in conc:
                    reqs = workload[(w, c)]
                    before = spec_counters(server.base)
                    result = run_cell(server.base, peer.model, tokenizer_dir, tokenizer, w, len(reqs),
                                      c, peer.no_eos, seed=0, requests=reqs)
                    after = spec_counters(server.base)
                    cell = {"server": name, "workload": w, "concurrency": c, **summarize(result)}
                    if before is not None and after is not None:
                        d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
                        cell.update({f"spec_{k}": v for k, v in d.items()})
                        if d.get("num_draft_tokens_total"):
                            cell["acceptance"] = d["num_accepted_tokens_total"] / d["num_draft_tokens_total"]
                    if "spec_decode_acceptance_rate" in result:  # vllm bench serve's own reading
                        cell["acceptance_vllm_bench"] = result["spec_decode_acceptance_rate"] / 100
                    run["cells"].append(cell)
                    acc = f"  acceptance {cell['acceptance']:.2f}" if "acceptance" in cell else ""
                    print(f"{name:16s} {w:10s} c={c:3d} TPOT p50 {cell['tpot_p50_ms']:7.1f} ms "
                          f"(mean {cell['tpot_mean_ms']:7.1f})  {cell['output_tok_s']:7.1f} out tok/s  "
                          f"TTFT {cell['ttft_mean_s']:.2f} s  ({cell['completed']}/{len(reqs)} done, "
                          f"{cell['output_tokens']} tokens){acc}", flush=True)
        finally:
            server.stop()
    run["load_after"] = load_average()
    if args.json:
        Path(args.json).write_text(json.dumps(run, indent=1))
    print(report(run, conc))
    return 0


def report(run: dict, conc: list[int]) -> str:
    by = {(x["server"], x["workload"], x["concurrency"]): x for x in run["cells"]}
    out = [f"\n{run['cpu']}; {run['model']}; {run['date']}; load {run['load_before']} -> "
           f"{run['load_after']}\n`{run['command']}`\n",
           "| workload | conc. | engine | TPOT p50 off (ms) | TPOT p50 ngram (ms) | off / ngram | "
           "out tok/s off | out tok/s ngram | ngram / off | acceptance |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for w in WORKLOADS:
        for c in conc:
            for eng, off_name, on_name in (("vllm-metal", "ours", "ours-ngram"),
                                           ("llama.cpp", "llama.cpp", "llama.cpp-ngram")):
                off, on = by.get((off_name, w, c)), by.get((on_name, w, c))
                if off is None and on is None:
                    continue
                f = lambda x, k, fmt: format(x[k], fmt) if x and k in x else ""  # noqa: E731
                ratio_t = (f"{off['tpot_p50_ms'] / on['tpot_p50_ms']:.2f}" if off and on else "")
                ratio_o = (f"{on['output_tok_s'] / off['output_tok_s']:.2f}" if off and on else "")
                out.append(f"| {w} | {c} | {eng} | {f(off, 'tpot_p50_ms', '.1f')} | "
                           f"{f(on, 'tpot_p50_ms', '.1f')} | {ratio_t} | {f(off, 'output_tok_s', '.1f')} | "
                           f"{f(on, 'output_tok_s', '.1f')} | {ratio_o} | {f(on, 'acceptance', '.2f')} |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
