"""One decode step of 16 sequences on a synthetic Qwen3-MoE (random weights, float32
safetensors; default 64 experts, top-8, hidden 512, expert width 256, 4 layers), in
process, with LoRA enabled and: no adapter in the batch, 1 or 4 distinct adapters on the
attention projections only (the MoE layers keep ops.fused_moe), and 1 or 4 distinct
adapters on every routed expert too (those layers run per op: lora/experts.py). Rank 8.
Best of --iters steps per cell, the cells taking turns. The model forward alone.

    .venv/bin/python benchmarks/moe_lora_step.py [--experts 64 --top-k 8 --iters 10]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "py"))
from lora_checkpoint import write_adapter  # noqa: E402

CONCURRENCY = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inter", type=int, default=256)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--context", type=int, default=64, help="tokens already in each sequence")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    from vllm_metal.lora.manager import LoraManager
    from vllm_metal.models import load_model
    from vllm_metal.models.generate import KVPool, SeqChunk, build_step
    from vllm_metal.models.synthetic_moe import write_qwen3_moe

    tmp = Path(tempfile.mkdtemp(prefix="moe_lora_step_"))
    write_qwen3_moe(tmp / "base", hidden=args.hidden, inter=args.inter, experts=args.experts,
                    top_k=args.top_k, layers=args.layers, heads=8, kv_heads=2, head_dim=64)
    h, i, L, E = args.hidden, args.inter, args.layers, args.experts
    shapes = {}  # only the shapes matter to write_adapter
    for l in range(L):
        for p, shape in (("q_proj", (8 * 64, h)), ("v_proj", (2 * 64, h)), ("o_proj", (h, 8 * 64))):
            shapes[f"model.layers.{l}.self_attn.{p}.weight"] = np.zeros(shape, np.float32) + 0.02
        for e in range(E):
            for p, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
                shapes[f"model.layers.{l}.mlp.experts.{e}.{p}.weight"] = np.zeros(shape, np.float32) + 0.02
    attn = [m[:-7] for m in shapes if ".self_attn." in m]
    everything = [m[:-7] for m in shapes]
    for a in range(4):
        write_adapter(tmp / f"attn{a}", shapes, L, r=args.rank, alpha=16, seed=a, modules=attn)
        write_adapter(tmp / f"exp{a}", shapes, L, r=args.rank, alpha=16, seed=10 + a,
                      modules=everything)
    loaded = load_model(str(tmp / "base"), "float32")
    model = loaded.model
    lora = LoraManager(model, SimpleNamespace(max_loras=8, max_lora_rank=args.rank, max_cpu_loras=8))
    req = {name: SimpleNamespace(lora_int_id=k + 1, lora_name=name, lora_path=str(tmp / name),
                                 load_inplace=False)
           for k, name in enumerate([f"attn{a}" for a in range(4)] + [f"exp{a}" for a in range(4)])}
    for r in req.values():
        lora.add(r)
    pool = KVPool(loaded.spec, CONCURRENCY * (args.context // 16 + 2), 16)
    tables = [[] for _ in range(CONCURRENCY)]
    for t in tables:
        pool.allocate(t, args.context + 1)
    rng = np.random.default_rng(0)
    step = build_step([SeqChunk([int(rng.integers(3, 300))], args.context, t) for t in tables],
                      pool.kv_caches, 16)
    ids = [f"r{k}" for k in range(CONCURRENCY)]
    cu = np.array(step.ctx.cu_seqlens_q)
    cells = {"no adapter": [None] * CONCURRENCY,
             "1 adapter, attention": [req["attn0"]] * CONCURRENCY,
             "4 adapters, attention": [req[f"attn{k % 4}"] for k in range(CONCURRENCY)],
             "1 adapter, attention + experts": [req["exp0"]] * CONCURRENCY,
             "4 adapters, attention + experts": [req[f"exp{k % 4}"] for k in range(CONCURRENCY)]}

    def run(adapters) -> float:
        for rid, r in zip(ids, adapters):
            lora.request_added(rid, r)
        t0 = time.perf_counter()
        lora.begin_step(ids, cu)  # 8 slots: every adapter keeps its slot after the warm-up
        try:
            mx.eval(model(step.input_ids, step.ctx))
        finally:
            lora.end_step()
        return time.perf_counter() - t0

    best = {c: float("inf") for c in cells}
    for adapters in cells.values():
        run(adapters)  # warm-up
    for _ in range(args.iters):
        for c, adapters in cells.items():
            best[c] = min(best[c], run(adapters))
    ref = best["no adapter"]
    print(json.dumps({k: v for k, v in vars(args).items()}))
    print(f"| step of {CONCURRENCY} decode rows | best of {args.iters} (ms) | tok/s | vs no adapter |")
    print("|---|---:|---:|---:|")
    for c, t in best.items():
        print(f"| {c} | {t * 1e3:.2f} | {CONCURRENCY / t:.0f} | {ref / t:.2f} |")


if __name__ == "__main__":
    main()
