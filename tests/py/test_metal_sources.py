"""The Metal sources themselves: strict type-check, planner names, launches on NumPy."""

import itertools

import numpy as np
import pytest

from vllm_metal import _core, emulation

DTYPES = ["float32", "float16", "bfloat16"]
NP_DTYPES = {"float32": np.float32, "float16": np.float16}


def test_every_metal_file_type_checks_strictly():
    paths = sorted(str(p) for p in emulation.metal_source_dir().glob("*.metal"))
    assert paths, "no .metal sources found"
    results = emulation.mslemu_module().check_files(paths, strict=True)
    failures = [f"{path}:\n{err}" for path, ok, err in results if not ok]
    assert not failures, "\n".join(failures)


def planned_kernel_names():
    names = set()
    for dtype, fused in itertools.product(DTYPES, (False, True)):
        names |= {l.kernel for l in _core.plan_rms_norm(dtype, 2, 64, fused_add=fused)}
    for dtype in DTYPES:
        plan = _core.plan_cache_write(dtype, 2, 2, 64, 32, [128, 64, 1], copy_cache=True)
        names |= {l.kernel for l in plan}
    for dtype, d in itertools.product(DTYPES, _core.metal_attention_head_sizes()):
        plan = _core.plan_paged_attention(dtype, 9, 3, 8, 2, d, 16, 100, 64, num_decode_seqs=2,
                                          max_seq_len=4000, max_query_len=7)
        names |= {l.kernel for l in plan}
    gguf_types = [_core.gguf_type_info(t)[0] for t in range(64)
                  if _safe_type_info(t) and _core.gguf_type_info(t)[3]]
    for t, dtype in itertools.product(gguf_types, DTYPES):
        names |= {l.kernel for l in _core.plan_gguf_dequantize(t, dtype, 3, 256)}
        for m in (1, 8, 9, 100):  # mat-vec up to 8 rows, mat-mat beyond
            names |= {l.kernel for l in _core.plan_gguf_matmul(t, dtype, m, 64, 256)}
    for dtype, pos_dtype, neox in itertools.product(DTYPES, ("int32", "int64"), (True, False)):
        names |= {l.kernel for l in _core.plan_rope(dtype, pos_dtype, 3, 2, 64, is_neox=neox)}
    for dtype, in_place in itertools.product(DTYPES, (False, True)):
        names |= {l.kernel for l in _core.plan_apply_token_bitmask(dtype, 3, 1000, 32, in_place=in_place)}
    return names


def _safe_type_info(t):
    try:
        return _core.gguf_type_info(t)
    except ValueError:
        return None


def test_every_planned_kernel_is_instantiated():
    instantiated = set()
    for source in emulation.kernel_sources():
        instantiated |= set(emulation.library(source).kernels)
    missing = planned_kernel_names() - instantiated
    assert not missing, f"planners produce kernels no .metal file instantiates: {sorted(missing)}"


def test_kernel_names_are_unique_across_sources():
    # all .metal files link into one metallib on Apple
    seen = {}
    for source in emulation.kernel_sources():
        for name in emulation.library(source).kernels:
            assert name not in seen, f"{name} is defined in {seen[name]} and {source}"
            seen[name] = source


def test_rms_norm_plan_geometry():
    for hidden, threads in [(1, 32), (128, 32), (129, 64), (576, 256), (4096, 1024), (100000, 1024)]:
        (launch,) = _core.plan_rms_norm("float16", 7, hidden)
        assert launch.kernel == "rms_norm_float16"
        assert list(launch.grid) == [7, 1, 1]
        assert list(launch.threadgroup) == [threads, 1, 1]
        assert [(b.index, b.array_slot) for b in launch.buffers] == [(0, 0), (1, 1), (2, 2)]
        assert launch.args_index == 3 and len(launch.args) == 32


def test_cache_write_plan_copies_only_when_asked():
    plan = _core.plan_cache_write("float16", 3, 2, 64, 32, [128, 64, 1])
    assert [l.kernel for l in plan] == ["cache_write_float16"]
    plan = _core.plan_cache_write("float16", 3, 2, 64, 32, [128, 64, 1], copy_cache=True)
    assert [l.kernel for l in plan] == ["cache_copy_float16", "cache_write_float16"]
    assert [(b.index, b.array_slot) for b in plan[0].buffers] == [(0, 1), (1, 3)]
    assert plan[0].grid[0] * plan[0].threadgroup[0] >= 32 * 2 * 64


GUARD = 64  # elements of sentinel on each side of every output


def guarded(shape, dtype):
    """A C-contiguous output view with sentinel-filled guard regions around it."""
    n = int(np.prod(shape))
    backing = np.full(n + 2 * GUARD, 12345.0, dtype=dtype)
    return backing, backing[GUARD:GUARD + n].reshape(shape)


def assert_guards_intact(backing):
    assert np.all(backing[:GUARD] == 12345.0) and np.all(backing[-GUARD:] == 12345.0), \
        "kernel wrote outside its output"


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("rows, hidden", [(1, 1), (3, 33), (2, 1000), (5, 4097)])
@pytest.mark.parametrize("fused", [False, True])
def test_rms_norm_launches_on_numpy(rows, hidden, dtype, fused):
    rng = np.random.default_rng(rows * hidden)
    t = NP_DTYPES[dtype]
    x = rng.standard_normal((rows, hidden)).astype(t)
    r = rng.standard_normal((rows, hidden)).astype(t)
    w = rng.standard_normal(hidden).astype(t)
    out_backing, out = guarded((rows, hidden), t)
    res_backing, res = guarded((rows, hidden), t)
    plan = _core.plan_rms_norm(dtype, rows, hidden, fused_add=fused, eps=1e-6)
    emulation.run_plan(plan, [x, r, w, out, res] if fused else [x, w, out])
    h = (x.astype(np.float64) + r).astype(t).astype(np.float64) if fused else x.astype(np.float64)
    ref = h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-6) * w
    tol = 2e-5 if dtype == "float32" else 2e-3
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=tol, atol=tol)
    assert_guards_intact(out_backing)
    if fused:
        np.testing.assert_array_equal(res, h.astype(t))
        assert_guards_intact(res_backing)


def test_cache_write_launches_never_write_outside_the_cache():
    t, h, d, slots_n = 6, 2, 64, 32
    rng = np.random.default_rng(5)
    key = rng.standard_normal((t, h, d)).astype(np.float32)
    slots = np.array([0, 31, -1, 32, 1 << 40, 7], dtype=np.int64)  # two out of range
    kc_backing, kc = guarded((slots_n, h, d), np.float32)
    kc[:] = 0
    plan = _core.plan_cache_write("float32", t, h, d, slots_n, [h * d, d, 1])
    emulation.run_plan(plan, [key, kc, slots, kc])
    expect = np.zeros_like(kc)
    for i in (0, 1, 5):
        expect[slots[i]] = key[i]
    np.testing.assert_array_equal(kc, expect)
    assert_guards_intact(kc_backing)
