"""One packed serving step of the Qwen3.5 text forward (models/qwen3_5_paged.py) on the CPU.

Qwen3.5-0.8B layer shapes (hidden 1024, 24 layers: 18 gated delta net + 6 attention, 16 key
and value heads of 128 for the linear layers, 8/2 heads of 256 for attention, MLP 3584),
random weights, vocabulary cut to 8192 so the lm_head does not dominate; bfloat16. Every
step must read all weights once, so a decode step is bounded below by weight bytes /
memory bandwidth (29 GB/s on these machines, DESIGN.md; pass --gbps to change).

    prefill   N requests x 128 tokens in one step: tokens/s
    decode    N requests x 1 token (context 128): step ms, tokens/s, and the bound

    .venv/bin/python benchmarks/qwen3_5_step.py [--rows 1 8] [--gbps 29] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import fields
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

CONFIG = dict(
    model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"], hidden_size=1024,
    intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
    head_dim=256, vocab_size=8192, rms_norm_eps=1e-6, linear_num_value_heads=16,
    linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, full_attention_interval=4, tie_word_embeddings=True,
    max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "mrope_section": [11, 11, 10], "rope_theta": 1e7,
                     "partial_rotary_factor": 0.25})
BLOCK = 32


def write_model(out: Path) -> None:
    """mlx-lm's own random init, saved in its sanitized layout (loads unchanged)."""
    from mlx_lm.models import qwen3_5

    mx.random.seed(0)
    model = qwen3_5.TextModel(qwen3_5.TextModelArgs.from_dict(CONFIG))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    # vLLM reads the dtype from config.json; without it, it reads mlx's safetensors header
    # and fails on the metadata entry
    (out / "config.json").write_text(json.dumps({**CONFIG, "torch_dtype": "bfloat16"}))


def step(model, kv, pools, chunks, slots, has_init):
    from vllm_metal.models.generate import build_step
    from vllm_metal.models.qwen3_5_paged import HybridContext

    packed = build_step(chunks, kv, BLOCK)
    c = packed.ctx
    ctx = HybridContext(**{f.name: getattr(c, f.name) for f in fields(c)},
                        cu_seqlens_state=c.cu_seqlens_q, state_slots=mx.array(slots, dtype=mx.int32),
                        has_initial_state=mx.array(has_init, dtype=mx.int32), state_pools=pools)
    logits = model(packed.input_ids, ctx)
    mx.eval(logits, ctx.kv_caches, [(p.conv, p.ssm) for p in pools if p is not None])
    return ctx.kv_caches


def main() -> None:
    from vllm_metal.models import load_model
    from vllm_metal.models.generate import SeqChunk

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--gbps", type=float, default=29.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        write_model(Path(d))
        loaded = load_model(d, "bfloat16")
    model = loaded.model
    weight_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    bound_ms = weight_bytes / (args.gbps * 1e9) * 1e3
    results = []
    for n in args.rows:
        blocks = 8  # 256 tokens a request
        shape = (n * blocks, BLOCK, CONFIG["num_key_value_heads"], CONFIG["head_dim"])
        kv = [None if lin else (mx.zeros(shape, mx.bfloat16), mx.zeros(shape, mx.bfloat16))
              for lin in model.is_linear]
        pools = model.make_state_pools(n, mx.bfloat16)
        tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(n)]
        t0 = time.perf_counter()
        kv = step(model, kv, pools, [SeqChunk(list(range(3, 131)), 0, tables[i]) for i in range(n)],
                  list(range(n)), [0] * n)
        prefill = time.perf_counter() - t0
        times = []
        for s in range(args.reps + 1):
            t0 = time.perf_counter()
            kv = step(model, kv, pools, [SeqChunk([5], 128 + s, tables[i]) for i in range(n)],
                      list(range(n)), [1] * n)
            times.append(time.perf_counter() - t0)
        ms = 1e3 * statistics.median(times[1:])
        results.append(dict(rows=n, prefill_tok_s=round(128 * n / prefill, 1),
                            decode_step_ms=round(ms, 1), decode_tok_s=round(n / ms * 1e3, 1),
                            bound_step_ms=round(bound_ms, 1)))
        print(json.dumps(results[-1]))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(weight_mib=weight_bytes / 2**20, results=results)))


if __name__ == "__main__":
    main()
