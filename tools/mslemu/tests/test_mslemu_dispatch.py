"""Dispatch geometry (ragged dispatch_threads grids, threadgroups that are not a multiple
of 32), function constants, and how launch errors are reported."""
import threading

import numpy as np
import pytest


def run_grid_probe(lib, threads, tg, uniform=False):
    """-> hits [pad_h, pad_w], info [pad_h, pad_w, 4], grid [4]"""
    ntg = [(threads[i] + tg[i] - 1) // tg[i] for i in range(2)]
    pad_h, pad_w = ntg[1] * tg[1], ntg[0] * tg[0]
    hits = np.zeros((pad_h, pad_w), np.uint32)
    info = np.zeros((pad_h, pad_w, 4), np.uint32)
    grid = np.zeros(4, np.uint32)
    bufs = [hits, info, grid, np.uint32(pad_w)]
    if uniform:
        lib.dispatch_threadgroups("grid_probe", grid=tuple(ntg), tg=tg, buffers=bufs)
    else:
        lib.dispatch_threads("grid_probe", threads=threads, tg=tg, buffers=bufs)
    return hits, info, grid


@pytest.mark.parametrize("threads,tg", [((37, 5), (8, 4)), ((100, 3), (32, 2)), ((5, 7), (7, 5)),
                                        ((1, 1), (16, 16)), ((33, 1), (33, 1))], ids=lambda v: str(v))
def test_dispatch_threads_ragged_grid(load, strict_env, threads, tg):
    hits, info, grid = run_grid_probe(load("probes"), threads, tg)
    w, h = threads
    assert (hits[:h, :w] == 1).all()  # every grid thread ran exactly once
    assert hits.sum() == w * h        # and no thread outside the grid ran
    ntg = [(threads[i] + tg[i] - 1) // tg[i] for i in range(2)]
    assert list(grid) == [w, h, ntg[0], ntg[1]]
    ys, xs = np.mgrid[:h, :w]
    assert (info[:h, :w, 0] == xs // tg[0]).all() and (info[:h, :w, 1] == ys // tg[1]).all()
    # threads_per_threadgroup is the actual (clipped) size of edge threadgroups
    assert (info[:h, :w, 2] == np.minimum(tg[0], w - (xs // tg[0]) * tg[0])).all()
    assert (info[:h, :w, 3] == np.minimum(tg[1], h - (ys // tg[1]) * tg[1])).all()


def test_dispatch_threadgroups_runs_whole_threadgroups(load, strict_env):
    hits, info, grid = run_grid_probe(load("probes"), (37, 5), (8, 4), uniform=True)
    assert (hits == 1).all() and hits.shape == (8, 40)
    assert (info[..., 2] == 8).all() and (info[..., 3] == 4).all()
    assert list(grid) == [40, 8, 5, 2]


@pytest.mark.parametrize("ntg", [1, 7, 31, 33, 45, 100, 1000, 1024])
def test_threadgroup_not_multiple_of_32(load, strict_env, ntg):
    lib = load("probes")
    n_tg = 3
    x = np.random.default_rng(ntg).standard_normal(n_tg * ntg).astype(np.float32)
    lanes = np.zeros((n_tg * ntg, 4), np.uint32)
    sums = np.zeros(n_tg, np.float32)
    lib.dispatch_threadgroups("simd_probe", grid=(n_tg,), tg=(ntg,), buffers=[x, lanes, sums])
    tid = np.arange(n_tg * ntg) % ntg
    nsg = (ntg + 31) // 32
    width = np.where(tid // 32 == nsg - 1, ntg - (nsg - 1) * 32, 32)  # the last simdgroup is partial
    assert (lanes[:, 0] == width).all()
    assert (lanes[:, 1] == tid % 32).all()
    assert (lanes[:, 2] == tid // 32).all()
    assert (lanes[:, 3] == nsg).all()
    assert np.allclose(sums, x.reshape(n_tg, ntg).sum(1), atol=1e-4)


def test_function_constants(load, strict_env):
    lib = load("probes")
    assert sorted((fc["index"], fc["type"], fc["name"]) for fc in lib.meta["function_constants"]) == [
        ("10", "bool", "fc_has_bias"), ("11", "uint", "fc_act"), ("12", "float", "fc_gain")]
    x = np.linspace(-2, 2, 77).astype(np.float32)
    bias = np.full(77, 0.5, np.float32)
    y = np.zeros_like(x)
    lib.set_function_constant(10, False)
    lib.set_function_constant(11, 0)
    lib.set_function_constant(12, 3.0)
    # Every declared buffer must be bound, even one a constant disables (Metal would
    # accept it unbound): the emulator checks bindings at kernel entry.
    lib.dispatch_threads("fc_affine", threads=(77,), tg=(32,), buffers=[x, bias, y])
    assert np.array_equal(y, np.float32(3) * x)  # bias not added
    lib.set_function_constant(10, np.bool_(True))
    lib.set_function_constant(11, np.uint32(1))
    lib.dispatch_threads("fc_affine", threads=(77,), tg=(32,), buffers=[x, bias, y])
    assert np.array_equal(y, np.maximum(np.float32(3) * x + bias, 0))
    # per-dispatch values (set + dispatch under one lock hold)
    lib.dispatch_threads("fc_affine", threads=(77,), tg=(32,), buffers=[x, bias, y],
                         function_constants={10: False, 11: 2, 12: -1.0})
    assert np.array_equal(y, x * x)


def test_function_constant_errors(load):
    lib = load("probes")
    with pytest.raises(KeyError):
        lib.set_function_constant(3, 1)
    with pytest.raises(ValueError, match="has 4 bytes, got 8"):
        lib.set_function_constant(11, np.uint64(1))
    with pytest.raises(KeyError):
        lib.dispatch_threads("fc_affine", threads=(1,), tg=(1,), buffers=[], function_constants={99: 1})


def test_concurrent_dispatch_with_function_constants(load):
    """Host threads dispatching with different constants never see each other's values."""
    lib = load("probes")
    x = np.arange(1, 65, dtype=np.float32)
    errors = []

    def worker(gain):
        y = np.zeros_like(x)
        for _ in range(60):
            y[:] = 0
            lib.dispatch_threads("fc_affine", threads=(64,), tg=(64,), buffers=[x, x, y], workers=1,
                                 function_constants={10: False, 11: 0, 12: gain})
            if not np.array_equal(y, np.float32(gain) * x):
                errors.append(gain)

    threads = [threading.Thread(target=worker, args=(g,)) for g in (2.0, 3.0, 5.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_launch_errors(load):
    lib = load("probes")
    with pytest.raises(KeyError, match="no kernel 'nope'"):
        lib.dispatch_threads("nope", threads=(1,), tg=(1,), buffers=[])
    with pytest.raises(RuntimeError, match="exceeds 1024"):
        lib.dispatch_threadgroups("simd_probe", grid=(1,), tg=(1025,), buffers=[])
    with pytest.raises(ValueError, match="skip empty dispatches"):
        lib.dispatch_threads("simd_probe", threads=(0,), tg=(32,), buffers=[])
    with pytest.raises(ValueError, match="C-contiguous"):
        lib.dispatch_threads("simd_probe", threads=(4,), tg=(4,), buffers=[np.zeros((4, 4), np.float32)[:, 0]])


INSTANTIATIONS = r"""#include <metal_stdlib>
using namespace metal;
template <typename T>
kernel void scale(device T *x [[buffer(0)]], uint i [[thread_position_in_grid]]) { x[i] = x[i] * T(3); }
typedef decltype(scale<int>) scale_i32_t;
template [[host_name("scale_decltype")]] kernel decltype(scale<float>) scale<float>;
template [[host_name("scale_typedef")]] kernel scale_i32_t scale<int>;
template [[host_name("scale_signature")]] kernel void scale<half>(device half *x [[buffer(0)]],
                                                                  uint i [[thread_position_in_grid]]);
// MLX-style macro: the host name is built by stringizing, i.e. adjacent literals
#define instantiate_scale(tname, type) \
    template [[host_name("scale_" #tname)]] kernel decltype(scale<type>) scale<type>;
instantiate_scale(u32, uint) instantiate_scale(bf16, bfloat)
"""


def test_host_name_instantiation_forms(tmp_path, monkeypatch):
    import mslemu

    monkeypatch.setenv("MSLEMU_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "inst.metal"
    src.write_text(INSTANTIATIONS)
    lib = mslemu.Library(str(src), opt="-O0")
    assert lib.kernels == ["scale_bf16", "scale_decltype", "scale_signature", "scale_typedef", "scale_u32"]
    for name, dtype in [("scale_decltype", np.float32), ("scale_typedef", np.int32), ("scale_signature", np.float16),
                        ("scale_u32", np.uint32)]:
        x = np.arange(5, dtype=dtype)
        lib.dispatch_threads(name, threads=(5,), tg=(5,), buffers=[x])
        assert np.array_equal(x, np.arange(5, dtype=dtype) * 3), name
