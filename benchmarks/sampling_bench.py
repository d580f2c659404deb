"""Sampling cost per step: the native MLX sampler vs vLLM's torch Sampler on
the same logits, batch 1/16/64, vocab 49152 (SmolLM2) and 151936 (Qwen),
rows with mixed parameters. Prints one JSON line per case and a table.

    .venv/bin/python benchmarks/sampling_bench.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
import numpy as np
import torch
from vllm import SamplingParams

from vllm_metal.sampling import Sampler, SamplingTable, gather_batch
from vllm_metal.sampling.torch_sampler import TorchSampler

# one of each kind, cycled over the batch (a batch of 1 is a plain temperature request)
MIX = [
    dict(temperature=0.8, seed=1),
    dict(temperature=0.0),
    dict(temperature=0.7, top_k=40),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=0.9, min_p=0.05, top_k=50, top_p=0.95),
    dict(temperature=0.8, repetition_penalty=1.1, frequency_penalty=0.2, logprobs=5),
]


def make_batch(n: int, vocab: int, rng):
    table = SamplingTable(vocab, rows=n, seed=0)
    history = {}
    for i in range(n):
        tokens = rng.integers(0, vocab, size=96).tolist()  # 64 prompt + 32 outputs
        table.add(i, f"r{i}", SamplingParams(**MIX[i % len(MIX)]), tokens[:64], 64)
        history[f"r{i}"] = tokens
    rows = np.arange(n, dtype=np.int32)
    gen = np.full(n, 32, np.int32)
    return table, rows, gen, history.__getitem__


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    ours, theirs = Sampler(), TorchSampler()
    rows_out = []
    for vocab in (49152, 151936):
        for n in (1, 16, 64):
            table, rows, gen, tok = make_batch(n, vocab, rng)
            logits_np = rng.normal(scale=3.0, size=(n, vocab)).astype(np.float32)
            logits = mx.array(logits_np)
            mx.eval(logits)

            def native():
                b = gather_batch(table, rows, gen, tok)
                r = ours(logits, b)
                mx.eval(r.tokens, *(r.logprobs or ()))

            ref_batch = gather_batch(table, rows, gen, tok, for_reference=True)
            x = torch.from_numpy(logits_np)

            def vllm_torch():
                # vLLM keeps its metadata persistently; only the Sampler call is timed
                theirs.sampler(x.clone(), meta)

            meta = theirs.metadata(x, ref_batch)
            t_ours = median_ms(native, args.repeats)
            t_torch = median_ms(vllm_torch, args.repeats)
            rec = dict(vocab=vocab, batch=n, native_ms=round(t_ours, 2), vllm_torch_ms=round(t_torch, 2),
                       speedup=round(t_torch / t_ours, 2))
            print(json.dumps(rec), flush=True)
            rows_out.append(rec)
    print("\n| vocab | batch | native MLX (ms) | vLLM torch Sampler (ms) | torch / native |")
    print("|---|---|---|---|---|")
    for r in rows_out:
        print(f"| {r['vocab']} | {r['batch']} | {r['native_ms']} | {r['vllm_torch_ms']} | {r['speedup']}x |")


if __name__ == "__main__":
    main()
