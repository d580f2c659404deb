import os

import mlx.core as mx
import pytest

# Metal kernels in the emulator run with NaN-filled threadgroup memory and
# strict barrier checks, so uninitialised reads and divergent barriers fail.
os.environ.setdefault("MSLEMU_POISON", "1")
os.environ.setdefault("MSLEMU_STRICT", "1")

from op_harness import metal_available  # noqa: E402
from vllm_metal import ops  # noqa: E402

# "metal": the op on a GPU stream, i.e. eval_gpu and the real metallib; only on a Mac
# (.github/workflows/macos.yml), skipped elsewhere.
BACKENDS = ["native", "emulated", "metal"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Runs the test on the C++ CPU kernels, on the Metal kernels in the emulator and, on
    Apple silicon, on the Metal kernels on the GPU."""
    if request.param == "metal":
        if not metal_available():
            pytest.skip("no Metal GPU here (runs on macOS: .github/workflows/macos.yml)")
        with mx.stream(mx.gpu):  # nested inside _cpu_stream, so it wins
            yield request.param
        return
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


def pytest_collection_modifyitems(config, items):
    """Modules holding slow tests run first, each kept whole and in its own order. Under
    xdist (scripts/test, --dist loadfile) its scheduler reorders modules, largest first;
    keeping this order there was tried and undone (docs/testing.md)."""
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    slow = {m for m, its in modules.items() if any(i.get_closest_marker("slow") for i in its)}
    items[:] = [i for m in sorted(modules, key=lambda m: m not in slow) for i in modules[m]]
