"""mslemu.check_files / python -m mslemu.check: good kernels pass, broken ones fail with
diagnostics pointing at the .metal file."""
import os
import subprocess
import sys

import pytest

import mslemu

KDIR = os.path.join(mslemu.ROOT, "kernels")

HEADER = "#include <metal_stdlib>\nusing namespace metal;\n"
BROKEN = {
    "vector_ctor": "kernel void k(device float4 *o [[buffer(0)]], uint i [[thread_position_in_grid]]) {\n"
                   "    o[i] = float4(1.0f, 2.0f);\n}\n",
    "undeclared": "kernel void k(device float *o [[buffer(0)]], uint i [[thread_position_in_grid]]) {\n"
                  "    o[i] = undefined_thing;\n}\n",
    "write_constant": "kernel void k(constant float *c [[buffer(0)]], uint i [[thread_position_in_grid]]) {\n"
                      "    c[i] = 1.0f;\n}\n",
    "scalar_param_without_attribute": "kernel void k(device float *o [[buffer(0)]], uint n) {\n"
                                      "    o[0] = float(n);\n}\n",
}
DOUBLE = ("kernel void k(device float *o [[buffer(0)]], uint i [[thread_position_in_grid]]) {\n"
          "    o[i] = o[i] * 0.5;\n}\n")


def write(tmp_path, name, body):
    p = tmp_path / (name + ".metal")
    p.write_text(HEADER + body)
    return str(p)


def test_sample_kernels_pass_strict():
    files = sorted(os.path.join(KDIR, f) for f in os.listdir(KDIR) if f.endswith(".metal"))
    results = mslemu.check_files(files, strict=True)
    assert [r[0] for r in results] == files
    for path, ok, err in results:
        assert ok, (path, err)


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_kernel_fails(tmp_path, name):
    path = write(tmp_path, name, BROKEN[name])
    [(p, ok, err)] = mslemu.check_files([path], strict=False)
    assert p == path and not ok
    if name != "scalar_param_without_attribute":
        assert path + ":4:" in err  # diagnostics point at the .metal line
    else:
        assert "generator error" in err and "unsupported kernel parameter" in err


def test_double_promotion_fails_only_strict(tmp_path):
    path = write(tmp_path, "double", DOUBLE)
    [(_, ok, err)] = mslemu.check_files([path], strict=True)
    assert not ok and "double" in err
    [(_, ok, err)] = mslemu.check_files([path], strict=False)
    assert ok, err


def test_defines_and_include_dirs(tmp_path):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "n.h").write_text("#define N_FROM_HEADER 4\n")
    path = write(tmp_path, "defs", '#include "n.h"\n'
                 "kernel void k(device float *o [[buffer(0)]], uint i [[thread_position_in_grid]]) {\n"
                 "    o[i] = float(N_FROM_HEADER * SCALE);\n}\n")
    [(_, ok, err)] = mslemu.check_files([path], include_dirs=[str(inc)], defines={"SCALE": 2})
    assert ok, err
    [(_, ok, _)] = mslemu.check_files([path], include_dirs=[str(inc)])  # SCALE undefined
    assert not ok


def test_cli_exit_codes(tmp_path):
    good = os.path.join(KDIR, "softmax.metal")
    bad = write(tmp_path, "double", DOUBLE)
    env = dict(os.environ, PYTHONPATH=mslemu.ROOT)
    r = subprocess.run([sys.executable, "-m", "mslemu.check", "--strict", good, bad], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 1, r.stderr
    assert "softmax.metal: OK" in r.stdout and "double.metal: FAILED" in r.stdout
    r = subprocess.run([sys.executable, "-m", "mslemu.check", bad], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr  # double promotion is only an error with --strict
    assert "RuntimeWarning" not in r.stderr
