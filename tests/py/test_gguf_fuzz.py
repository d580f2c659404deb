"""Fuzzing the GGUF reader: corpus replay through the binding, and a bounded
libFuzzer run (ASan + UBSan) of the MLX-free reader built with clang-19."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from vllm_metal import _core

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests/fuzz_corpus/gguf"
DIRS = [CORPUS / d for d in ("seeds", "corpus", "crashes")]


def corpus_files():
    return sorted(p for d in DIRS if d.is_dir() for p in d.iterdir() if p.is_file())


def test_corpus_replays_without_crashing():
    files = corpus_files()
    assert len(files) > 10
    parsed = 0
    for p in files:
        for strict in (True, False):
            try:
                _core.GGUFFile.parse_bytes(p.read_bytes(), require_supported_types=strict)
                parsed += 1
            except ValueError as e:
                assert str(e).startswith("[gguf]"), f"{p.name}: {e}"
    assert parsed > 0


@pytest.fixture(scope="module")
def fuzzer(tmp_path_factory):
    cxx = shutil.which("clang++-19")
    if not cxx:
        pytest.skip("clang++-19 (libFuzzer) not installed")
    exe = tmp_path_factory.mktemp("fuzz") / "gguf_reader_fuzz"
    build = subprocess.run(
        [cxx, "-std=c++17", "-g", "-O1", "-fsanitize=fuzzer,address,undefined",
         "-fno-sanitize-recover=undefined", f"-I{ROOT / 'src/cpp'}",
         str(ROOT / "tests/py/fuzz/gguf_reader_fuzz.cpp"),
         str(ROOT / "src/cpp/runtime/gguf_reader.cpp"), str(ROOT / "src/cpp/runtime/gguf_types.cpp"),
         "-o", str(exe)],
        capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    return exe


def test_corpus_replays_under_sanitizers(fuzzer):
    dirs = [str(d) for d in DIRS if d.is_dir()]
    run = subprocess.run([str(fuzzer), "-runs=0", *dirs], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]


def test_bounded_fuzz_run_finds_nothing(fuzzer, tmp_path):
    """20,000 executions (or 15 s) per run; VLLM_METAL_GGUF_FUZZ_RUNS and
    VLLM_METAL_GGUF_FUZZ_SECONDS make a longer one (docs/reliability.md)."""
    work = tmp_path / "corpus"
    work.mkdir()
    for p in corpus_files():
        shutil.copy(p, work / p.name)
    runs = int(os.environ.get("VLLM_METAL_GGUF_FUZZ_RUNS", "20000"))
    seconds = int(os.environ.get("VLLM_METAL_GGUF_FUZZ_SECONDS", "15"))
    run = subprocess.run(
        [str(fuzzer), str(work), f"-runs={runs}", f"-max_total_time={seconds}", "-max_len=4096",
         "-seed=1", f"-artifact_prefix={tmp_path}/crash-"],
        capture_output=True, text=True, timeout=seconds + 300)
    done = re.search(r"Done (\d+) runs in (\d+) second", run.stderr)
    if done:
        print(f"gguf fuzzer: {done.group(1)} executions in {done.group(2)} s")
    crashes = list(tmp_path.glob("crash-*"))
    assert run.returncode == 0 and not crashes, (
        f"the fuzzer found {crashes}: copy them to {CORPUS / 'crashes'} as regression tests\n"
        + run.stderr[-4000:])
