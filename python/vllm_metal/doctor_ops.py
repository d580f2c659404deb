"""The doctor's op checks: a few small cases per op, each against a NumPy reference.

They run wherever the caller's backend points the ops: the GPU (an ``mx.gpu`` stream, the
real metallib) on a Mac, the Metal kernels in the MSL emulator elsewhere. Cases cover both
GGUF matmul kernels (mat-vec up to 8 rows, mat-mat above) and decode plus prefill rows of
paged attention. GGUF blocks are built from random codes and scales in the layout of the GGUF
spec, so no quantizer is involved. float32 throughout: the Metal kernels sum in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import numpy as np

# Relative error bound (|got - ref| / max(1, |ref|)) of a float32 result, as in the op tests.
FLOAT32_TOLERANCE = 2e-5


@dataclass
class OpResult:
    case: str
    error: float  # worst relative error; inf when the op raised or gave non-finite values
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.error <= FLOAT32_TOLERANCE


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _f32(a: np.ndarray) -> mx.array:
    return mx.array(a.astype(np.float32))


def relative_error(got: mx.array, ref: np.ndarray) -> float:
    g = np.array(got.astype(mx.float32), dtype=np.float64)
    if g.shape != ref.shape:
        raise ValueError(f"shape {g.shape}, expected {ref.shape}")
    if not np.isfinite(g).all():
        return float("inf")
    return float((np.abs(g - ref) / np.maximum(1.0, np.abs(ref))).max(initial=0.0))


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def check_rms_norm(ops) -> float:
    r = _rng(1)
    x, w = r.standard_normal((5, 67)), r.standard_normal(67)
    return relative_error(ops.rms_norm(_f32(x), _f32(w), 1e-6), _rms(x, w, 1e-6))


def check_add_rms_norm(ops) -> float:
    r = _rng(2)
    x, res, w = r.standard_normal((3, 130)), r.standard_normal((3, 130)), r.standard_normal(130)
    out, summed = ops.add_rms_norm(_f32(x), _f32(res), _f32(w), 1e-5)
    return max(relative_error(out, _rms(x + res, w, 1e-5)), relative_error(summed, x + res))


def check_rope(ops) -> float:
    r = _rng(3)
    t, h, d, base = 7, 3, 64, 10000.0
    x, pos = r.standard_normal((t, h, d)), r.integers(0, 4096, t)
    angle = pos[:, None] * base ** (-np.arange(0, d, 2) / d)  # [T, D/2]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    a, b = x[..., : d // 2], x[..., d // 2:]  # NeoX pairs: i and i + D/2
    ref = np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    got = ops.rope(_f32(x), mx.array(pos.astype(np.int64)), is_neox=True, base=base)
    return relative_error(got, ref)


def check_reshape_and_cache(ops) -> float:
    r = _rng(4)
    blocks, bs, h, d = 4, 16, 2, 64
    k, v = r.standard_normal((5, h, d)), r.standard_normal((5, h, d))
    slots = np.array([3, 17, -1, 40, 63])  # -1: a padding token, not written
    kc, vc = r.standard_normal((blocks, bs, h, d)), r.standard_normal((blocks, bs, h, d))
    ref_k, ref_v = kc.reshape(-1, h, d).copy(), vc.reshape(-1, h, d).copy()
    ref_k[slots[slots >= 0]], ref_v[slots[slots >= 0]] = k[slots >= 0], v[slots >= 0]
    got_k, got_v = ops.reshape_and_cache(_f32(k), _f32(v), _f32(kc), _f32(vc),
                                         mx.array(slots.astype(np.int64)))
    return max(relative_error(got_k, ref_k.reshape(kc.shape)),
               relative_error(got_v, ref_v.reshape(vc.shape)))


def _attention_reference(q, kc, vc, tables, seq_lens, cu, scale) -> np.ndarray:
    bs, hkv = kc.shape[1], kc.shape[2]
    group = q.shape[1] // hkv
    out = np.zeros_like(q)
    for s, ctx in enumerate(seq_lens):
        pos = np.arange(ctx)
        k = kc[tables[s, pos // bs], pos % bs]  # [ctx, Hkv, D]
        v = vc[tables[s, pos // bs], pos % bs]
        n = cu[s + 1] - cu[s]
        for i in range(n):  # the query's position is ctx - n + i: causal mask
            for hq in range(q.shape[1]):
                scores = (k[:, hq // group] @ q[cu[s] + i, hq]) * scale
                scores[pos > ctx - n + i] = -np.inf
                w = np.exp(scores - scores.max())
                out[cu[s] + i, hq] = (w / w.sum()) @ v[:, hq // group]
    return out


def check_paged_attention(ops) -> float:
    r = _rng(5)
    hq, hkv, d, bs, blocks = 4, 2, 64, 16, 12
    seq_lens = np.array([37, 5, 20])  # two decode rows first, then a 6-token prefill
    cu = np.array([0, 1, 2, 8])
    tables = r.permutation(blocks)[:9].reshape(3, 3)  # each sequence's blocks, scattered
    q = r.standard_normal((cu[-1], hq, d))
    kc, vc = r.standard_normal((blocks, bs, hkv, d)), r.standard_normal((blocks, bs, hkv, d))
    scale = d ** -0.5
    got = ops.paged_attention(_f32(q), _f32(kc), _f32(vc), mx.array(tables.astype(np.int32)),
                              mx.array(seq_lens.astype(np.int32)), mx.array(cu.astype(np.int32)),
                              scale=scale)
    return relative_error(got, _attention_reference(q, kc, vc, tables, seq_lens, cu, scale))


def _gguf_blocks(kind: str, n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(blocks as uint8, the dense [n, k] weights they encode), blocks of 32 weights.

    Q8_0: fp16 scale d, 32 int8 codes, w = d * q.  Q4_0: fp16 d, 16 bytes whose low nibbles
    are codes 0-15 and high nibbles codes 16-31, w = d * (q - 8)."""
    r = _rng(seed)
    nb = n * k // 32
    d = (r.uniform(0.5, 2.0, nb) / 64).astype(np.float16)
    if kind == "Q8_0":
        q = r.integers(-128, 128, (nb, 32)).astype(np.int8)
        packed = q.view(np.uint8)
        w = d.astype(np.float64)[:, None] * q
    else:
        q = r.integers(0, 16, (nb, 32)).astype(np.uint8)
        packed = q[:, :16] | (q[:, 16:] << 4)
        w = d.astype(np.float64)[:, None] * (q.astype(np.float64) - 8)
    blocks = np.concatenate([d.view(np.uint8).reshape(nb, 2), packed], axis=1)
    return blocks.reshape(-1), w.reshape(n, k)


def _check_gguf(kind: str, m: int):
    def check(ops) -> float:
        n, k = 6, 96
        blocks, w = _gguf_blocks(kind, n, k, seed=6 + m)
        x = _rng(7 + m).standard_normal((m, k))
        return relative_error(ops.gguf_matmul(_f32(x), mx.array(blocks), kind, [n, k]), x @ w.T)
    return check


def check_apply_token_bitmask(ops) -> float:
    """0 when every value is exact (-inf where the mask's bit is 0, else copied), else inf."""
    r = _rng(8)
    logits, vocab, rows = r.standard_normal((4, 70)), 70, [3, 1]
    mask = r.integers(0, 2**32, size=(2, 3), dtype=np.uint64).astype(np.uint32)
    mask[1, 0] = 0  # a word of 32 disallowed tokens
    got = np.array(ops.apply_token_bitmask(_f32(logits), mx.array(mask.view(np.int32)),
                                           mx.array(np.array(rows, np.int32))), dtype=np.float64)
    ref = logits.astype(np.float32).astype(np.float64)
    t = np.arange(vocab)
    for i, row in enumerate(rows):
        ref[row, ((mask[i, t // 32] >> (t % 32).astype(np.uint32)) & 1) == 0] = -np.inf
    return 0.0 if np.array_equal(got, ref) else float("inf")


CASES: dict[str, Callable] = {
    "rms_norm(t=5,d=67)": check_rms_norm,
    "add_rms_norm(t=3,d=130)": check_add_rms_norm,
    "rope(neox,t=7,h=3,d=64)": check_rope,
    "reshape_and_cache(t=5,hkv=2,d=64,bs=16)": check_reshape_and_cache,
    "paged_attention(hq=4,hkv=2,d=64,bs=16,ctx=[37,5,20],q=[1,1,6])": check_paged_attention,
    "gguf_matmul(Q8_0,m=3,n=6,k=96)": _check_gguf("Q8_0", 3),
    "gguf_matmul(Q4_0,m=3,n=6,k=96)": _check_gguf("Q4_0", 3),
    "gguf_matmul(Q4_0,m=9,n=6,k=96)": _check_gguf("Q4_0", 9),
    "apply_token_bitmask(rows=4,vocab=70,masked=[3,1])": check_apply_token_bitmask,
}


def run_cases(ops, cases: dict[str, Callable] = CASES) -> list[OpResult]:
    """Each case evaluated on the current stream and kernel backend; errors become results."""
    results = []
    for name, fn in cases.items():
        try:
            results.append(OpResult(name, fn(ops)))
        except Exception as e:  # noqa: BLE001 -- a crashing kernel is a failed check, not a crash
            results.append(OpResult(name, float("inf"), f"{type(e).__name__}: {e}"))
    return results
