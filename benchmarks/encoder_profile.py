"""Where one all-MiniLM-L6-v2 forward goes, op by op (models/bert.py on the CPU).

Runs each op of the encoder's layers on its own (mx.eval after each) over real weights and
random token ids, and reports per op: wall ms, CPU ms (time.process_time) and CPU / wall,
which says how many threads the op keeps busy (about 1 for MLX's CPU elementwise ops, up to
--threads for ours). Summed over the layers; median of --reps forwards after a warm-up.

    .venv/bin/python benchmarks/encoder_profile.py [--shapes 32x512,256x16] [--threads 2]
        [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import mlx.core as mx
import numpy as np


def profile_forward(model, ids, cu, stamp) -> mx.array:
    """One forward of model (an EncoderModel), calling stamp(name, fn) for each op."""
    t = ids.shape[0]
    positions = mx.array(model.positions_of(cu))
    cu_mx = mx.array(cu)
    x = stamp("embeddings", lambda: model.embeddings(ids, positions, mx.zeros((t,), mx.int32)))
    for layer in model.layers:
        fused = hasattr(layer, "fused_ops")  # the layer's own sequence of ops, if it names them
        for name, fn in (layer.fused_ops(x, cu_mx) if fused else _plain_ops(layer, x, cu_mx)):
            x = stamp(name, fn)
    return x


def _plain_ops(layer, x0, cu):
    """models/bert.py _Layer.__call__, one op at a time (a generator: each op reads the
    previous op's stamped result through `state`)."""
    t = x0.shape[0]
    state = {"x": x0}

    def step(name, fn):
        def run():
            state["y"] = fn()
            return state["y"]
        return name, run

    yield step("qkv matmul", lambda: _matmul_only(layer.qkv, state["x"]))
    yield step("qkv bias", lambda: state["y"] + layer.qkv.bias)
    yield step("attention", lambda: (lambda q: _attn(layer, q, cu, t))(state["y"]))
    yield step("attn_out matmul", lambda: _matmul_only(layer.attn_out, state["y"]))
    yield step("attn_out bias", lambda: state["y"] + layer.attn_out.bias)
    yield step("residual add", lambda: state["y"] + state["x"])
    yield step("layernorm", lambda: layer.attn_norm(state["y"]))
    state_h = {}

    def save_h():
        state_h["h"] = state["y"]
        return state["y"]
    yield "(keep)", save_h
    yield step("up matmul", lambda: _matmul_only(layer.up, state_h["h"]))
    yield step("up bias", lambda: state["y"] + layer.up.bias)
    yield step("gelu", lambda: layer.act(state["y"]))
    yield step("down matmul", lambda: _matmul_only(layer.down, state["y"]))
    yield step("down bias", lambda: state["y"] + layer.down.bias)
    yield step("residual add", lambda: state["y"] + state_h["h"])
    yield step("layernorm", lambda: layer.out_norm(state["y"]))


def _matmul_only(linear, x):
    from vllm_metal import ops

    blocks, qtype, shape = linear.matmul_args()
    return ops.gguf_matmul(x, blocks, qtype, shape, exact=linear.exact)


def _attn(layer, qkv, cu, t):
    from vllm_metal import ops

    q = qkv.reshape(t, 3, layer.heads, layer.head_dim)
    return ops.varlen_attention(q[:, 0], q[:, 1], q[:, 2], cu_seqlens=cu,
                                scale=layer.head_dim ** -0.5).reshape(t, -1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="32x512,256x16", help="batch x tokens, comma-separated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
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
            profile_forward(model, ids, cu, stamp)
            total = time.perf_counter() - w0
            if rep:
                runs.append((wall, cpu, total))
        names = [n for n in runs[0][0] if n != "(keep)"]
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
