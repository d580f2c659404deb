"""Speculative decoding with a draft model or an EAGLE3 head: what the machinery costs,
served.

No offline pair of models shares a vocabulary with a small and a large member, and no
trained EAGLE3 head is offline, so this measures bounds of the cost on SmolLM2-135M (Q4_1
GGUF):
- draft_model: SmolLM2 drafting for itself, every draft kept (batch-invariant logits),
  the draft as expensive as the target;
- eagle3: a random head as wide as SmolLM2 (one layer, SmolLM2's MLP width, a 32,000-token
  draft vocabulary), so nearly every draft is rejected: each step pays for k drafts and the
  head's passes and keeps one token, the worst case.
Servers one at a time in the order none, method, method, none; greedy requests with
ignore_eos, one at a time (single stream) and --concurrency at once; output tokens/s.

    .venv/bin/python benchmarks/draft_model.py [--method draft_model|eagle3] [--tokens 128]
        [--k 3] [--json PATH]

A real draft is several times cheaper than its target; the speedup then follows from the
acceptance rate, which /metrics reports (vllm:spec_decode_num_accepted_tokens_total).
"""

from __future__ import annotations

import argparse
import json
import statistics
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


def peer(gguf: str, port: int, spec: dict | None) -> Peer:
    vllm = Path(sys.executable).with_name("vllm")
    flags = [] if spec is None else ["--speculative-config", json.dumps(spec)]
    return Peer(name="none" if spec is None else spec["method"],
                argv=[str(vllm), "serve", gguf, "--served-model-name", "m", "--host", "127.0.0.1",
                      "--port", str(port), "--max-model-len", "1024", "--max-num-seqs", "8",
                      "--kv-cache-memory-bytes", str(256 << 20), *flags],
                model="m", no_eos={"ignore_eos": True})


def complete(base: str, prompt: str, tokens: int) -> int:
    r = httpx.post(base + "/v1/completions", json={
        "model": "m", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True},
        timeout=600)
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


def run_one(gguf: str, port: int, spec: dict | None, args) -> dict:
    server = RunningServer(peer(gguf, port, spec), port)
    try:
        complete(server.base, PROMPTS[0], 8)  # warm
        t0 = time.perf_counter()
        out = sum(complete(server.base, p, args.tokens) for p in PROMPTS[:2])
        single = out / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            out = sum(pool.map(lambda p: complete(server.base, p, args.tokens),
                               (PROMPTS * args.concurrency)[:args.concurrency]))
        batch = out / (time.perf_counter() - t0)
    finally:
        server.stop()
    return {"draft": spec is not None, "single_tok_s": single, "concurrent_tok_s": batch}


def main() -> None:
    from vllm_metal.models.offline import OFFLINE_GGUF

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--port", type=int, default=8766)
    ap.add_argument("--method", choices=["draft_model", "eagle3"], default="draft_model")
    ap.add_argument("--json")
    args = ap.parse_args()
    gguf = str(OFFLINE_GGUF["smollm2"]())
    if args.method == "draft_model":
        spec = {"method": "draft_model", "model": gguf, "num_speculative_tokens": args.k}
        label = f"self-draft k={args.k}"
    else:
        import tempfile

        from vllm_metal.models.testing import write_random_eagle3_head

        head, *_ = write_random_eagle3_head(tempfile.mkdtemp(prefix="eagle3-"), 576, 49152,
                                            draft_vocab=32000, heads=9, kv=3, intermediate=1536)
        spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": args.k}
        label = f"random EAGLE3 head k={args.k} (drafts rejected)"
    results = []
    for s in (None, spec, spec, None):
        r = run_one(gguf, args.port, s, args)
        print(json.dumps(r), flush=True)
        results.append(r)
    for draft in (False, True):
        rows = [r for r in results if r["draft"] == draft]
        print(f"{label if draft else 'no speculation'}: single stream "
              f"{statistics.mean(r['single_tok_s'] for r in rows):.1f} tok/s, concurrency "
              f"{args.concurrency} {statistics.mean(r['concurrent_tok_s'] for r in rows):.1f} tok/s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
