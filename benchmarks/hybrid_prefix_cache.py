"""Prefix caching on a hybrid model (Qwen3.5), served: what a hit saves, what checkpoints cost.

`vllm serve` on a random-weight checkpoint of Qwen3.5-0.8B's layer shapes (qwen3_5_step.py's,
bfloat16: 528-token blocks, so a block's page holds a linear layer's state), prefix caching on
(the default: state checkpoints, docs/hybrid.md) and off (--no-enable-prefix-caching), in the
order on, off, off, on, one server at a time:

    shared   requests one after another, each a shared --prefix-tokens prefix (a system
             prompt) plus its own 24 tokens, 8 tokens out: time to first token of each
             request from the third on (the second writes the junction checkpoint)
    distinct --concurrency requests at once, 256 distinct tokens in, 64 out: output tokens/s
             (what writing checkpoints at chunk ends costs when nothing is shared)

    .venv/bin/python benchmarks/hybrid_prefix_cache.py [--prefix-tokens 1100] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from compare.servers import Peer, RunningServer  # noqa: E402
from qwen3_5_step import CONFIG, write_model  # noqa: E402


def peer(model_dir: str, port: int, caching: bool) -> Peer:
    vllm = Path(sys.executable).with_name("vllm")
    return Peer(
        name="caching on" if caching else "caching off",
        argv=[str(vllm), "serve", model_dir, "--served-model-name", "m", "--host", "127.0.0.1",
              "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "2048",
              "--max-num-seqs", "8", "--kv-cache-memory-bytes", str(1 << 30), "--skip-tokenizer-init",
              "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"],
        model="m", no_eos={"ignore_eos": True})


def first_token_seconds(base: str, prompt: list[int], max_tokens: int) -> float:
    t0 = time.perf_counter()
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: ") and line != "data: [DONE]":
                ttft = time.perf_counter() - t0
                for _ in lines:  # drain the rest of this one stream
                    pass
                return ttft
    raise RuntimeError("no token streamed")


def complete(base: str, prompt: list[int], max_tokens: int) -> int:
    r = httpx.post(base + "/v1/completions", json={
        "model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True}, timeout=600)
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


def run_one(model_dir: str, port: int, caching: bool, args) -> dict:
    rng = np.random.default_rng(0)
    vocab = CONFIG["vocab_size"]
    shared = rng.integers(3, vocab, args.prefix_tokens).tolist()
    server = RunningServer(peer(model_dir, port, caching), port)
    try:
        ttfts = [first_token_seconds(server.base, shared + rng.integers(3, vocab, 24).tolist(), 8)
                 for _ in range(args.shared_requests)]
        prompts = [rng.integers(3, vocab, 256).tolist() for _ in range(args.concurrency)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            out = sum(pool.map(lambda p: complete(server.base, p, 64), prompts))
        tok_s = out / (time.perf_counter() - t0)
    finally:
        server.stop()
    return {"caching": caching, "ttft_first_s": ttfts[0], "ttft_hit_s": statistics.median(ttfts[2:]),
            "distinct_out_tok_s": tok_s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix-tokens", type=int, default=1100)
    ap.add_argument("--shared-requests", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--json")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as d:
        write_model(Path(d))
        for caching in (True, False, False, True):
            r = run_one(d, args.port, caching, args)
            print(json.dumps(r), flush=True)
            results.append(r)
    for caching in (True, False):
        rows = [r for r in results if r["caching"] == caching]
        print(f"caching {'on ' if caching else 'off'}: first request TTFT "
              f"{statistics.mean(r['ttft_first_s'] for r in rows):.2f} s, later requests (shared "
              f"{args.prefix_tokens}-token prefix) TTFT {statistics.mean(r['ttft_hit_s'] for r in rows):.2f} s, "
              f"distinct prompts {statistics.mean(r['distinct_out_tok_s'] for r in rows):.1f} out tok/s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
