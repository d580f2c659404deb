"""The Apple-only host code (src/cpp/metal/) checked on Linux.

tools/apple_check/check_host_code.py compiles it with clang against the
mlx-metal wheel's metal-cpp and MLX Metal headers (plus stub Apple system
headers), checks that every MLX symbol it needs is exported by the wheel's
libmlx.dylib, and runs it against a recording fake of MLX's Metal device.
The broken-copy tests prove that each of the three checks can fail.
"""

import subprocess
import sys
from pathlib import Path

import pytest

# About 30 s of CPU (clang over metal-cpp and MLX headers, a dozen times):
# 15-30 s on a 2-core machine, more under load.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "tools" / "apple_check" / "check_host_code.py"
ENCODER = ROOT / "src" / "cpp" / "metal" / "encoder.cpp"
EXIT_FAILED, EXIT_OFFLINE = 1, 3


def run_check(*args):
    return subprocess.run([sys.executable, str(CHECK), *map(str, args)],
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def wheel():
    """The unpacked mlx-metal wheel (downloaded once into ~/.cache/vllm_metal)."""
    proc = run_check("--fetch-only")
    if proc.returncode == EXIT_OFFLINE:
        reason = "mlx-metal wheel not downloadable, network unreachable:\n" + proc.stderr[-2000:]
        print(reason)
        pytest.skip(reason)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def broken_copy(tmp_path, old, new):
    text = ENCODER.read_text()
    assert old in text, f"{old!r} no longer in encoder.cpp; update this test"
    path = tmp_path / "encoder.cpp"
    path.write_text(text.replace(old, new, 1))
    return path


def test_encoder_passes_compile_symbol_and_behaviour_checks(wheel):
    proc = run_check("--wheel", wheel)
    assert proc.returncode == 0, proc.stderr
    assert "OK (compile + libmlx.dylib symbols + behaviour" in proc.stdout
    assert "src/cpp/metal/encoder.cpp" in proc.stdout


def test_wrong_method_name_is_caught(wheel, tmp_path):
    src = broken_copy(tmp_path, "enc.set_input_array(", "enc.set_input_arrays(")
    proc = run_check("--wheel", wheel, "--source", src, "--no-symbols", "--no-behaviour")
    assert proc.returncode == EXIT_FAILED, proc.stdout + proc.stderr
    assert "no member named 'set_input_arrays'" in proc.stderr


def test_wrong_argument_type_is_caught(wheel, tmp_path):
    # MTLFCList entries are (const void*, MTL::DataType, NS::UInteger).
    src = broken_copy(tmp_path, "metal_type(c.type), ", "int(c.type), ")
    proc = run_check("--wheel", wheel, "--source", src, "--no-symbols", "--no-behaviour")
    assert proc.returncode == EXIT_FAILED, proc.stdout + proc.stderr
    assert "error:" in proc.stderr and "MTL::DataType" in proc.stderr


def test_call_to_unexported_mlx_function_is_caught(wheel, tmp_path):
    # Declared in device.h without MLX_API: compiles, but would not link on macOS.
    src = broken_copy(
        tmp_path, "auto& enc = mx::metal::get_command_encoder(stream);",
        "auto& enc = mx::metal::get_command_encoder(stream);\n"
        "  (void)mx::metal::get_command_encoders();")
    proc = run_check("--wheel", wheel, "--source", src, "--no-behaviour")
    assert proc.returncode == EXIT_FAILED, proc.stdout + proc.stderr
    assert "libmlx.dylib does not export" in proc.stderr  # compiled; failed the symbol check
    assert "mlx::core::metal::get_command_encoders()" in proc.stderr


def test_binding_bug_is_caught_by_behaviour_check(wheel, tmp_path):
    # The binding's byte offset dropped for inputs: type-checks and links fine,
    # only running the encoder shows it.
    src = broken_copy(tmp_path,
                      "enc.set_input_array(inputs[b.array_slot], b.index, b.byte_offset);",
                      "enc.set_input_array(inputs[b.array_slot], b.index);")
    proc = run_check("--wheel", wheel, "--source", src, "--no-symbols")
    assert proc.returncode == EXIT_FAILED, proc.stdout + proc.stderr
    assert "behaviour check" in proc.stderr and "clang++" not in proc.stderr
    got = proc.stderr.split("got:", 1)[-1]
    assert "set_input_array slot=1 idx=1 offset=0" in got
