"""The sample MSL kernels on the CPU emulator against NumPy references, with awkward
shapes (threadgroups not a multiple of 32, rows shorter than the threadgroup, odd
lengths) and MSLEMU_POISON=1 MSLEMU_STRICT=1."""
import ctypes

import numpy as np
import pytest

# max |err| bound per output dtype
TOL = {np.float32: 1e-6, np.float16: 2e-3}


class SoftmaxArgs(ctypes.Structure):
    _fields_ = [("ncols", ctypes.c_uint32), ("scale", ctypes.c_float)]


def softmax_ref(x, scale):
    z = x.astype(np.float64) * scale
    z -= z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


Q4_0 = np.dtype([("d", "<f2"), ("qs", "u1", (16,))])
assert Q4_0.itemsize == 18


def make_q4_0(nb, rng):
    blocks = np.zeros(nb, dtype=Q4_0)
    blocks["d"] = (rng.standard_normal(nb) * 0.05).astype(np.float16)
    blocks["qs"] = rng.integers(0, 256, size=(nb, 16), dtype=np.uint8)
    return blocks


def q4_0_ref(blocks):
    """f32 reference: w = (nibble - 8) * d, low nibbles first."""
    d = blocks["d"].astype(np.float32)[:, None]
    qs = blocks["qs"]
    lo = (qs & 0x0F).astype(np.int32) - 8
    hi = (qs >> 4).astype(np.int32) - 8
    return (np.concatenate([lo, hi], axis=1) * d).reshape(-1)


def q4_0_ref_half(blocks):
    """The templated kernel computes (q - 8) * d in half precision."""
    q = np.concatenate([(blocks["qs"] & 15).astype(np.int32) - 8, (blocks["qs"] >> 4).astype(np.int32) - 8], axis=1)
    return (q.astype(np.float16) * blocks["d"][:, None]).astype(np.float16).reshape(-1)


@pytest.mark.parametrize("rows,cols,tg", [(7, 1000, 256), (3, 33, 32), (5, 4096, 1024), (4, 100, 96),
                                          (2, 5, 64), (3, 77, 100), (2, 13, 45)],
                         ids=lambda v: str(v))
def test_softmax_f32(load, strict_env, rows, cols, tg):
    lib = load("softmax")
    rng = np.random.default_rng(rows * 1000 + cols)
    x = rng.standard_normal((rows, cols)).astype(np.float32) * 4
    y = np.zeros_like(x)
    lib.dispatch_threadgroups("softmax_f32", grid=(rows,), tg=(tg,), buffers=[x, y, SoftmaxArgs(cols, 0.5)])
    assert np.isfinite(y).all()
    assert np.abs(y - softmax_ref(x, 0.5)).max() < TOL[np.float32]


@pytest.mark.parametrize("rows,cols,tg", [(6, 512, 128), (3, 4096, 256), (2, 64, 32), (3, 36, 40)],
                         ids=lambda v: str(v))
def test_softmax_f16x4(load, strict_env, rows, cols, tg):
    lib = load("softmax")
    rng = np.random.default_rng(rows * 1000 + cols)
    x = (rng.standard_normal((rows, cols)) * 3).astype(np.float16)
    y = np.zeros_like(x)
    nsg = (tg + 31) // 32
    lib.dispatch_threadgroups("softmax_f16x4", grid=(rows, 1, 1), tg=(tg, 1, 1),
                              buffers=[x, y, SoftmaxArgs(cols, 1.0)], threadgroup_memory=[nsg * 4])
    ref = softmax_ref(x.astype(np.float32), 1.0)
    assert np.isfinite(y).all()
    assert np.abs(y.astype(np.float64) - ref).max() < TOL[np.float16]
    assert (np.abs(y.astype(np.float64) - ref) / np.maximum(ref, 1e-4)).max() < TOL[np.float16]


def test_softmax_f16x4_reports_missing_threadgroup_memory(load, strict_env):
    """Forgetting setThreadgroupMemoryLength is a host bug the emulator reports (no crash)."""
    lib = load("softmax")
    x = np.ones((1, 64), np.float16)
    y = np.zeros_like(x)
    with pytest.raises(RuntimeError, match=r"threadgroup\(0\)"):
        lib.dispatch_threadgroups("softmax_f16x4", grid=(1,), tg=(64,), buffers=[x, y, SoftmaxArgs(64, 1.0)])


@pytest.mark.parametrize("nb,tg", [(1000, 64), (37, 32), (1, 1)], ids=lambda v: str(v))
def test_q4_0_one_thread_per_block(load, strict_env, nb, tg):
    lib = load("q4_0")
    blocks = make_q4_0(nb, np.random.default_rng(nb))
    ref = q4_0_ref(blocks)
    # non-uniform grid (dispatchThreads): exactly nb threads
    y = np.zeros(nb * 32, dtype=np.float32)
    lib.dispatch_threads("dequantize_q4_0_f32", threads=(nb,), tg=(tg,), buffers=[blocks, y, np.uint32(nb)])
    assert np.array_equal(y, ref)
    # uniform grid that over-covers: the kernel's `if (ib >= nb) return;` must hold
    y[:] = 0
    lib.dispatch_threadgroups("dequantize_q4_0_f32", grid=((nb + tg - 1) // tg,), tg=(tg,),
                              buffers=[blocks, y, np.uint32(nb)])
    assert np.array_equal(y, ref)


@pytest.mark.parametrize("dtype,name", [(np.float32, "dequantize_q4_0_t_f32"), (np.float16, "dequantize_q4_0_t_f16")])
def test_q4_0_templated_host_name(load, strict_env, dtype, name):
    """Template kernels instantiated with [[host_name]], raw bytes + as_type<half>."""
    lib = load("q4_0")
    nb = 203
    blocks = make_q4_0(nb, np.random.default_rng(7))
    y = np.zeros(nb * 32, dtype=dtype)
    lib.dispatch_threads(name, threads=(nb * 4,), tg=(96,), buffers=[blocks.view(np.uint8), y, np.uint32(nb)])
    assert np.array_equal(y, q4_0_ref_half(blocks).astype(dtype))


def test_library_lists_kernels_and_bindings(load):
    lib = load("q4_0")
    assert lib.kernels == ["dequantize_q4_0_f32", "dequantize_q4_0_t_f16", "dequantize_q4_0_t_f32"]
    assert lib.meta["kernels"]["dequantize_q4_0_f32"] == [
        ["buffer", 0], ["buffer", 1], ["buffer", 2], ["builtin", "thread_position_in_grid"]]
    sm = load("softmax").meta["kernels"]["softmax_f16x4"]
    assert ["threadgroup", 0] in sm and ["builtin", "simdgroup_index_in_threadgroup"] in sm
