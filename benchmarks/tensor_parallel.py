"""TPOT with --tensor-parallel-size 2 and --pipeline-parallel-size 2 vs one process, served
on this machine (the MLX ring over TCP loopback).

A random-weight llama (float16, sized so a decode step is mostly weight reads) is served as
one process (VLLM_METAL_NUM_THREADS=2: both cores), as two tensor-parallel workers (1 thread
each: the same two cores, half the weights each, an all-sum per o_proj/down_proj), and as
two pipeline stages (1 thread each, half the layers each, one send per step), with async
scheduling (pp2: the last stage sends the sampled tokens back on the ring) and without
(pp2-sync: vLLM's scheduler sends them back); one process also both ways. Servers one at a
time, each configuration twice (order one, one-sync, tp2, pp2, pp2-sync, then back).
TPOT: time from the first to the last streamed token over the tokens between, one request
at a time (single stream), median of the requests; also the output tokens/s of
--concurrency requests at once.

    .venv/bin/python benchmarks/tensor_parallel.py [--tokens 64] [--json PATH]
        [--model llama|qwen3_5] [--configs one,tp2,...]

--model qwen3_5 serves a random-weight hybrid Qwen3.5 of about the same size instead
(QWEN3_5_SHAPE: 6 gated-delta-net + 2 full-attention layers; under TP each worker keeps
half of both kinds of heads and of the recurrent state).
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

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests" / "py"))
from compare.servers import Peer, RunningServer  # noqa: E402

SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=8, head_dim=64, vocab_size=8192, tie_word_embeddings=False)


# hidden 1024, MLP 2816, vocab 8192 as SHAPE; attention 8 heads / 2 KV heads of 128 (q with
# its output gate), linear attention 8 key heads of 128 and 16 value heads of 64
QWEN3_5_SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                     num_attention_heads=8, num_key_value_heads=2, head_dim=128, vocab_size=8192,
                     linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=128,
                     linear_value_head_dim=64, full_attention_interval=4,
                     layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2)


def checkpoint(out: Path, model: str = "llama") -> str:
    from qwen3_5_checkpoint import CONFIG, write_checkpoint, write_tokenizer
    from vllm_metal.models.testing import tiny_config, write_random_checkpoint

    if model == "qwen3_5":  # float32 on disk, served as float16 (--dtype)
        rope = dict(CONFIG["rope_parameters"], mrope_section=[6, 5, 5])  # rotary 32 of 128
        return str(write_checkpoint(out, seed=1, config=dict(CONFIG, **QWEN3_5_SHAPE,
                                                              rope_parameters=rope)))
    path = write_random_checkpoint(tiny_config("llama", **SHAPE), out, seed=1, dtype="float16")
    write_tokenizer(path, SHAPE["vocab_size"])
    return str(path)


# name -> (extra `vllm serve` arguments, worker processes)
CONFIGS = {
    "one": ([], 1),
    "one-sync": (["--no-async-scheduling"], 1),
    "tp2": (["--tensor-parallel-size", "2"], 2),
    "pp2": (["--pipeline-parallel-size", "2"], 2),  # async scheduling, vLLM's default
    "pp2-sync": (["--pipeline-parallel-size", "2", "--no-async-scheduling"], 2),
}


def peer(model: str, port: int, name: str) -> Peer:
    vllm = Path(sys.executable).with_name("vllm")
    extra, workers = CONFIGS[name]
    return Peer(name=name,
                argv=[str(vllm), "serve", model, "--served-model-name", "m", "--host", "127.0.0.1",
                      "--port", str(port), "--max-model-len", "512", "--max-num-seqs", "8",
                      "--kv-cache-memory-bytes", str(128 << 20), "--dtype", "float16", *extra],
                model="m", no_eos={"ignore_eos": True},
                env={"VLLM_METAL_NUM_THREADS": str(2 // workers), "VLLM_WORKER_MULTIPROC_METHOD": "fork"})


def tpot(base: str, prompt: list[int], tokens: int) -> float:
    """Seconds per output token after the first, of one streamed greedy request."""
    stamps = []
    with httpx.stream("POST", base + "/v1/completions", timeout=600, json={
            "model": "m", "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":  # one chunk per token
                stamps.append(time.perf_counter())
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def complete(base: str, prompt: list[int], tokens: int) -> int:
    r = httpx.post(base + "/v1/completions", timeout=600, json={
        "model": "m", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


def run_one(model: str, port: int, name: str, args) -> dict:
    prompts = [[(7 * i + j) % 8000 + 10 for j in range(32)] for i in range(8)]
    server = RunningServer(peer(model, port, name), port)
    try:
        complete(server.base, prompts[0], 8)  # warm
        single = statistics.median(tpot(server.base, p, args.tokens) for p in prompts[:3])
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            out = sum(pool.map(lambda p: complete(server.base, p, args.tokens), prompts[:args.concurrency]))
        batch = out / (time.perf_counter() - t0)
    finally:
        server.stop()
    return {"config": name, "tpot_ms": single * 1e3, "concurrent_tok_s": batch}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--port", type=int, default=18250)
    ap.add_argument("--json")
    ap.add_argument("--model", choices=["llama", "qwen3_5"], default="llama")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = checkpoint(Path(tmp) / args.model, args.model)
        results = []
        order = args.configs.split(",")
        for name in order + order[::-1]:
            r = run_one(model, args.port, name, args)
            print(json.dumps(r), flush=True)
            results.append(r)
    for name in order:
        rows = [r for r in results if r["config"] == name]
        print(f"{name}: TPOT {statistics.mean(r['tpot_ms'] for r in rows):.1f} ms, concurrency "
              f"{args.concurrency} {statistics.mean(r['concurrent_tok_s'] for r in rows):.1f} tok/s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
