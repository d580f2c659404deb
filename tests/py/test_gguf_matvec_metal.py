"""The Metal GGUF mat-vec kernel (gguf_matvec, src/metal/gguf_matvec_core.h) in the emulator
and, on a Mac, on the GPU: every type, every activation dtype, 1..9 and 16 x rows, odd n,
each simdgroup shape the planner picks and the 8-weight pieces of every decoder; and, in
the emulator's counting build, that no lane idles in its loop at decode shapes.

The reference is the gguf package's dequantization times x in float64 (test_gguf_matmul.check).
"""

from __future__ import annotations

import struct
import types

import mlx.core as mx
import numpy as np
import pytest

from op_harness import metal_available
from test_gguf_fixtures import SUPPORTED, T, block_size, random_blocks, reference_dequantize
from test_gguf_matmul import TOLERANCE, check
from vllm_metal import _core, emulation, ops
from vllm_metal import kernel_traffic as kt

needs_emulator = pytest.mark.skipif(not emulation.emulator_available(), reason="needs clang >= 19 (mslemu)")

ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 16]
# offsets in GgufMatmulArgs (src/metal/gguf_matmul_args.h) of the mat-vec shape
LANES_AT, PIECE_AT = 40, 48


@pytest.fixture(params=["emulated", "metal"])
def matvec_everywhere(request):
    """The Metal kernels in batch-invariant mode, where the mat-vec kernel serves every m:
    in the emulator here, on the GPU on a Mac (skipped elsewhere)."""
    previous_backend, previous_mode = ops.kernel_backend(), ops.batch_invariant()
    ops.set_batch_invariant(True)
    try:
        if request.param == "metal":
            if not metal_available():
                pytest.skip("no Metal GPU here (runs on macOS: .github/workflows/macos.yml)")
            with mx.stream(mx.gpu):
                yield "metal"
        else:
            ops.set_kernel_backend("emulated")
            yield "emulated"
    finally:
        ops.set_kernel_backend(previous_backend)
        ops.set_batch_invariant(previous_mode)


def decode_k(t) -> int:
    """A k where the planner uses 8-weight pieces (k = 576: 8 lanes x 2 rows) if the type's
    blocks allow it, else 768 (16 lanes x 4 rows, 16-weight pieces)."""
    return 576 if block_size(t) <= 32 else 768


@pytest.mark.parametrize("t", SUPPORTED, ids=[t.name for t in SUPPORTED])
def test_every_type_dtype_and_row_count(matvec_everywhere, t):
    k = decode_k(t)
    for dtype in TOLERANCE["float"]:
        for m in ROWS:
            assert _core.plan_gguf_matmul(t.name, dtype, m, 37, k)[0].kernel.startswith("gguf_matvec")
            check(t, m, 37, k, dtype, seed=10 * m + len(dtype), backend=matvec_everywhere)


@pytest.mark.parametrize("t", [T.F32, T.BF16, T.Q8_0], ids=lambda t: t.name)
def test_every_simdgroup_shape(matvec_everywhere, t):
    # lanes per row 1 (odd k of the float types), 2, 8 (8-weight pieces), 16 and 32; n odd
    # and below one simdgroup's rows, so lanes hold fewer rows than the others or none
    ks = [13, 31, 32, 576, 640, 1024] if block_size(t) == 1 else [32, 96, 576, 640, 1024]
    for k in ks:
        for m, n in [(1, 5), (3, 21), (9, 37)]:
            check(t, m, n, k, "float32", seed=k + m, backend=matvec_everywhere)


def forced_plan(qtype: str, m: int, n: int, k: int, lanes: int, rows: int, piece: int,
                dtype: str = "float32"):
    """The planner's mat-vec launch with another simdgroup shape written into its args."""
    launch = _core.plan_gguf_matmul(qtype, dtype, m, n, k)[0]
    args = bytearray(launch.args)
    struct.pack_into("<III", args, LANES_AT, lanes, rows, piece)
    per_tg = 2 * (32 // lanes) * rows  # 2 simdgroups per threadgroup
    fields = {f: getattr(launch, f) for f in ("buffers", "constants", "kernel", "source",
                                               "threadgroup", "threadgroup_memory", "args_index")}
    grid = [-(-n // per_tg), launch.grid[1], launch.grid[2]]
    return [types.SimpleNamespace(**fields, args=bytes(args), grid=grid)]


@needs_emulator
@pytest.mark.parametrize("t", SUPPORTED, ids=[t.name for t in SUPPORTED])
def test_eight_weight_pieces_of_every_decoder(t):
    # the planner picks 8-weight pieces only for 32-weight blocks and float rows; the
    # kernel has them for every type, so each decode8 is checked here on forced shapes
    k = 256
    blocks = random_blocks(t, 13, k, seed=3)
    w = reference_dequantize(blocks, t, (13, k)).astype(np.float64)
    x = np.random.default_rng(4).standard_normal((3, k)).astype(np.float32)
    for lanes, rows in [(32, 4), (8, 2), (2, 1)]:
        y = np.zeros((3, 13), np.float32)
        emulation.run_plan(forced_plan(t.name, 3, 13, k, lanes, rows, 8), [x, blocks, y])
        ref = x.astype(np.float64) @ w.T
        err = np.abs(y - ref).max() / np.abs(ref).max()
        assert err <= TOLERANCE["float"]["float32"], f"{t.name} lanes={lanes} rows={rows}: {err:.3g}"


def lane_use(case) -> float:
    traffic = kt.measure(case)
    assert len(traffic.launches) == 1 and traffic.launches[0].kernel.startswith("gguf_matvec")
    assert traffic.lane_use == traffic.launches[0].lane_use
    return traffic.lane_use


@needs_emulator
@pytest.mark.parametrize("t", SUPPORTED, ids=[t.name for t in SUPPORTED])
def test_no_lane_idles_at_decode_shapes(t):
    # n a multiple of every shape's rows per threadgroup: every simdgroup full
    ks = [576, 640, 1536, 2048] if block_size(t) <= 32 else [256, 1024, 1536, 2048]
    for k in ks:
        for m in (1, 5):
            use = lane_use(kt.gguf_matvec(t.name, "float16", m, 64, k))
            assert use == 1.0, f"{t.name} m={m} k={k}: lane use {use:.4f}"


@needs_emulator
def test_lane_use_catches_idle_lanes():
    # the same kernel with 32 lanes per row at k = 576 (36 chunks): lanes 4..31 sit out
    # every second pass, as in a one-row-per-simdgroup kernel; the check above would fail
    case = kt.gguf_matvec("Q4_1", "float16", 1, 64, 576)
    case.plan = forced_plan("Q4_1", 1, 64, 576, 32, 4, 16, "float16")
    use = lane_use(case)
    assert use < 0.9, use
