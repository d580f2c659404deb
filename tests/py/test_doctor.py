"""python -m vllm_metal.doctor: its checks pass here (emulator), fail with a reason when
something is broken, and the exit status and report say so."""

import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from serving_harness import free_port  # a port no other test worker takes
from vllm_metal import doctor, doctor_ops, ops

GIB = 2**30


@pytest.fixture
def no_metal(monkeypatch):
    """The doctor's branch for machines without Metal (Linux), also when this is a Mac."""
    monkeypatch.setattr(doctor, "on_apple", lambda: False)
    monkeypatch.setattr(doctor, "metal_available", lambda: False)


def test_device_check_names_the_cpu_and_the_emulator_without_metal(no_metal):
    r = doctor.run_check("device", doctor.check_device)
    assert r.ok, r.detail
    assert "no Metal GPU" in r.detail and "emulator" in r.detail


def test_device_check_fails_on_a_mac_without_metal(monkeypatch):
    monkeypatch.setattr(doctor, "on_apple", lambda: True)
    monkeypatch.setattr(doctor, "metal_available", lambda: False)
    r = doctor.run_check("device", doctor.check_device)
    assert not r.ok and "mx.metal.is_available() is False" in r.detail


def test_metallib_check_builds_every_kernel_source_in_the_emulator(no_metal):
    from vllm_metal import emulation

    r = doctor.run_check("metallib", doctor.check_metallib)
    assert r.ok, (r.detail, r.notes)
    assert f"all {len(emulation.kernel_sources())} kernel sources" in r.detail
    for source in emulation.kernel_sources():
        assert source in r.detail


def test_metallib_check_reports_a_kernel_that_does_not_build(monkeypatch, no_metal):
    from vllm_metal import emulation

    real_load = emulation.load

    def load(source):
        if source == "rope":
            raise RuntimeError("rope.metal:3: error: unknown type name 'flaot'")
        real_load(source)

    monkeypatch.setattr(emulation, "load", load)
    r = doctor.run_check("metallib", doctor.check_metallib)
    assert not r.ok and "failed to build 1 of" in r.detail
    assert any("rope.metal" in n and "flaot" in n for n in r.notes)


@pytest.fixture
def fake_mac(monkeypatch, tmp_path):
    """A Mac as far as the metallib lookup goes: Metal 'available', the package in tmp_path."""
    monkeypatch.setattr(doctor, "metal_available", lambda: True)
    candidates = [tmp_path / "lib" / "vllm_metal.metallib", tmp_path / "metallib" / "vllm_metal.metallib"]
    monkeypatch.setattr(doctor, "metallib_candidates", lambda: candidates)
    return candidates


def test_metallib_check_names_the_paths_it_tried(fake_mac):
    r = doctor.run_check("metallib", doctor.check_metallib)
    assert not r.ok
    assert str(fake_mac[0]) in r.detail and str(fake_mac[1]) in r.detail


def test_metallib_check_rejects_a_file_that_is_not_a_metal_library(fake_mac):
    fake_mac[0].parent.mkdir()
    fake_mac[0].write_bytes(b"\x7fELF not a metallib")
    r = doctor.run_check("metallib", doctor.check_metallib)
    assert not r.ok and "no MTLB header" in r.detail


def test_metallib_candidates_follow_the_installed_layout():
    # the lookup of src/cpp/metal/encoder.cpp: next to the core library, in vllm_metal/lib
    from vllm_metal import _core

    core_dir = Path(_core.__file__).parent
    lib = doctor.metallib_candidates()[0]
    assert lib.parent == core_dir / "lib"
    assert any(p.name.startswith("libvllm_metal_core") for p in lib.parent.iterdir())


def test_op_checks_pass_on_the_emulated_metal_kernels(no_metal):
    r = doctor.run_check("ops", doctor.check_ops)
    assert r.ok, (r.detail, r.notes)
    assert f"{len(doctor_ops.CASES)}/{len(doctor_ops.CASES)} op checks on the MSL emulator" in r.detail
    assert ops.kernel_backend() == "native"  # restored


def test_op_checks_catch_a_wrong_kernel(monkeypatch, no_metal):
    # a kernel that is off by one ulp-sized step too many: 1e-4 relative
    real = ops.rms_norm
    monkeypatch.setattr(ops, "rms_norm", lambda x, w, eps: real(x, w, eps) * (1 + 1e-4))
    r = doctor.run_check("ops", doctor.check_ops)
    assert not r.ok and f"{len(doctor_ops.CASES) - 1}/{len(doctor_ops.CASES)}" in r.detail
    assert any(n.startswith("FAIL rms_norm") for n in r.notes)


def test_op_check_references_are_independent_of_the_kernels():
    # the references reproduce hand-computed values (so a check cannot agree with a wrong op)
    blocks, w = doctor_ops._gguf_blocks("Q4_0", 1, 32, seed=0)
    d = float(blocks[:2].view(np.float16)[0])
    assert w[0, 0] == pytest.approx(d * ((blocks[2] & 15) - 8.0))
    assert w[0, 16] == pytest.approx(d * ((blocks[2] >> 4) - 8.0))
    x = np.array([[3.0, 4.0]])
    assert doctor_ops._rms(x, np.ones(2), 0.0) == pytest.approx(x / np.sqrt(12.5))


def test_a_crashing_op_is_a_failed_case_not_a_crash():
    def boom(ops):
        raise RuntimeError("[paged_attention] kernel exploded")

    (r,) = doctor_ops.run_cases(ops, {"boom": boom})
    assert not r.ok and "kernel exploded" in r.message


def test_memory_check_reports_the_budget_of_a_16_gib_mac(monkeypatch):
    from vllm_metal import worker

    mac = worker.DeviceMemory(limit=int(10.7 * GIB), in_use=0, available=9 * GIB,
                              margin=GIB, source="Metal recommended working set")
    monkeypatch.setattr(worker.DeviceMemory, "measure", classmethod(lambda cls: mac))
    r = doctor.run_check("memory", doctor.check_memory)
    assert r.ok, r.detail
    expected = min(int(10.7 * GIB * 0.92), 9 * GIB) - GIB  # vLLM's default utilization 0.92
    assert f"fill {expected / GIB:.2f} GiB" in r.detail


def test_memory_check_fails_when_nothing_is_left(monkeypatch):
    from vllm_metal import worker

    full = worker.DeviceMemory(limit=8 * GIB, in_use=8 * GIB, available=GIB, margin=GIB,
                               source="Metal recommended working set")
    monkeypatch.setattr(worker.DeviceMemory, "measure", classmethod(lambda cls: full))
    r = doctor.run_check("memory", doctor.check_memory)
    assert not r.ok and "no memory left for the KV cache" in r.detail


def test_exit_status_and_report_show_a_failed_check(monkeypatch, tmp_path, capsys):
    def broken():
        raise doctor.CheckFailed("the widget is missing", ["looked in /nowhere"])

    monkeypatch.setattr(doctor, "CHECKS", [("device", lambda: "fine"), ("widget", broken)])
    report = tmp_path / "report.md"
    assert doctor.main(["--skip-serve", "--report", str(report)]) == 1
    out = capsys.readouterr().out
    assert "PASS  device" in out and "FAIL  widget    the widget is missing" in out
    text = report.read_text()
    assert "**1/2 checks passed**" in text
    assert "| widget | **FAIL** |" in text and "looked in /nowhere" in text
    assert "| vllm-metal | " in text and "| mlx | 0.32.4 |" in text

    monkeypatch.setattr(doctor, "CHECKS", [("device", lambda: "fine")])
    assert doctor.main(["--skip-serve"]) == 0


def test_serve_check_fails_with_the_server_log_when_vllm_dies(monkeypatch, tmp_path):
    # a `vllm` next to the interpreter that dies at startup, as a broken install would
    fake = tmp_path / "vllm"
    fake.write_text("#!/bin/sh\necho 'ImportError: no module named vllm_metal._core' >&2\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the kept server log
    results = doctor.serve_checks(port=free_port(), timeout=30)
    assert [r.name for r in results] == ["serve"]  # no decode timing without a server
    assert not results[0].ok and "exited with code 3" in results[0].detail
    assert any("no module named vllm_metal._core" in n for n in results[0].notes)


@pytest.mark.slow
@pytest.mark.serving
def test_full_doctor_run_passes_here(tmp_path):
    """Everything a Mac owner runs, on this machine: emulator checks, `vllm serve`, decode."""
    report = tmp_path / "doctor.md"
    run = subprocess.run(
        [sys.executable, "-m", "vllm_metal.doctor", "--report", str(report),
         "--port", str(free_port())],
        capture_output=True, text=True, cwd=tmp_path, timeout=900,
        env={k: v for k, v in os.environ.items() if k != "VLLM_METAL_KERNELS"})
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    text = report.read_text()
    assert "**6/6 checks passed**" in text
    for name in ("device", "memory", "metallib", "ops", "serve", "decode"):
        assert f"| {name} | PASS |" in text
    assert "Paris" in text and "tokens/s" in text
