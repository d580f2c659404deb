"""gelu (erf form and tanh approximation) against float64 references (math.erf, tanh) and
MLX's nn.gelu / nn.gelu_approx, on the CPU kernels and the emulated Metal kernels; odd
sizes (a partial threadgroup, the scalar tail of the AVX2 loop), strided input, errors."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from op_harness import DTYPES, assert_close, to_numpy
from vllm_metal import _core, emulation, ops

_erf = np.vectorize(math.erf)


def reference(x: np.ndarray, approximate: bool) -> np.ndarray:
    x = np.asarray(x, np.float64)
    if approximate:
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1 + _erf(x / math.sqrt(2)))


def close(got, want, dtype, what):
    # relative where |y| is not tiny; absolute near the zero of GELU and far in the left tail
    tol = {"float32": 2e-6, "float16": 1e-3, "bfloat16": 8e-3}[dtype]
    err = np.abs(to_numpy(got) - want) / np.maximum(np.abs(want), 1.0)
    assert err.max() <= tol, f"{what}: {err.max():.3g} > {tol}"


@pytest.mark.parametrize("approximate", [False, True], ids=["erf", "tanh"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", [(1,), (7, 3), (300,), (5, 67, 3)], ids=str)
def test_matches_reference(backend, shape, dtype, approximate):
    rng = np.random.default_rng(sum(shape))
    x = mx.array((rng.standard_normal(shape) * 4).astype(np.float32)).astype(DTYPES[dtype])
    y = ops.gelu(x, approximate=approximate)
    assert y.shape == x.shape and y.dtype == x.dtype
    close(y, reference(to_numpy(x), approximate), dtype, f"{shape} {dtype}")


def test_extremes_and_mlx(backend):
    x = mx.array(np.concatenate([np.linspace(-30, 30, 1201), [0.0, -0.0, 1e-30, -1e-30, 80.0, -80.0]])
                 .astype(np.float32))
    for approximate, mlx_fn in ((False, nn.gelu), (True, nn.gelu_approx)):
        y = ops.gelu(x, approximate=approximate)
        want = reference(to_numpy(x), approximate)
        close(y, want, "float32", f"approximate={approximate}")
        assert np.all(np.isfinite(to_numpy(y)))
        assert_close(y, to_numpy(mlx_fn(x)).astype(np.float64), "float32", "vs mlx")


def test_strided_input(backend):
    x = mx.array(np.random.default_rng(1).standard_normal((9, 10)).astype(np.float32)).T
    close(ops.gelu(x), reference(to_numpy(x), False), "float32", "transposed")


def test_empty():
    assert ops.gelu(mx.zeros((0, 4))).shape == (0, 4)


def test_launches_on_numpy(approximate=False):
    """The planner's launch on NumPy arrays, a partial last threadgroup (also under the
    emulator's checks: test_metal_kernel_checks)."""
    x = (np.random.default_rng(2).standard_normal(300) * 3).astype(np.float32)
    out = np.zeros_like(x)
    emulation.run_plan(_core.plan_gelu("float32", x.size, approximate), [x, out])
    np.testing.assert_allclose(out, reference(x, approximate), atol=2e-6, rtol=2e-6)


def test_kernel_names_are_instantiated():
    names = {l.kernel for d in DTYPES for l in _core.plan_gelu(d, 10)}
    assert names <= set(emulation.library("gelu").kernels)


def test_bad_input():
    with pytest.raises(ValueError, match=r"\[gelu\] x must be float32, float16 or bfloat16, got int32"):
        ops.gelu(mx.zeros((3,), mx.int32))
