"""Shared fixtures of the mslemu tests: tools/mslemu on sys.path, one Library per
kernel file per session, and the strict environment every kernel test should run under."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tools/mslemu
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import mslemu  # noqa: E402

KDIR = os.path.join(ROOT, "kernels")

_libs = {}


@pytest.fixture(scope="session")
def load():
    """load("softmax") -> mslemu.Library of kernels/softmax.metal, built once per session."""
    def _load(name, **kw):
        key = (name, repr(sorted(kw.items())))
        if key not in _libs:
            _libs[key] = mslemu.Library(os.path.join(KDIR, name + ".metal"), **kw)
        return _libs[key]
    return _load


@pytest.fixture
def strict_env(monkeypatch):
    """MSLEMU_POISON=1 MSLEMU_STRICT=1 for this test.  The runtime reads both at every
    dispatch, so setting them in-process is enough."""
    monkeypatch.setenv("MSLEMU_POISON", "1")
    monkeypatch.setenv("MSLEMU_STRICT", "1")


@pytest.fixture
def lenient_env(monkeypatch):
    monkeypatch.delenv("MSLEMU_POISON", raising=False)
    monkeypatch.delenv("MSLEMU_STRICT", raising=False)
