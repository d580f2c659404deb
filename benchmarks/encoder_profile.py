"""Where one all-MiniLM-L6-v2 forward goes, op by op (models/bert.py on the CPU).

Runs each op of the encoder's layers on its own (mx.eval after each) over real weights and
random token ids, and reports per op: wall ms, CPU ms (time.process_time) and CPU / wall,
which says how many threads the op keeps busy (about 1 for MLX's CPU elementwise ops, up to
--threads for ours). Summed over the layers; median of --reps forwards after a warm-up.

    .venv/bin/python benchmarks/encoder_profile.py [--shapes 32x512,256x16] [--threads 2]
        [--reps 3] [--split]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import mlx.core as mx
import numpy as np


def profile_forward(model, ids, cu, stamp, split: bool) -> mx.array:
    """One forward of model (an EncoderModel), calling stamp(name, fn) for each op."""
    from vllm_metal.models.bert import add_layer_norm

    t = ids.shape[0]
    positions = mx.array(model.positions_of(cu))
    cu_mx = mx.array(cu)
    emb = model.embeddings
    x = stamp("embeddings", lambda: add_layer_norm(emb.norm, emb.word(ids) + emb.position(positions),
                                                   emb.token_type(mx.zeros((t,), mx.int32))))
    for layer in model.layers:
        ops_of = _split_ops if split else _layer_ops
        for name, fn in ops_of(layer, x, cu_mx):
            x = stamp(name, fn)
    return x


def _layer_ops(layer, x, cu):
    """models/bert.py _Layer.__call__ as it runs, one op at a time: (name, fn) pairs, each fn
    reading what the previous ones stamped (a generator: it resumes after each stamp)."""
    from vllm_metal.models.bert import add_layer_norm

    s = {}
    yield "qkv (+bias)", lambda: s.setdefault("qkv", layer.qkv(x))
    yield "attention", lambda: s.setdefault("a", _attn(layer, s["qkv"], cu))
    yield "attn_out (+bias)", lambda: s.setdefault("o", layer.attn_out(s["a"]))
    yield "residual + LayerNorm", lambda: s.setdefault("h", add_layer_norm(layer.attn_norm, s["o"], x))
    yield "up (+bias, GELU)", lambda: s.setdefault("u", layer.up_act(s["h"]))
    yield "down (+bias)", lambda: s.setdefault("d", layer.down(s["u"]))
    yield "residual + LayerNorm", lambda: add_layer_norm(layer.out_norm, s["d"], s["h"])


def _split_ops(layer, x, cu):
    """The layer as it ran before the fused epilogue and layer_norm: every bias add, GELU,
    residual add and LayerNorm a separate MLX op (ops.gelu for GELU)."""
    s = {}
    mm = _matmul_only
    yield "qkv matmul", lambda: s.setdefault("qkv0", mm(layer.qkv, x))
    yield "qkv bias", lambda: s.setdefault("qkv", s["qkv0"] + layer.qkv.bias)
    yield "attention", lambda: s.setdefault("a", _attn(layer, s["qkv"], cu))
    yield "attn_out matmul", lambda: s.setdefault("o0", mm(layer.attn_out, s["a"]))
    yield "attn_out bias", lambda: s.setdefault("o", s["o0"] + layer.attn_out.bias)
    yield "residual add", lambda: s.setdefault("r1", s["o"] + x)
    yield "layernorm", lambda: s.setdefault("h", layer.attn_norm(s["r1"]))
    yield "up matmul", lambda: s.setdefault("u0", mm(layer.up, s["h"]))
    yield "up bias", lambda: s.setdefault("u1", s["u0"] + layer.up.bias)
    yield "gelu", lambda: s.setdefault("u", layer.act(s["u1"]))
    yield "down matmul", lambda: s.setdefault("d0", mm(layer.down, s["u"]))
    yield "down bias", lambda: s.setdefault("d", s["d0"] + layer.down.bias)
    yield "residual add", lambda: s.setdefault("r2", s["d"] + s["h"])
    yield "layernorm", lambda: layer.out_norm(s["r2"])


def _matmul_only(linear, x):
    from vllm_metal import ops

    blocks, qtype, shape = linear.matmul_args()
    return ops.gguf_matmul(x, blocks, qtype, shape, exact=linear.exact)


def _attn(layer, qkv, cu):
    from vllm_metal import ops

    t = qkv.shape[0]
    q = qkv.reshape(t, 3, layer.heads, layer.head_dim)
    return ops.varlen_attention(q[:, 0], q[:, 1], q[:, 2], cu_seqlens=cu,
                                scale=layer.head_dim ** -0.5).reshape(t, -1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="32x512,256x16", help="batch x tokens, comma-separated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--split", action="store_true",
                    help="every bias add, GELU, residual add and LayerNorm a separate MLX op "
                         "(the layer before the fused epilogue and layer_norm)")
    a = ap.parse_args()

    from vllm_metal import _core
    from vllm_metal.models.bert import load_encoder
    from vllm_metal.models.offline import minilm_dir

    _core.set_num_threads(a.threads)
    model = load_encoder(minilm_dir())
    rng = np.random.default_rng(0)
    print(f"all-MiniLM-L6-v2 float32, {a.threads} threads, median of {a.reps} forwards; "
          "ms summed over the 6 layers")
    for shape in a.shapes.split(","):
        batch, length = (int(v) for v in shape.split("x"))
        ids = mx.array(rng.integers(1000, 30000, batch * length).astype(np.int32))
        cu = (np.arange(batch + 1) * length).astype(np.int32)
        runs = []
        for rep in range(a.reps + 1):
            wall, cpu = defaultdict(float), defaultdict(float)

            def stamp(name, fn):
                w0, c0 = time.perf_counter(), time.process_time()
                y = fn()
                mx.eval(y)
                wall[name] += time.perf_counter() - w0
                cpu[name] += time.process_time() - c0
                return y

            w0 = time.perf_counter()
            profile_forward(model, ids, cu, stamp, a.split)
            total = time.perf_counter() - w0
            if rep:
                runs.append((wall, cpu, total))
        names = list(runs[0][0])
        med = {n: (statistics.median(r[0][n] for r in runs) * 1e3,
                   statistics.median(r[1][n] for r in runs) * 1e3) for n in names}
        total = statistics.median(r[2] for r in runs) * 1e3
        print(f"\n{batch} x {length} tokens: forward {total:.1f} ms wall\n")
        print("| op | wall ms | share | CPU ms | CPU / wall |")
        print("|---|---:|---:|---:|---:|")
        for n in sorted(names, key=lambda n: -med[n][0]):
            w, c = med[n]
            print(f"| {n} | {w:.1f} | {w / total:.0%} | {c:.1f} | {c / max(w, 1e-9):.2f} |")


if __name__ == "__main__":
    main()
