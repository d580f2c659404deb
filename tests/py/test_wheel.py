"""`pip wheel .` builds a wheel that installs into a fresh virtual environment,
imports next to MLX and runs an op (the path a user's `pip install` takes), and whose
doctor runs the emulator's checks from the packaged kernel sources."""

import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SMOKE = """
import mlx.core as mx, vllm_metal._core
from vllm_metal import ops
y = ops.rms_norm(mx.ones((2, 8)), mx.ones((8,)), 0.0)
assert mx.allclose(y, mx.ones((2, 8))).item()
print("ok", vllm_metal._core.__file__)
"""


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv_and_imports(tmp_path):
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-w", str(wheels),
         f"-Cbuild-dir={tmp_path / 'build'}"],
        capture_output=True, text=True,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = wheels.glob("vllm_metal-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    install = subprocess.run([str(py), "-m", "pip", "install", "-q", str(wheel)],
                             capture_output=True, text=True)
    assert install.returncode == 0, install.stderr[-3000:]
    # run from a neutral directory so the source tree cannot shadow the install
    run = subprocess.run([str(py), "-c", SMOKE], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert str(env_dir) in run.stdout
    # the doctor from the wheel alone: the emulator builds the packaged kernel sources and the
    # op checks pass; the memory check fails, naming vLLM, which this venv lacks
    doctor = subprocess.run([str(py), "-m", "vllm_metal.doctor", "--skip-serve"],
                            capture_output=True, text=True, cwd=tmp_path)
    assert doctor.returncode == 1, doctor.stdout[-3000:] + doctor.stderr[-3000:]
    for name in ("device", "metallib", "ops"):
        assert f"| {name} | PASS |" in doctor.stdout, doctor.stdout[-3000:]
    assert "| memory | **FAIL** |" in doctor.stdout and "vLLM is not importable" in doctor.stdout
