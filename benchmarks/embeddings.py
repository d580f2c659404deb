"""Embedding throughput: `vllm serve --runner pooling` (ours) against transformers on CPU
torch, on the same model, in one run.

The model is the offline SmolLM2-135M Q4_1 GGUF served as a last-token embedder (vLLM's
`--convert embed` of a causal LM; normalised embeddings). Ours reads the GGUF blocks;
transformers loads the same file dequantized to float32 (compare/mlx_checkpoint.py) and
pools the last hidden state of each input itself, a batch per forward, on the same thread count.

For each input length (default 16 and 512 tokens of random ids) and batch size (default
1, 8, 32), one /v1/embeddings request carries the whole batch; the cell's time is the
median over --reps requests after one warm-up. Reported: inputs/s and tokens/s of each,
and ours / transformers. Embeddings of the two are compared too (cosine of the first
input of every cell), so the peers are known to compute the same thing.

    .venv/bin/python benchmarks/embeddings.py [--lengths 16,512] [--batches 1,8,32]
        [--reps 3] [--threads 2] [--port 8640] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "compare"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from rope_bench import cpu_model, load_average  # noqa: E402
from servers import Peer, RunningServer  # noqa: E402


def ours_peer(gguf: str, port: int, threads: int, max_seqs: int, budget: int) -> Peer:
    vllm = Path(sys.executable).with_name("vllm")
    return Peer(
        name="vllm-metal",
        argv=[str(vllm), "serve", gguf, "--runner", "pooling", "--served-model-name", "m",
              "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "1024",
              "--max-num-seqs", str(max_seqs), "--max-num-batched-tokens", str(budget),
              "--kv-cache-memory-bytes", str(1 << 30),
              # every repetition sends the same inputs: a prefix-cache hit would leave
              # only the last token of each to compute
              "--no-enable-prefix-caching"],
        model="m", no_eos={}, env={"VLLM_METAL_NUM_THREADS": str(threads)})


def served_cell(base: str, batch: list[list[int]], reps: int) -> tuple[float, np.ndarray]:
    """Median seconds of one request embedding `batch`, and its first embedding."""
    body = {"model": "m", "input": batch}
    # a batch of long inputs takes minutes on two cores: no client timeout
    with httpx.Client(base_url=base, timeout=None) as client:
        first = None
        times = []
        for i in range(reps + 1):
            start = time.perf_counter()
            r = client.post("/v1/embeddings", json=body)
            elapsed = time.perf_counter() - start
            r.raise_for_status()
            if i == 0:
                first = np.array(r.json()["data"][0]["embedding"])
            else:
                times.append(elapsed)
    return statistics.median(times), first


def transformers_cells(gguf: str, cells: list[tuple[int, int, list]], threads: int, reps: int):
    """{(length, batch): (median seconds, first embedding)} of transformers' CPU forward."""
    import torch
    import transformers

    import mlx.core as mx
    from mlx_checkpoint import mlx_checkpoint

    torch.set_num_threads(threads)
    dense = mlx_checkpoint(gguf, mx.float32)  # the GGUF dequantized, HF names and layout
    model = transformers.AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    out = {}
    for length, size, batch in cells:
        ids = torch.tensor(batch)
        times, first = [], None
        for i in range(reps + 1):
            start = time.perf_counter()
            with torch.no_grad():
                h = model.model(input_ids=ids).last_hidden_state[:, -1]
                emb = torch.nn.functional.normalize(h, dim=-1)
            elapsed = time.perf_counter() - start
            if i == 0:
                first = emb[0].numpy()
            else:
                times.append(elapsed)
        out[(length, size)] = (statistics.median(times), first)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="16,512")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--port", type=int, default=8640)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from vllm_metal.models.offline import smollm2_gguf

    gguf = str(smollm2_gguf())
    lengths = [int(x) for x in args.lengths.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    rng = np.random.default_rng(0)
    cells = [(n, b, rng.integers(100, 49000, (b, n)).tolist()) for n in lengths for b in batches]

    server = RunningServer(ours_peer(gguf, args.port, args.threads, max(batches),
                                     budget=max(2048, max(lengths))), args.port)
    try:
        ours = {(n, b): served_cell(server.base, batch, args.reps) for n, b, batch in cells}
    finally:
        server.stop()
    theirs = transformers_cells(gguf, cells, args.threads, args.reps)

    print(f"# embeddings: SmolLM2-135M Q4_1 as a last-token embedder, {args.threads} threads, "
          f"{cpu_model()}, load {load_average()}")
    print(f"{'tokens':>6} {'batch':>5} | {'ours in/s':>9} {'tok/s':>8} | {'hf in/s':>9} {'tok/s':>8} | "
          f"{'ratio':>5} | cosine")
    rows = []
    for n, b, _ in cells:
        (t_ours, e_ours), (t_hf, e_hf) = ours[(n, b)], theirs[(n, b)]
        cos = float(e_ours @ e_hf / (np.linalg.norm(e_ours) * np.linalg.norm(e_hf)))
        row = dict(tokens=n, batch=b, ours_inputs_per_s=b / t_ours, ours_tokens_per_s=b * n / t_ours,
                   transformers_inputs_per_s=b / t_hf, transformers_tokens_per_s=b * n / t_hf,
                   ratio=t_hf / t_ours, cosine=cos)
        rows.append(row)
        print(f"{n:>6} {b:>5} | {row['ours_inputs_per_s']:>9.1f} {row['ours_tokens_per_s']:>8.0f} | "
              f"{row['transformers_inputs_per_s']:>9.1f} {row['transformers_tokens_per_s']:>8.0f} | "
              f"{row['ratio']:>5.2f} | {cos:.4f}")
    print("# JSON")
    for row in rows:
        print(json.dumps(row))
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_model(), "threads": args.threads, "rows": rows},
                                              indent=2))


if __name__ == "__main__":
    main()
