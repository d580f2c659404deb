import os

import mlx.core as mx
import pytest

# Metal kernels in the emulator run with NaN-filled threadgroup memory and
# strict barrier checks, so uninitialised reads and divergent barriers fail.
os.environ.setdefault("MSLEMU_POISON", "1")
os.environ.setdefault("MSLEMU_STRICT", "1")

from vllm_metal import ops  # noqa: E402

BACKENDS = ["native", "emulated"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Runs the test once on the C++ CPU kernels and once on the Metal kernels (emulated)."""
    previous = ops.kernel_backend()
    ops.set_kernel_backend(request.param)
    try:
        yield request.param
    finally:
        ops.set_kernel_backend(previous)


@pytest.fixture(autouse=True)
def _cpu_stream():
    # The Linux build has no GPU; on Apple these tests exercise the CPU path too.
    with mx.stream(mx.cpu):
        yield
