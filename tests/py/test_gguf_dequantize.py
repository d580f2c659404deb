"""gguf_dequantize against the gguf package's NumPy dequantizer, on both backends.

float32 output must be bit-exact for every type; float16/bfloat16 outputs are
that float32 value rounded once.
"""

import mlx.core as mx
import numpy as np
import pytest

from op_harness import DTYPES
from test_gguf_fixtures import SUPPORTED, UNSUPPORTED, block_size, random_blocks, reference_dequantize
from vllm_metal import ops

T_IDS = [t.name for t in SUPPORTED]


def shapes_for(t):
    bs = block_size(t)
    # one block; odd row counts; several blocks per row; a float row of odd length
    shapes = [(1, bs), (3, 2 * bs), (5, 3, 2 * bs)]
    if bs == 1:
        shapes += [(7, 13), (1, 1)]
    else:
        shapes += [(2, max(256, bs) * 2)]
    return shapes


@pytest.mark.parametrize("t", SUPPORTED, ids=T_IDS)
def test_dequantize_float32_is_bit_exact(backend, t):
    for i, shape in enumerate(shapes_for(t)):
        rows = int(np.prod(shape[:-1]))
        blocks = random_blocks(t, rows, shape[-1], seed=10 + i)
        ref = reference_dequantize(blocks, t, shape)
        got = ops.gguf_dequantize(mx.array(blocks), t.name, list(shape))
        assert got.dtype == mx.float32 and tuple(got.shape) == shape
        got = np.array(got)
        bad = np.flatnonzero(got.view(np.uint32) != ref.view(np.uint32))
        assert bad.size == 0, (
            f"gguf_dequantize({t.name}, shape={list(shape)}): {bad.size} values differ, first at "
            f"{bad[0]}: {got.reshape(-1)[bad[0]]!r} != {ref.reshape(-1)[bad[0]]!r}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("t", [t for t in SUPPORTED if t.name in ("Q4_K", "Q6_K", "IQ3_S", "Q5_1", "BF16")],
                         ids=lambda t: t.name)
def test_dequantize_to_half_types_rounds_once(backend, t, dtype):
    shape = (3, 2 * max(256, block_size(t)))
    blocks = random_blocks(t, shape[0], shape[1], seed=3)
    ref = mx.array(reference_dequantize(blocks, t, shape)).astype(DTYPES[dtype])
    got = ops.gguf_dequantize(mx.array(blocks), int(t), list(shape), dtype)
    assert got.dtype == DTYPES[dtype]
    assert mx.array_equal(got, ref).item()


def test_dequantize_accepts_blocks_of_any_shape(backend):
    blocks = random_blocks(SUPPORTED[0], 4, 64, seed=1)
    a = ops.gguf_dequantize(mx.array(blocks), "q4_0", [4, 64])
    b = ops.gguf_dequantize(mx.array(blocks.reshape(-1)), "Q4_0", [2, 2, 64])
    assert mx.array_equal(a, b.reshape(4, 64)).item()


def test_empty_shape_gives_empty_output():
    y = ops.gguf_dequantize(mx.zeros((0,), mx.uint8), "Q4_K", [0, 256])
    assert y.shape == (0, 256)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ops.gguf_dequantize(mx.zeros((18,), mx.int8), "Q4_0", [32]),
         r"\[gguf_dequantize\] blocks must be uint8 \(the tensor's raw bytes\), got int8"),
        (lambda: ops.gguf_dequantize(mx.zeros((17,), mx.uint8), "Q4_0", [32]),
         r"\[gguf_dequantize\] blocks must hold 18 bytes for Q4_0 shape \[32\], got 17"),
        (lambda: ops.gguf_dequantize(mx.zeros((18,), mx.uint8), "Q4_0", [2, 16]),
         r"\[gguf_dequantize\] the last dimension of shape \[2, 16\] must be a multiple of the Q4_0 block size 32"),
        (lambda: ops.gguf_dequantize(mx.zeros((18,), mx.uint8), "Q4_0", [32], "int32"),
         r"dtype must be 'float32', 'float16' or 'bfloat16'"),
        (lambda: ops.gguf_dequantize(mx.zeros((66,), mx.uint8), "IQ2_XXS", [256]),
         r"\[gguf_dequantize\] type IQ2_XXS is not supported \(supported: F32, F16, Q4_0"),
        (lambda: ops.gguf_dequantize(mx.zeros((4,), mx.uint8), 77, [1]),
         r"unknown GGML type id 77"),
    ],
)
def test_bad_input_raises_a_clear_error(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("t", UNSUPPORTED, ids=lambda t: t.name)
def test_unsupported_types_are_refused(t):
    with pytest.raises(ValueError, match=rf"type {t.name} is not supported"):
        ops.gguf_dequantize(mx.zeros((1024,), mx.uint8), t.name, [256])


def test_mxfp4_every_exponent_byte_is_bit_exact(backend):
    """MXFP4's E8M0 scale 2^(e - 128) over every e (0 and 1 give subnormal scales; the CPU
    builds it from bits, not ldexp), each with random nibbles: gguf's dequantizer's values."""
    import gguf

    t = gguf.GGMLQuantizationType.MXFP4
    raw = np.random.default_rng(5).integers(0, 256, size=(256, 17), dtype=np.uint8)
    raw[:, 0] = np.arange(256)
    ref = reference_dequantize(raw, t, (256, 32))
    got = np.array(ops.gguf_dequantize(mx.array(raw), "MXFP4", [256, 32]))
    finite = np.isfinite(ref)
    assert np.array_equal(np.isfinite(got), finite)
    assert np.array_equal(got[finite].view(np.uint32), ref[finite].view(np.uint32))
