"""Shared helpers of the op tests: dtypes, conversion, one tolerance table."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

# Max |actual - reference| allowed, relative to max(1, |reference|), per dtype:
# a few units in the last place of the output type.
TOLERANCE = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def to_numpy(a: mx.array) -> np.ndarray:
    """float64 copy of an MLX array of any float dtype."""
    if a.dtype in (mx.float16, mx.bfloat16):
        a = a.astype(mx.float32)
    # np.array alone evaluates through the buffer protocol, which drops an error thrown by
    # a kernel task (e.g. the emulator's strict checks) and returns the unwritten buffer
    mx.eval(a)
    return np.array(a).astype(np.float64)


def random(shape, dtype_name: str, seed: int, scale: float = 1.0) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(
        DTYPES[dtype_name]
    )


def round_to(x: np.ndarray, dtype_name: str) -> np.ndarray:
    """float64 values rounded to the precision of dtype_name."""
    return to_numpy(mx.array(x.astype(np.float32)).astype(DTYPES[dtype_name]))


def assert_close(actual: mx.array, reference: np.ndarray, dtype_name: str, what: str = ""):
    got = to_numpy(actual)
    assert got.shape == reference.shape, f"{what}: shape {got.shape} != {reference.shape}"
    assert np.isfinite(got).all(), f"{what}: non-finite values in the output"
    err = np.abs(got - reference) / np.maximum(1.0, np.abs(reference))
    worst = float(err.max()) if err.size else 0.0
    assert worst <= TOLERANCE[dtype_name], (
        f"{what}: max relative error {worst:.3g} > {TOLERANCE[dtype_name]} ({dtype_name})"
    )


def metal_available() -> bool:
    """A Metal GPU is there (a Mac): the op tests' "metal" backend runs, else it skips."""
    try:
        return bool(mx.metal.is_available())
    except Exception:  # noqa: BLE001 -- MLX builds without the metal module
        return False


def bits(a: mx.array) -> np.ndarray:
    """The exact bits of an array (float16/bfloat16 as uint16, float32 as uint32)."""
    a = mx.contiguous(a)
    mx.eval(a)
    return np.array(a.view({2: mx.uint16, 4: mx.uint32}[a.dtype.size]))


def assert_same_bits(got, want, what: str) -> None:
    """Bitwise equality of two arrays (mx arrays, or the bits() of them)."""
    got, want = (bits(a) if isinstance(a, mx.array) else a for a in (got, want))
    differ = int((got != want).sum())
    assert differ == 0, f"{what}: {differ} of {got.size} values differ from the row computed alone"
