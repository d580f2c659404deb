"""Compiler discovery and the build cache: location, keys, and builds racing in
several processes."""
import os
import subprocess
import sys

import numpy as np
import pytest

import mslemu

TINY = """#include <metal_stdlib>
#include "tiny_args.h"
using namespace metal;
kernel void add(device float *x [[buffer(0)]], uint i [[thread_position_in_grid]]) { x[i] += ADD + TINY_EXTRA; }
"""


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A one-kernel .metal file with a header, and an empty private cache."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "tiny.metal").write_text(TINY)
    (src / "tiny_args.h").write_text("#define TINY_EXTRA 0.0f\n")
    cache = tmp_path / "cache"
    monkeypatch.setenv("MSLEMU_CACHE_DIR", str(cache))
    return src / "tiny.metal", cache


def fake_clang(directory, version):
    directory.mkdir(exist_ok=True)
    p = directory / "clang++"
    p.write_text("#!/bin/sh\necho 'clang version %s (fake)'\n" % version)
    p.chmod(0o755)
    return str(p)


def test_find_cxx(tmp_path, monkeypatch):
    monkeypatch.setenv("MSLEMU_CXX", "/opt/my/clang++")
    assert mslemu.find_cxx() == "/opt/my/clang++"
    monkeypatch.delenv("MSLEMU_CXX")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(RuntimeError, match="clang-19"):
        mslemu.find_cxx()
    monkeypatch.setenv("PATH", os.path.dirname(fake_clang(tmp_path / "old", "14.0.6")))
    with pytest.raises(RuntimeError, match="apt-get install clang-19"):
        mslemu.find_cxx()
    new = fake_clang(tmp_path / "new", "19.1.7")
    monkeypatch.setenv("PATH", os.path.dirname(new))
    assert mslemu.find_cxx() == new


def test_cache_location_and_reuse(tiny):
    path, cache = tiny
    lib = mslemu.Library(str(path), defines={"ADD": "1.0f"}, opt="-O0")
    assert lib.so_path.startswith(str(cache) + os.sep)
    assert not lib.so_path.startswith(mslemu.ROOT)
    x = np.zeros(5, np.float32)
    lib.dispatch_threads("add", threads=(5,), tg=(4,), buffers=[x])
    assert (x == 1).all()
    mtime = os.stat(lib.so_path).st_mtime_ns
    again = mslemu.Library(str(path), defines={"ADD": "1.0f"}, opt="-O0")
    assert again.so_path == lib.so_path and os.stat(lib.so_path).st_mtime_ns == mtime  # no rebuild
    assert os.listdir(cache) == [os.path.basename(lib.build_dir)]  # no temp dirs left


def test_cache_key_covers_defines_and_headers(tiny):
    path, _ = tiny
    a = mslemu.Library(str(path), defines={"ADD": "1.0f"}, opt="-O0")
    b = mslemu.Library(str(path), defines={"ADD": "2.0f"}, opt="-O0")
    assert a.so_path != b.so_path
    (path.parent / "tiny_args.h").write_text("#define TINY_EXTRA 10.0f\n")
    c = mslemu.Library(str(path), defines={"ADD": "2.0f"}, opt="-O0")
    assert c.so_path != b.so_path
    x = np.zeros(3, np.float32)
    c.dispatch_threads("add", threads=(3,), tg=(3,), buffers=[x])
    assert (x == 12).all()


def test_build_error_is_reported(tiny):
    path, cache = tiny
    with pytest.raises(mslemu.BuildError, match="ADD"):  # ADD undefined
        mslemu.Library(str(path), opt="-O0")
    assert os.listdir(cache) == []  # the failed build's temp dir is gone


def test_concurrent_builds_in_several_processes(tiny):
    """pytest-xdist style: processes building the same library at once all succeed."""
    path, cache = tiny
    code = ("import sys, numpy as np; sys.path.insert(0, %r); import mslemu\n"
            "lib = mslemu.Library(%r, defines={'ADD': '3.0f'}, opt='-O0')\n"
            "x = np.zeros(8, np.float32); lib.dispatch_threads('add', threads=(8,), tg=(8,), buffers=[x])\n"
            "assert (x == 3).all(); print(lib.so_path)\n") % (mslemu.ROOT, str(path))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    assert len({out.strip() for out, _ in outs}) == 1
    assert len(os.listdir(cache)) == 1  # one entry, no temp dirs left behind
