"""Data parallelism served: aggregate output tokens/s of `vllm serve --data-parallel-size 2`
against one replica, at concurrency 16 and 64, on the same machine in one run.

SmolLM2-135M (Q4_1 GGUF), greedy requests with ignore_eos. Servers one at a time, in the
order single, DP, DP, single (the single replica's figure is the mean of its two runs, so a
drift of the machine's load over the run shows): one replica with all the threads; two replicas with one thread each (the cores split between
them, as two Macs would each bring their own); two replicas with all the threads each
(oversubscribed, what `--data-parallel-size 2` does with no other setting).

    .venv/bin/python benchmarks/data_parallel.py [--tokens 64] [--threads 2] [--json PATH]

On one host the replicas share the cores and the memory bandwidth a single replica's
batch already uses, so DP cannot beat it; across Macs each replica brings its own
(docs/distributed.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from compare.servers import Peer, RunningServer  # noqa: E402

PROMPTS = ["Write a short story about a lighthouse keeper.",
           "Explain how a bicycle works, step by step.",
           "List ten facts about the moon.",
           "Describe a walk through a busy market."]
CONCURRENCY = (16, 64)


def peer(gguf: str, port: int, replicas: int, threads: int) -> Peer:
    vllm = Path(sys.executable).with_name("vllm")
    dp = ["--data-parallel-size", str(replicas)] if replicas > 1 else []
    return Peer(name=f"dp{replicas}-{threads}t",
                argv=[str(vllm), "serve", gguf, "--served-model-name", "m", "--host", "127.0.0.1",
                      "--port", str(port), "--max-model-len", "512", "--max-num-seqs", "64",
                      "--kv-cache-memory-bytes", str(256 << 20), *dp],
                model="m", no_eos={"ignore_eos": True}, env={"VLLM_METAL_NUM_THREADS": str(threads)})


def complete(base: str, prompt: str, tokens: int) -> int:
    r = httpx.post(base + "/v1/completions", json={
        "model": "m", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True},
        timeout=900)
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


def throughput(base: str, concurrency: int, tokens: int) -> float:
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} ({i})" for i in range(concurrency)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        out = sum(pool.map(lambda p: complete(base, p, tokens), prompts))
    return out / (time.perf_counter() - t0)


def run_one(gguf: str, port: int, replicas: int, threads: int, tokens: int) -> dict:
    server = RunningServer(peer(gguf, port, replicas, threads), port)
    try:
        throughput(server.base, 4, 8)  # warm every replica
        result = {"replicas": replicas, "threads_per_replica": threads}
        for c in CONCURRENCY:
            result[f"c{c}_tok_s"] = round(throughput(server.base, c, tokens), 1)
        result["peak_rss_mib"] = round(server.peak_rss / 2**20)
    finally:
        server.stop()
    return result


def main() -> None:
    from vllm_metal.models.offline import OFFLINE_GGUF

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="the machine's cores")
    ap.add_argument("--port", type=int, default=18150)
    ap.add_argument("--json")
    args = ap.parse_args()
    gguf = str(OFFLINE_GGUF["smollm2"]())
    configs = [(1, args.threads), (2, max(args.threads // 2, 1)), (2, args.threads), (1, args.threads)]
    results = []
    for replicas, threads in configs:
        r = run_one(gguf, args.port, replicas, threads, args.tokens)
        print(json.dumps(r), flush=True)
        results.append(r)
    singles = [r for r in results if r["replicas"] == 1]
    base = {c: sum(r[f"c{c}_tok_s"] for r in singles) / len(singles) for c in CONCURRENCY}
    print("one replica: " + ", ".join(f"concurrency {c}: {base[c]:.1f} tok/s" for c in CONCURRENCY))
    for r in results[1:-1]:
        ratios = ", ".join(f"concurrency {c}: {r[f'c{c}_tok_s']:.1f} tok/s = {r[f'c{c}_tok_s'] / base[c]:.2f}x"
                           for c in CONCURRENCY)
        print(f"DP={r['replicas']} ({r['threads_per_replica']} threads each) vs one replica: {ratios}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
