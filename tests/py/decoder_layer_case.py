"""One decoder layer's Metal plan on NumPy arrays (decode-shaped batches), and a NumPy
reference of the layer that rounds where the kernels round (docs/kernels.md, "Metal
decoder layer plan"). Shared by test_decoder_layer_metal, test_metal_kernel_checks and
test_kernel_traffic."""

from __future__ import annotations

import dataclasses

import mlx.core as mx  # noqa: F401 -- before _core
import numpy as np
from gguf import GGMLQuantizationType as T

from test_gguf_fixtures import random_blocks, reference_dequantize
from vllm_metal import _core

NP = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "int32": np.int32}
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def to_f64(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def from_f64(a: np.ndarray, dtype: str) -> np.ndarray:
    """Round to dtype (nearest even), stored as the kernels store it."""
    if dtype == "bfloat16":
        u = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.asarray(a).astype(NP[dtype])


def rd(a: np.ndarray, dtype: str) -> np.ndarray:
    """a rounded to dtype, as float64 (float32 first, as a float32 kernel value is)."""
    return to_f64(from_f64(np.asarray(a, np.float64).astype(np.float32), dtype), dtype)


@dataclasses.dataclass
class LayerCase:
    name: str
    spec: object
    dtype: str
    plan: list
    arrays: list        # by slot: inputs, then outputs
    slots: dict         # name -> slot
    ctx: list           # context length of each row (its position + 1)
    block_size: int
    dense: dict         # projection -> float64 [n, k]
    float_weights: dict  # norm / bias name -> float64


def make_case(types=("Q4_K",) * 7, dtype="float32", rows=3, *, hidden=256, heads=4,
              kv_heads=2, head_dim=64, intermediate=256, qkv_bias=False, o_bias=False,
              qk_norm=False, sandwich=False, gelu=False, neox=True, rotary_dim=None,
              ctx=None, block_size=16, seed=0) -> LayerCase:
    rng = np.random.default_rng(seed)
    types = [T[t] if isinstance(t, str) else t for t in types]
    spec = _core.DecoderLayerSpec()
    spec.hidden, spec.num_heads, spec.num_kv_heads = hidden, heads, kv_heads
    spec.head_dim, spec.intermediate = head_dim, intermediate
    spec.norm_eps, spec.qk_norm_eps = 1e-5, 1e-6
    spec.qkv_bias, spec.o_bias, spec.qk_norm = qkv_bias, o_bias, qk_norm
    spec.sandwich, spec.gelu = sandwich, gelu
    spec.types = [int(t) for t in types]
    spec.rotary_dim = rotary_dim or head_dim
    spec.neox = neox
    spec.scale = head_dim ** -0.5
    table, mscale = _core.rope_turn_table(spec.rotary_dim, base=10000.0)
    spec.rope_mscale = mscale
    ctx = list(ctx or [int(c) for c in rng.integers(1, 70, rows)])
    assert len(ctx) == rows
    q_w, kv_w = heads * head_dim, kv_heads * head_dim
    shapes = dict(q_proj=(q_w, hidden), k_proj=(kv_w, hidden), v_proj=(kv_w, hidden),
                  o_proj=(hidden, q_w), gate_proj=(intermediate, hidden),
                  up_proj=(intermediate, hidden), down_proj=(hidden, intermediate))
    weights, dense, floats = {}, {}, {}
    for i, name in enumerate(PROJECTIONS):
        n, k = shapes[name]
        blocks = random_blocks(types[i], n, k, seed=seed * 31 + i)
        weights[name] = blocks.reshape(-1)
        dense[name] = reference_dequantize(blocks, types[i], (n, k)).astype(np.float64)
    norm_like = {"input_norm": hidden, "post_norm": hidden, "attn_out_norm": hidden,
                 "mlp_out_norm": hidden, "q_norm": head_dim, "k_norm": head_dim}
    bias_like = {"q_bias": q_w, "k_bias": kv_w, "v_bias": kv_w, "o_bias": hidden}
    for name in spec.weight_names():
        if name in norm_like:
            w = 1.0 + 0.2 * rng.standard_normal(norm_like[name])
            if name in ("input_norm", "post_norm"):  # keeps the projections' outputs O(1)
                first = "q_proj" if name == "input_norm" else "gate_proj"
                w /= np.sqrt(hidden) * dense[first].std()
        elif name in bias_like:
            w = 0.3 * rng.standard_normal(bias_like[name])
        else:
            continue
        weights[name] = from_f64(w, dtype)
        floats[name] = to_f64(weights[name], dtype)

    num_blocks = sum(-(-c // block_size) for c in ctx) + 3
    perm = rng.permutation(num_blocks)
    tables, used = [], 0
    for c in ctx:
        nb = -(-c // block_size)
        tables.append(perm[used:used + nb])
        used += nb
    max_blocks = max(len(t) for t in tables)
    block_tables = np.zeros((rows, max_blocks), np.int32)
    for i, t in enumerate(tables):
        block_tables[i, :len(t)] = t
    positions = np.array([c - 1 for c in ctx], np.int32)
    slot_mapping = np.array([tables[i][p // block_size] * block_size + p % block_size
                             for i, p in enumerate(positions)], np.int64)
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = from_f64(rng.standard_normal(cache_shape), dtype)
    value_cache = from_f64(rng.standard_normal(cache_shape), dtype)
    x = from_f64(rng.standard_normal((rows, hidden)), dtype)
    inputs = [x, positions, slot_mapping, block_tables, np.array(ctx, np.int32),
              np.arange(rows + 1, dtype=np.int32), key_cache, value_cache,
              np.ascontiguousarray(np.array(table))]
    inputs += [weights[n] for n in spec.weight_names()]
    plan, outs = _core.plan_decoder_layer(spec, dtype, rows, rows, num_blocks, block_size,
                                          max_blocks, rows, max(ctx), 1)
    outputs = [np.zeros(shape, NP[dt] if dt != "float32" else np.float32) for shape, dt in outs]
    names = ["out", "q", "attn", "h", "act", "o", "d", "xn", "q_projected", "k_projected",
             "v_projected", "up", "partial_out", "partial_max", "partial_sum"]
    base = len(inputs)
    slots = {n: base + i for i, n in enumerate(names)}
    slots.update(x=0, key_cache=6, value_cache=7)
    for i, n in enumerate(spec.weight_names()):
        slots[n] = 9 + i
    return LayerCase(f"decoder_layer({','.join(t.name for t in types)},{dtype},m={rows})",
                     spec, dtype, plan, inputs + outputs, slots, ctx, block_size, dense, floats)


def _rms(x: np.ndarray, w: np.ndarray, eps: float, dtype: str) -> np.ndarray:
    inv = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return rd(x * inv * w, dtype)


def _rope(x: np.ndarray, positions: np.ndarray, table: np.ndarray, mscale: float, neox: bool):
    """x [rows, heads, D] float64, rotated by the turn table's exact angles."""
    half = table.shape[1]
    rate = (table[1].astype(object) << 32) | table[0].astype(object)
    out = x.copy()
    for r, pos in enumerate(positions):
        turns = np.array([((int(pos) * int(g)) % (1 << 64)) / float(1 << 64) for g in rate])
        c, s = np.cos(2 * np.pi * turns) * mscale, np.sin(2 * np.pi * turns) * mscale
        i1 = np.arange(half) if neox else 2 * np.arange(half)
        i2 = i1 + half if neox else i1 + 1
        a, b = x[r][:, i1], x[r][:, i2]
        out[r][:, i1] = a * c - b * s
        out[r][:, i2] = b * c + a * s
    return out


def reference(case: LayerCase) -> dict:
    """The layer in float64 NumPy, rounded to the dtype where the kernels round.
    Returns q [rows, Hq*D], k and v [rows, Hkv, D] (what goes to the cache), h, act, out."""
    s, dt, a = case.spec, case.dtype, case.arrays
    f, W = case.float_weights, case.dense
    x = to_f64(a[0], dt)
    positions, table = a[1], a[8]
    rows, hq, hkv, d = x.shape[0], s.num_heads, s.num_kv_heads, s.head_dim
    xn = _rms(x, f["input_norm"], s.norm_eps, dt)
    proj = {}
    for name, heads in (("q", hq), ("k", hkv), ("v", hkv)):
        y = rd(xn @ W[name + "_proj"].T, dt)
        if s.qkv_bias:
            y = rd(y + f[name + "_bias"], dt)
        y = y.reshape(rows, heads, d)
        if s.qk_norm and name != "v":
            y = _rms(y, f[name + "_norm"], s.qk_norm_eps, dt)
        if name != "v":
            rot = _rope(y[..., :s.rotary_dim], positions, table, s.rope_mscale, s.neox)
            y = np.concatenate([rd(rot, dt), y[..., s.rotary_dim:]], axis=-1)
        proj[name] = y
    kc, vc = to_f64(a[6], dt).copy(), to_f64(a[7], dt).copy()
    bs = case.block_size
    flat_k = kc.reshape(-1, hkv, d)
    flat_v = vc.reshape(-1, hkv, d)
    for r, slot in enumerate(a[2]):
        flat_k[slot], flat_v[slot] = proj["k"][r], proj["v"][r]
    attn = np.zeros((rows, hq, d))
    group = hq // hkv
    for r, c in enumerate(case.ctx):
        table_r = a[3][r]
        idx = [table_r[p // bs] * bs + p % bs for p in range(c)]
        keys, values = flat_k[idx], flat_v[idx]  # [c, hkv, d]
        for h in range(hq):
            sc = keys[:, h // group] @ proj["q"][r, h] * s.scale
            p = np.exp(sc - sc.max())
            attn[r, h] = p @ values[:, h // group] / p.sum()
    attn = rd(attn, dt).reshape(rows, hq * d)
    o = rd(attn @ W["o_proj"].T, dt)
    if s.o_bias:
        o = rd(o + f["o_bias"], dt)
    h = rd(x + (_rms(o, f["attn_out_norm"], s.norm_eps, dt) if s.sandwich else o), dt)
    xn2 = _rms(h, f["post_norm"], s.norm_eps, dt)
    g, u = rd(xn2 @ W["gate_proj"].T, dt), rd(xn2 @ W["up_proj"].T, dt)
    z = 2 * np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3) if s.gelu else g
    act = rd(g / (1 + np.exp(-z)) * u, dt)
    dn = rd(act @ W["down_proj"].T, dt)
    out = rd(h + (_rms(dn, f["mlp_out_norm"], s.norm_eps, dt) if s.sandwich else dn), dt)
    return dict(q=proj["q"].reshape(rows, -1), k=proj["k"], v=proj["v"], attn=attn, h=h,
                act=act, out=out)
