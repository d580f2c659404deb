"""All src/metal/*.metal files link into ONE library, as the Apple metallib build links them.

CMakeLists.txt (mlx_build_metallib, docs/apple.md) compiles each .metal file to AIR on its own
and links them all into vllm_metal.metallib; a symbol or kernel name defined by two files
breaks that link. Here each file is compiled by the emulator's clang as its own translation
unit, with MSL's linkage for program-scope `constant` variables, and all are linked into one
shared object (tools/mslemu/mslemu/link.py). Verified on Linux only; Apple's linker is not run.
"""

import pytest

from vllm_metal import emulation


@pytest.mark.slow
def test_every_metal_file_links_into_one_library():
    paths = sorted(str(p) for p in emulation.metal_source_dir().glob("*.metal"))
    assert len(paths) > 1
    mslemu = emulation.mslemu_module()
    from mslemu import link

    names = link.link(paths)
    assert sorted(names) == paths
    assert all(names[p] for p in paths), "a .metal file without kernels"
    assert mslemu  # the emulator package was importable from its own root
