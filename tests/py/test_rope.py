"""rope against a float64 NumPy reference written from the HF/vLLM definitions, on both
backends; against mlx's own mx.fast.rope where one offset describes all positions; the
kernel launches on NumPy with guard bytes; the frequency tables; the errors."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
import pytest

from op_harness import DTYPES, TOLERANCE, assert_close, random, to_numpy
from vllm_metal import _core, emulation, ops

# ---- reference -----------------------------------------------------------------------

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
YARN_QWEN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
YARN_DEEPSEEK = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                 "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.5}
YARN_GPT_OSS = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
YARN_ATTENTION = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048,
                  "attention_factor": 1.25, "mscale": None}
LINEAR = {"rope_type": "linear", "factor": 4.0}


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def reference_inv_freq(rotary_dim: int, base: float, scaling: dict | None):
    """(inv_freq [rotary_dim/2] float64, mscale), from the HF/vLLM definitions."""
    cfg = {k: v for k, v in (scaling or {}).items() if v is not None}
    kind = cfg.pop("rope_type", cfg.pop("type", "default"))
    d = rotary_dim
    pos_freqs = base ** (np.arange(0, d, 2, dtype=np.float64) / d)  # base^(2i/d)
    inv = 1.0 / pos_freqs
    if kind == "default":
        return inv, 1.0
    factor = float(cfg["factor"])
    if kind == "linear":
        return inv / factor, 1.0
    L = float(cfg["original_max_position_embeddings"])
    if kind == "llama3":
        lo, hi = cfg["low_freq_factor"], cfg["high_freq_factor"]
        wavelen = 2 * np.pi / inv
        low_band = np.where(wavelen > L / lo, inv / factor, inv)
        smooth = (L / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * low_band / factor + smooth * low_band
        medium = ~(wavelen < L / hi) & ~(wavelen > L / lo)
        return np.where(medium, smoothed, low_band), 1.0
    assert kind == "yarn", kind

    def correction_dim(rotations):
        return d * math.log(L / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction_dim(cfg.get("beta_fast", 32))
    high = correction_dim(cfg.get("beta_slow", 1))
    if cfg.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = (1 - ramp) * cfg.get("extrapolation_factor", 1.0)
    inv = (1 / (factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation
    if "attention_factor" in cfg:
        mscale = cfg["attention_factor"]
    elif cfg.get("mscale") and cfg.get("mscale_all_dim"):
        mscale = yarn_get_mscale(factor, cfg["mscale"]) / yarn_get_mscale(factor,
                                                                          cfg["mscale_all_dim"])
    else:
        mscale = yarn_get_mscale(factor)
    return inv, mscale * cfg.get("attn_factor", 1.0)


def pair_indices(rotary_dim: int, is_neox: bool):
    half = rotary_dim // 2
    if is_neox:
        return np.arange(half), np.arange(half) + half
    return np.arange(0, rotary_dim, 2), np.arange(1, rotary_dim, 2)


def reference_rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, mscale: float,
                   rotary_dim: int, is_neox: bool) -> np.ndarray:
    """x float64 [T, H, D]; the rotation with float64 angles."""
    angle = positions.astype(np.float64)[:, None] * inv_freq[None, :]  # [T, rotary_dim/2]
    cos = (np.cos(angle) * mscale)[:, None, :]
    sin = (np.sin(angle) * mscale)[:, None, :]
    i1, i2 = pair_indices(rotary_dim, is_neox)
    a, b = x[:, :, i1], x[:, :, i2]
    out = x.copy()
    out[:, :, i1] = a * cos - b * sin
    out[:, :, i2] = b * cos + a * sin
    return out


# ---- curated cases ----------------------------------------------------------------------


@dataclass
class Case:
    tokens: int
    heads: int
    head_size: int
    is_neox: bool = True
    rotary_dim: int | None = None
    base: float = 10000.0
    scaling: dict | None = None
    max_position: int = 4096
    name: str = field(default="")

    def id(self) -> str:
        kind = (self.scaling or {}).get("rope_type", (self.scaling or {}).get("type", "default"))
        rot = self.rotary_dim or self.head_size
        return (f"rope(t={self.tokens},h={self.heads},d={self.head_size},rot={rot},"
                f"{'neox' if self.is_neox else 'gptj'},{kind}{self.name},pos<{self.max_position})")


CASES = [
    Case(1, 1, 64, max_position=8),                                  # one decode token
    Case(1, 32, 128, max_position=131072),                           # decode, many heads
    Case(7, 3, 80, is_neox=False),                                   # odd T, head 80, GPT-J
    Case(5, 2, 96, scaling=LINEAR, max_position=16384),
    Case(13, 4, 128, rotary_dim=64, base=500000.0, scaling=LLAMA3,  # partial 0.5
         max_position=131072),
    Case(4, 1, 64, is_neox=False, rotary_dim=32, base=500000.0, scaling=LLAMA3,
         max_position=131072),
    Case(3, 2, 256, is_neox=False, rotary_dim=64, base=1e6, scaling=YARN_QWEN,  # partial 0.25
         max_position=131072),
    Case(9, 5, 128, scaling=YARN_DEEPSEEK, max_position=163840, name="-deepseek"),
    Case(11, 2, 80, rotary_dim=20, base=150000.0, scaling=YARN_GPT_OSS,  # partial 0.25
         max_position=131072, name="-untruncated"),
    Case(6, 8, 64, is_neox=False, scaling=YARN_ATTENTION, max_position=8192,
         name="-attention_factor"),
]


def positions_for(case: Case, seed: int, dtype=mx.int64) -> mx.array:
    rng = np.random.default_rng(seed)
    p = rng.integers(0, case.max_position, size=case.tokens)
    p[-1] = case.max_position - 1  # the far end, always
    return mx.array(p.astype(np.int64)).astype(dtype)


def expected(case: Case, x: mx.array, positions: mx.array) -> np.ndarray:
    rot = case.rotary_dim or case.head_size
    inv, mscale = reference_inv_freq(rot, case.base, case.scaling)
    return reference_rope(to_numpy(x), np.array(positions), inv, mscale, rot, case.is_neox)


def run(case: Case, x: mx.array, positions: mx.array) -> mx.array:
    return ops.rope(x, positions, rotary_dim=case.rotary_dim, is_neox=case.is_neox,
                    base=case.base, scaling=case.scaling)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=Case.id)
def test_rope_matches_reference(backend, case, dtype):
    x = random((case.tokens, case.heads, case.head_size), dtype, seed=case.tokens, scale=2.0)
    positions = positions_for(case, seed=case.heads)
    y = run(case, x, positions)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_close(y, expected(case, x, positions), dtype, f"{case.id()},dt={dtype}")


def test_int32_and_int64_positions_agree(backend):
    case = CASES[4]
    x = random((case.tokens, case.heads, case.head_size), "float32", seed=3)
    y32 = run(case, x, positions_for(case, seed=1, dtype=mx.int32))
    y64 = run(case, x, positions_for(case, seed=1, dtype=mx.int64))
    assert mx.array_equal(y32, y64).item()


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_positions_far_beyond_float_precision(backend, is_neox):
    # float32 can't even hold these positions; the angle is still reduced exactly
    x = random((7, 2, 64), "float32", seed=4)
    p = np.array([0, 2**24 - 1, 2**24 + 1, 2**31 - 1, 3_000_000_017, -1, -123_457],
                 dtype=np.int64)
    y = ops.rope(x, mx.array(p), is_neox=is_neox)
    inv, _ = reference_inv_freq(64, 10000.0, None)
    assert_close(y, reference_rope(to_numpy(x), p, inv, 1.0, 64, is_neox), "float32",
                 "large positions")
    p32 = p[:4].astype(np.int32)  # 3_000_000_017 does not fit: cut before it
    y32 = ops.rope(x[:4], mx.array(p32), is_neox=is_neox)
    assert mx.array_equal(y32, y[:4]).item()


def test_strided_views_are_read_in_place(backend):
    # q and k sliced out of a fused qkv projection [T, Hq + 2 Hk, D]
    t, hq, hk, d = 5, 4, 2, 64
    qkv = random((t, hq + 2 * hk, d), "bfloat16", seed=5)
    positions = mx.array(np.array([3, 0, 70000, 9, 1], dtype=np.int32))
    inv, mscale = reference_inv_freq(32, 10000.0, LLAMA3)
    for view in (qkv[:, :hq, :], qkv[:, hq:hq + hk, :]):
        y = ops.rope(view, positions, rotary_dim=32, scaling=LLAMA3)
        ref = reference_rope(to_numpy(view), np.array(positions), inv, mscale, 32, True)
        assert_close(y, ref, "bfloat16", "qkv slice")
    # heads-major storage viewed token-major, a strided last axis, reversed axes
    # (negative strides) and a broadcast token axis (stride 0)
    inv, _ = reference_inv_freq(48, 10000.0, None)
    for x in (random((3, t, 48), "float16", seed=6).transpose(1, 0, 2),
              random((t, 3, 96), "float16", seed=7)[:, :, ::2],
              random((t, 3, 48), "float16", seed=8)[::-1, :, ::-1],
              mx.broadcast_to(random((1, 3, 48), "float16", seed=9), (t, 3, 48))):
        y = ops.rope(x, positions, is_neox=False)
        ref = reference_rope(to_numpy(x), np.array(positions), inv, 1.0, 48, False)
        assert_close(y, ref, "float16", "transposed / strided")


def test_input_is_left_intact_and_temporaries_rotate_in_place(backend):
    x = random((4, 3, 64), "float32", seed=8)
    before = np.array(x)
    positions = mx.array(np.array([1, 2, 3, 4], dtype=np.int32))
    y = ops.rope(x, positions)
    mx.eval(y)
    np.testing.assert_array_equal(np.array(x), before)  # x is still referenced: not donated
    z = ops.rope(x * 1.0, positions)  # the product is donated and rotated in place
    assert mx.array_equal(y, z).item()
    big = random((256, 8, 128), "float32", seed=9)  # 1 MiB
    positions = mx.arange(256)
    mx.eval(big, positions)
    mx.reset_peak_memory()
    active = mx.get_active_memory()
    mx.eval(ops.rope(big * 1.0, positions))
    assert mx.get_peak_memory() - active < 1.5 * big.nbytes  # one buffer: the product's


def test_empty_batch():
    y = ops.rope(mx.zeros((0, 4, 64)), mx.zeros((0,), mx.int32))
    assert y.shape == (0, 4, 64)


# ---- an independent reference: mlx's own rope with one offset ------------------------


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("rotary_dim", [64, 32], ids=["full", "partial"])
def test_matches_mx_fast_rope_for_one_offset(backend, is_neox, rotary_dim):
    t, h, d, offset = 9, 3, 64, 1000
    x = random((t, h, d), "float32", seed=9)
    y = ops.rope(x, mx.arange(offset, offset + t), rotary_dim=rotary_dim, is_neox=is_neox)
    # mx.fast.rope rotates [..., L, D] along L: heads-major
    ref = mx.fast.rope(x.transpose(1, 0, 2), rotary_dim, traditional=not is_neox,
                       base=10000.0, scale=1.0, offset=offset).transpose(1, 0, 2)
    # mlx forms the angle in float32: error ~ position * 2^-24 per unit of |x|
    bound = 1e-5 + 4 * (offset + t) * 2.0**-24 * float(mx.abs(x).max().item())
    assert float(mx.abs(y - ref).max().item()) <= bound


def test_matches_mx_fast_rope_with_llama3_frequencies(backend):
    t, h, d, offset = 6, 2, 128, 300
    x = random((t, h, d), "float32", seed=10)
    y = ops.rope(x, mx.arange(offset, offset + t), base=500000.0, scaling=LLAMA3)
    inv, _ = _core.rope_inv_freq(d, base=500000.0, scaling=LLAMA3)
    periods = mx.array(1.0 / np.array(inv), dtype=mx.float32)  # mlx takes 1 / inv_freq
    ref = mx.fast.rope(x.transpose(1, 0, 2), d, traditional=False, base=None, scale=1.0,
                       offset=offset, freqs=periods).transpose(1, 0, 2)
    bound = 1e-5 + 4 * (offset + t) * 2.0**-24 * float(mx.abs(x).max().item())
    assert float(mx.abs(y - ref).max().item()) <= bound


# ---- host frequency tables ---------------------------------------------------------------


@pytest.mark.parametrize(
    "rotary_dim, base, scaling",
    [(64, 10000.0, None), (96, 10000.0, LINEAR), (128, 500000.0, LLAMA3),
     (32, 500000.0, LLAMA3), (128, 1e6, YARN_QWEN), (64, 10000.0, YARN_DEEPSEEK),
     (64, 150000.0, YARN_GPT_OSS), (64, 10000.0, YARN_ATTENTION),
     (128, 10000.0, {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096,
                     "attn_factor": 0.5, "extrapolation_factor": 0.9, "beta_fast": 16})],
    ids=["default", "linear", "llama3", "llama3-32", "yarn", "yarn-deepseek", "yarn-untruncated",
         "yarn-attention_factor", "yarn-vllm-factors"],
)
def test_inv_freq_matches_the_formulas(rotary_dim, base, scaling):
    inv, mscale = _core.rope_inv_freq(rotary_dim, base=base, scaling=scaling)
    ref, ref_mscale = reference_inv_freq(rotary_dim, base, scaling)
    np.testing.assert_allclose(inv, ref, rtol=1e-13)
    assert mscale == pytest.approx(ref_mscale, rel=1e-13)


def test_scalings_have_their_defining_properties():
    base = 500000.0
    plain, _ = reference_inv_freq(128, base, None)
    inv = np.array(_core.rope_inv_freq(128, base=base, scaling=LLAMA3)[0])
    wavelen = 2 * np.pi / plain
    assert np.allclose(inv[wavelen < 8192 / 4], plain[wavelen < 8192 / 4])  # high band kept
    assert np.allclose(inv[wavelen > 8192], plain[wavelen > 8192] / 8)      # low band / factor
    inv, mscale = _core.rope_inv_freq(128, base=1e6, scaling=YARN_QWEN)
    assert inv[0] == 1.0 and inv[-1] == pytest.approx(plain_last(1e6) / 4)
    assert mscale == pytest.approx(0.1 * math.log(4) + 1)


def plain_last(base):
    return base ** (-126 / 128)


# ---- kernel launches on NumPy -----------------------------------------------------------

GUARD = 64


@pytest.mark.parametrize(
    "tokens, heads, head_size, rotary_dim, is_neox, dtype, pos_dtype",
    [(1, 1, 64, 64, True, "float32", "int32"),
     (5, 3, 80, 20, False, "float16", "int64"),     # 10 x 3 threads, tail of 60
     (3, 7, 96, 96, True, "float32", "int64"),      # 48 x 5 threads
     (2, 2, 256, 256, False, "float32", "int32")],  # 128 x 2 threads
)
def test_launches_on_numpy_stay_inside_the_output(tokens, heads, head_size, rotary_dim, is_neox,
                                                  dtype, pos_dtype):
    rng = np.random.default_rng(tokens * head_size)
    t = np.float16 if dtype == "float16" else np.float32
    x = rng.standard_normal((tokens, heads, head_size)).astype(t)
    positions = rng.integers(0, 200000, size=tokens).astype(pos_dtype)
    table, mscale = _core.rope_turn_table(rotary_dim)
    table = np.array(table)
    backing = np.full(x.size + 2 * GUARD, 12345.0, dtype=t)
    out = backing[GUARD:GUARD + x.size].reshape(x.shape)
    plan = _core.plan_rope(dtype, pos_dtype, tokens, heads, head_size, rotary_dim=rotary_dim,
                           is_neox=is_neox, mscale=mscale)
    (launch,) = plan
    assert list(launch.grid) == [tokens, 1, 1]
    assert launch.threadgroup[0] == min(rotary_dim // 2, 128)
    assert launch.threadgroup[0] * launch.threadgroup[1] <= 256
    emulation.run_plan(plan, [x, positions, table, out])
    assert np.all(backing[:GUARD] == 12345.0) and np.all(backing[-GUARD:] == 12345.0)
    inv, _ = reference_inv_freq(rotary_dim, 10000.0, None)
    ref = reference_rope(x.astype(np.float64), positions, inv, 1.0, rotary_dim, is_neox)
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=TOLERANCE[dtype],
                               atol=TOLERANCE[dtype])


# ---- errors --------------------------------------------------------------------------------


def _x(shape=(2, 3, 8), dtype=mx.float32):
    return mx.zeros(shape, dtype)


P2 = mx.zeros((2,), mx.int32)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ops.rope(_x(dtype=mx.int32), P2),
         r"\[rope\] x must be float32, float16 or bfloat16, got int32"),
        (lambda: ops.rope(mx.zeros((2, 24)), P2),
         r"\[rope\] x must be \[num_tokens, num_heads, head_size\], got shape \[2, 24\]"),
        (lambda: ops.rope(_x(), mx.zeros((2,))),
         r"\[rope\] positions must be int32 or int64, got float32"),
        (lambda: ops.rope(_x(), mx.zeros((3,), mx.int32)),
         r"\[rope\] positions must be \[2\] \(one position per token\), got \[3\]"),
        (lambda: ops.rope(_x(), mx.zeros((2, 1), mx.int64)),
         r"\[rope\] positions must be \[2\] \(one position per token\), got \[2, 1\]"),
        (lambda: ops.rope(_x(), P2, rotary_dim=5),
         r"\[rope\] rotary_dim must be even and in \[2, head_size=8\], got 5"),
        (lambda: ops.rope(_x(), P2, rotary_dim=10),
         r"\[rope\] rotary_dim must be even and in \[2, head_size=8\], got 10"),
        (lambda: ops.rope(_x(), P2, base=-1.0),
         r"\[rope\] base must be finite and > 0, got -1"),
        (lambda: ops.rope(_x(), P2, scaling={"rope_type": "dynamic", "factor": 2.0}),
         r"\[rope\] unsupported scaling type 'dynamic' \(supported: default, linear, llama3, yarn\)"),
        (lambda: ops.rope(_x(), P2, scaling={"factor": 2.0}),
         r"\[rope\] scaling needs a 'rope_type'"),
        (lambda: ops.rope(_x(), P2, scaling={"rope_type": "linear"}),
         r"\[rope\] linear scaling requires 'factor'"),
        (lambda: ops.rope(_x(), P2, scaling={"rope_type": "linear", "factor": 0.0}),
         r"\[rope\] scaling factor must be finite and > 0, got 0"),
        (lambda: ops.rope(_x(), P2, scaling={"rope_type": "linear", "factor": 2.0, "beta": 1.0}),
         r"\[rope\] unknown key 'beta' for linear scaling \(accepted: factor\)"),
        (lambda: ops.rope(_x(), P2, scaling={**LLAMA3, "high_freq_factor": 1.0}),
         r"\[rope\] scaling high_freq_factor \(1\) must be greater than low_freq_factor \(1\)"),
        (lambda: ops.rope(_x(), P2, scaling={"rope_type": "yarn", "factor": 4.0}),
         r"\[rope\] yarn scaling requires 'original_max_position_embeddings'"),
        (lambda: ops.rope(_x(), P2, scaling={"rope_type": "llama3", "type": "yarn"}),
         r"\[rope\] scaling 'rope_type' \('llama3'\) and 'type' \('yarn'\) disagree"),
        (lambda: ops.rope(_x(), P2, scaling={"rope_type": "linear", "factor": "2"}),
         r"\[rope\] scaling 'factor' must be a number, got a string"),
    ],
)
def test_bad_input_raises_a_clear_error(make, message):
    with pytest.raises(ValueError, match=message):
        make()
