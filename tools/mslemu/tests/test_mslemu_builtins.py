"""Known answers for the Metal builtins src/metal uses (and their simd / atomic neighbours).

Every expected value follows the Metal Shading Language specification's definition of the
function, computed here in NumPy or written out by hand (IEEE-754 binary16 / bfloat16 bit
patterns), never taken from the emulator: simd-group reductions, prefix sums and shuffles
over the active lanes, atomics, float -> half / bfloat round-to-nearest-even, as_type bit
casts, float -> int truncation, simdgroup_matrix load / store / multiply with
elements_per_row, origin and transpose.  Kernels: kernels/builtins.metal.
"""
import numpy as np
import pytest

import mslemu

W = 32


@pytest.fixture(scope="module")
def lib():
    return mslemu.Library(mslemu.ROOT + "/kernels/builtins.metal", checks=True)


def simd_expected(x, lanes_alive):
    """[lane, 14] per the spec for one simdgroup whose lanes < lanes_alive run; NaN where
    the spec leaves the value undefined (a shuffle from a lane that does not run)."""
    n = lanes_alive
    e = np.full((n, 14), np.nan)
    active = [l for l in range(n) if l % 3 != 2]
    for l in range(n):
        e[l, 0] = x[:n].sum()
        e[l, 1] = x[:n].max()
        e[l, 2] = x[:n].min()
        e[l, 3] = x[:l + 1].sum()
        e[l, 4] = x[:l].sum()
        src = {5: (l * 7) % 32, 9: 17, 10: (l + 4) % 32, 8: l ^ 6}
        src[6] = l + 3 if l + 3 < W else l  # shuffle_down leaves the upper lanes' own value
        src[7] = l - 5 if l >= 5 else l      # shuffle_up leaves the lower lanes' own value
        for col, s in src.items():
            if s < n:
                e[l, col] = x[s]
        e[l, 11] = x[0]  # broadcast_first: the lowest active lane
        if l in active:
            e[l, 12] = x[active].sum()
            e[l, 13] = x[[a for a in active if a < l]].sum()
    return e


@pytest.mark.parametrize("threads", [64, 40], ids=["full", "partial_simdgroup"])
def test_simd_functions(lib, threads):
    rng = np.random.default_rng(threads)
    x = rng.permutation(np.arange(-40, 40))[:threads].astype(np.float32)  # distinct, exact sums
    out = np.full((threads, 14), np.nan, np.float32)
    lib.dispatch_threadgroups("simd_ops", (1,), (threads,), [x, out])
    for sg in range(0, threads, W):
        n = min(W, threads - sg)
        want = simd_expected(x[sg:sg + n].astype(np.float64), n)
        got = out[sg:sg + n].astype(np.float64)
        defined = ~np.isnan(want)
        defined[:, 12:] &= np.array([l % 3 != 2 for l in range(n)])[:, None]
        assert np.array_equal(got[defined], want[defined]), f"simdgroup {sg // W}"


def test_atomics(lib):
    n = 96
    a = np.array([0, -1000, 1000, 0, 50], np.int32)
    u = np.array([0, 0xFFFFFFFF, 0, 7, 0], np.uint32)
    old_add, cas = np.zeros(n, np.int32), np.zeros(n, np.int32)
    old_xchg = np.zeros(n, np.uint32)
    lib.dispatch_threads("atomics", (n,), (32,), [a, u, old_add, cas, old_xchg])
    i = np.arange(n)
    assert a[0] == (i + 1).sum()
    # fetch_add returns the value before: sorted, each step is the adding thread's increment
    order = np.argsort(old_add)
    assert old_add[order[0]] == 0 and np.array_equal(np.diff(old_add[order]), (order + 1)[:-1])
    vals = (i * 37) % 64 - 20
    assert a[1] == vals.max() and a[2] == vals.min()
    assert a[4] == 50 - 3 * n
    assert u[0] == 0xFFFFFFFF and u[1] == 0
    assert u[2] == np.bitwise_xor.reduce((i * 2654435761) % 2 ** 32).astype(np.uint32)
    # exchange: the old values chain 7 -> each thread's i + 100, ending in the last writer's
    assert sorted(old_xchg.tolist() + [int(u[3])]) == sorted([7] + (i + 100).tolist())
    winner = int(a[3]) - 1
    assert cas[winner] == -1 and (np.delete(cas, winner) == winner + 1).all()
    assert u[4] == 4242


def bits16(a):
    return a.view(np.uint16).tolist()


# (float32 input, binary16 bits, bfloat16 bits), round to nearest, ties to even
CONVERSIONS = [
    (1.0, 0x3C00, 0x3F80),
    (-2.0, 0xC000, 0xC000),
    (1 + 2 ** -11, 0x3C00, 0x3F80),                 # half tie -> even (down)
    (1 + 3 * 2 ** -11, 0x3C02, 0x3F80),             # half tie -> even (up)
    (1 + 2 ** -8, 0x3C04, 0x3F80),                  # bfloat tie -> even (down)
    (1 + 3 * 2 ** -8, 0x3C0C, 0x3F82),              # bfloat tie -> even (up)
    (1 + 2 ** -8 + 2 ** -20, 0x3C04, 0x3F81),       # just above the bfloat tie
    (65504.0, 0x7BFF, 0x4780),                      # largest half
    (65519.0, 0x7BFF, 0x4780),                      # below the half overflow tie
    (65520.0, 0x7C00, 0x4780),                      # the tie rounds to even: +inf
    (2 ** -14, 0x0400, 0x3880),                     # smallest normal half
    (-0.0, 0x8000, 0x8000),
    (float("inf"), 0x7C00, 0x7F80),
    (3.140625, 0x4248, 0x4049),
]


def test_float_to_half_and_bfloat_round_to_nearest_even(lib):
    f = np.array([c[0] for c in CONVERSIONS], np.float32)
    n = len(f)
    h, h_cast = np.zeros(n, np.float16), np.zeros(n, np.float16)
    b = np.zeros(n, np.uint16)
    back = np.zeros(2 * n, np.float32)
    ti = np.zeros(n, np.int32)
    b16 = np.array([0x3C00, 0xC000, 0x7BFF, 0x0400, 0x3555, 0xFC00] + [0] * (n - 6), np.uint16)
    fb16 = np.zeros(n, np.float32)
    b32 = np.array([0x40490FDB, 0xFFFFFFFF, 0x3F800000, 0x00000001] + [0] * (n - 4), np.uint32)
    fb32, ib32 = np.zeros(n, np.float32), np.zeros(n, np.int32)
    lib.dispatch_threads("conversions", (n,), (n,), [f, h, b, h_cast, back, ti, b16, fb16, b32, fb32, ib32])
    assert bits16(h) == [c[1] for c in CONVERSIONS]
    assert bits16(h_cast) == [c[1] for c in CONVERSIONS]
    assert b.tolist() == [c[2] for c in CONVERSIONS]
    # half -> float and bfloat -> float are exact: the bits widen
    assert np.array_equal(back[0::2].view(np.uint32), (h.astype(np.float32)).view(np.uint32))
    assert np.array_equal(back[1::2].view(np.uint32), b.astype(np.uint32) << 16)
    assert fb16[:6].tolist() == [1.0, -2.0, 65504.0, 2.0 ** -14, 0.333251953125, -np.inf]
    assert fb32[0] == np.float32(3.1415927410125732) and np.isnan(fb32[1]) and fb32[2] == 1.0
    assert fb32[3] == np.float32(2.0 ** -149) or fb32[3] == 0.0  # a GPU may flush float denormals
    assert ib32[:4].tolist() == [0x40490FDB, -1, 0x3F800000, 1]


def test_float_to_int_truncates_toward_zero(lib):
    vals = [2.7, -2.7, 0.5, -0.5, 1e9, -1e9, 7.0]
    n = len(vals)
    f = np.array(vals, np.float32)
    z = lambda t: np.zeros(n, t)  # noqa: E731
    ti = z(np.int32)
    lib.dispatch_threads("conversions", (n,), (n,), [f, z(np.float16), z(np.uint16), z(np.float16),
                                                     np.zeros(2 * n, np.float32), ti, z(np.uint16), z(np.float32),
                                                     z(np.uint32), z(np.float32), z(np.int32)])
    assert ti.tolist() == [2, -2, 0, 0, 1000000000, -1000000000, 7]


@pytest.mark.parametrize("kernel, dtype, col", [("store_as_half", np.float16, 1), ("store_as_bfloat", np.uint16, 2)])
def test_templated_output_conversion(lib, kernel, dtype, col):
    f = np.array([c[0] for c in CONVERSIONS], np.float32)
    y = np.zeros(len(f), dtype)
    lib.dispatch_threads(kernel, (len(f),), (len(f),), [f, y])
    assert y.view(np.uint16).tolist() == [c[col] for c in CONVERSIONS]


def test_math_functions(lib):
    """Within 4 ulp of float64 (the spec's precise-math bound for exp, log, sin, cos; Apple
    compiles with fast math by default, which the spec allows to be looser: kernel tests
    compare with tolerances).  ceil, max, min are exact."""
    x = np.array([0.25, 0.5, 1.0, 1.7, 2.5, 3.0, 7.25, 20.0], np.float32)
    o = np.zeros((len(x), 10), np.float32)
    lib.dispatch_threads("math_fns", (len(x),), (len(x),), [x, o])
    v = x.astype(np.float64)
    want = np.stack([1 / np.sqrt(v), np.exp(v), np.log(v), np.sin(v), np.cos(v), np.tanh(v), np.sqrt(v)], 1)
    ulp = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    assert (np.abs(o[:, :7] - want) <= 4 * ulp).all()
    assert o[:, 7].tolist() == np.ceil(v).tolist()
    assert o[:, 8].tolist() == np.maximum(v, 2.5).tolist() and o[:, 9].tolist() == np.minimum(v, 2.5).tolist()


def test_simdgroup_matrix_load_store_multiply(lib):
    src = np.arange(16 * 24, dtype=np.float32).reshape(16, 24) % 13 - 6  # small integers: exact products
    out = np.full(8 * 64, np.nan, np.float32)
    region = np.full((16, 16), np.nan, np.float32)
    region_t = np.full((16, 16), -1.0, np.float32)
    lib.dispatch_threadgroups("matrix_ops", (1,), (32,), [src, out, region, region_t])
    m = out.reshape(8, 8, 8)
    a = src[0:8, 0:8]
    b = src[4:12, 8:16]           # origin (x = column 8, y = row 4)
    d = src[8:16, 16:24].T        # transposed load at a pointer
    assert np.array_equal(m[0], a)
    assert np.array_equal(m[1], b)
    assert np.array_equal(m[2], a.T)
    assert np.array_equal(m[3], d)
    # transposed load with an origin: the origin addresses the SOURCE layout (column 16, row
    # 8), then the 8 x 8 block is transposed.  The spec does not spell this case out; Apple's
    # compiler swaps the stride and origin components together for a transposed load (AIR it
    # emitted for a public test kernel), which is this reading.  gguf_matmul.metal uses it.
    assert np.array_equal(m[4], src[8:16, 16:24].T)
    assert np.array_equal(m[5], a.astype(np.float64) @ b + 0.5)
    assert np.array_equal(m[6], a.T.astype(np.float64) @ d)
    assert np.array_equal(m[7], a.T)  # a stored transposed
    want = np.full((16, 16), -1.0)
    want[4:12, 8:16] = b          # stored at origin column 8, row 4, 16 elements per row
    assert np.array_equal(region, want)
    want = np.full((16, 16), -1.0)
    want[2:10, 3:11] = b.T        # stored transposed, the origin in the destination layout
    assert np.array_equal(region_t, want)
