"""The args-header convention: kernels/axpby_args.h is included by the kernel (MSL branch,
<metal_stdlib>) and by host C++ (<cstdint> branch), with fixed-width fields whose layout
must agree between the two and with the Python mirror."""
import ctypes
import os
import subprocess

import numpy as np

import mslemu

KDIR = os.path.join(mslemu.ROOT, "kernels")


class AxpbyArgs(ctypes.Structure):
    # mirrors struct AxpbyArgs in kernels/axpby_args.h
    _fields_ = [("n_cols", ctypes.c_uint32), ("n_rows", ctypes.c_uint32),
                ("x_row_stride", ctypes.c_int64), ("y_row_stride", ctypes.c_int64),
                ("x_offset", ctypes.c_uint64), ("y_offset", ctypes.c_uint64),
                ("alpha", ctypes.c_float), ("beta", ctypes.c_float)]


HOST_CPP = r"""
#include "axpby_args.h"
#include <cstddef>
#include <cstdio>
#define F(name) std::printf(#name " %zu\n", offsetof(AxpbyArgs, name));
int main() {
  std::printf("size %zu\n", sizeof(AxpbyArgs));
  F(n_cols) F(n_rows) F(x_row_stride) F(y_row_stride) F(x_offset) F(y_offset) F(alpha) F(beta)
  return 0;
}
"""


def test_host_layout_matches_python_mirror(tmp_path):
    """The header compiles as plain host C++ (the #else branch) with -Werror."""
    src = tmp_path / "host.cpp"
    src.write_text(HOST_CPP)
    exe = tmp_path / "host"
    r = subprocess.run([mslemu.find_cxx(), "-std=c++17", "-Wall", "-Wextra", "-Werror", "-I", KDIR, str(src),
                        "-o", str(exe)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = dict(line.split() for line in subprocess.run([str(exe)], check=True, capture_output=True,
                                                       text=True).stdout.splitlines())
    assert int(out.pop("size")) == ctypes.sizeof(AxpbyArgs) == 48
    assert {k: int(v) for k, v in out.items()} == {f: getattr(AxpbyArgs, f).offset for f, _ in AxpbyArgs._fields_}


def test_axpby_strided_views(load, strict_env):
    """Negative and padded 64-bit strides, ragged 2-D grid; the kernel static_asserts the size."""
    lib = load("axpby")
    rows, cols = 7, 45
    rng = np.random.default_rng(3)
    x = rng.standard_normal((rows, 50)).astype(np.float32)
    y = rng.standard_normal(3 + rows * 64).astype(np.float32)
    y_view = y[3:].reshape(rows, 64)[:, :cols]
    ref = np.float32(1.5) * x[::-1, :cols] + np.float32(-0.25) * y_view
    y_before = y.copy()
    args = AxpbyArgs(n_cols=cols, n_rows=rows, x_row_stride=-50, y_row_stride=64,
                     x_offset=(rows - 1) * 50, y_offset=3, alpha=1.5, beta=-0.25)
    lib.dispatch_threads("axpby_f32", threads=(cols, rows), tg=(16, 3), buffers=[args, x, y])
    assert np.allclose(y[3:].reshape(rows, 64)[:, :cols], ref, rtol=1e-6, atol=1e-6)
    untouched = np.ones_like(y, bool)
    untouched[3:].reshape(rows, 64)[:, :cols] = False
    assert np.array_equal(y[untouched], y_before[untouched])


def test_fixed_width_types_in_metal_namespace(tmp_path):
    """uint32_t & co. exist both globally and as metal::uint32_t, as in MSL."""
    k = tmp_path / "types.metal"
    k.write_text("""#include <metal_stdlib>
using namespace metal;
static_assert(sizeof(metal::int64_t) == 8 && sizeof(uint64_t) == 8 && sizeof(metal::uint32_t) == 4, "");
static_assert(sizeof(int16_t) == 2 && sizeof(metal::uint8_t) == 1 && sizeof(long) == 8, "");
kernel void k(device int64_t *p [[buffer(0)]], uint i [[thread_position_in_grid]]) { p[i] = (int64_t) i; }
""")
    [(path, ok, err)] = mslemu.check_files([k])
    assert ok, err
