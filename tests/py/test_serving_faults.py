"""Faults: an exception inside a forward (VLLM_METAL_TEST_FAIL_FORWARD_AT_STEP), and the
startup errors of a corrupt or truncated GGUF, an unreadable model directory and a cache
directory that cannot be written (docs/reliability.md). SIGTERM under load is in
test_serving_reliability.py, on that module's server."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from serving_harness import Server

pytestmark = [pytest.mark.slow, pytest.mark.serving]

VLLM = str(Path(sys.executable).with_name("vllm"))
ARGS = ["--max-model-len", "256", "--max-num-seqs", "8", "--num-gpu-blocks-override", "64",
        "--max-num-batched-tokens", "256"]


def smollm2_gguf() -> Path:
    from vllm_metal.models.offline import OFFLINE_GGUF

    return Path(OFFLINE_GGUF["smollm2"]())


def test_a_fault_in_the_forward_fails_in_flight_requests_and_the_server_exits():
    """vLLM's EngineDeadError path: the engine core dies on the exception, every in-flight
    request gets an error, the API server shuts down (no hang) and leaves no process."""
    s = Server(str(smollm2_gguf()), "smollm2", ARGS, env={"VLLM_METAL_TEST_FAIL_FORWARD_AT_STEP": "5"})
    try:
        children = psutil.Process(s.proc.pid).children(recursive=True)
        results = []

        def one(i, stream):
            body = {"model": "smollm2", "prompt": f"Count to {i}:", "max_tokens": 60, "ignore_eos": True,
                    "stream": stream}
            try:
                with httpx.stream("POST", f"{s.base}/v1/completions", json=body, timeout=120) as r:
                    text = "".join(r.iter_lines())
                results.append((r.status_code, text))
            except httpx.HTTPError as e:
                results.append(("closed", repr(e)))

        threads = [threading.Thread(target=one, args=(i, i % 2 == 1)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        s.proc.wait(timeout=60)  # exits by itself
        log = Path(s.log_path).read_text()
        assert "injected fault in the forward of step 5" in log
        for status, text in results:
            # non-streamed: a 5xx with an error body; streamed: 200, then an error event
            assert status == "closed" or "error" in text.lower(), (status, text[:300])
            assert status in ("closed", 200) or status >= 500, (status, text[:300])
            assert "completion_tokens\":60" not in text
        assert any(status != "closed" for status, _ in results), results  # someone was told
        assert not psutil.wait_procs(children, timeout=10)[1], "engine process left behind"
    finally:
        s.stop()


def serve_fails(model: str, env: dict | None = None, preexec=None, timeout: float = 240) -> str:
    """`vllm serve model` must exit non-zero by itself; returns its output."""
    r = subprocess.run([VLLM, "serve", model, "--port", "0", *ARGS], capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, **(env or {})}, preexec_fn=preexec)
    assert r.returncode != 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r.stdout + r.stderr


def test_a_truncated_gguf_is_a_clear_startup_error(tmp_path):
    data = smollm2_gguf().read_bytes()
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(data[: len(data) // 3])
    out = serve_fails(str(bad), env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert "[gguf]" in out and "truncated.gguf" in out, out[-3000:]


def test_a_corrupt_gguf_is_a_clear_startup_error(tmp_path):
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 4096)
    out = serve_fails(str(bad), env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert "[gguf]" in out, out[-3000:]


def test_an_unreadable_model_directory_is_a_clear_startup_error(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{ not json")
    out = serve_fails(str(model))
    assert "config.json" in out, out[-3000:]


def test_a_cache_directory_that_cannot_be_written_is_a_clear_startup_error(tmp_path):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache directory should be")
    out = serve_fails(str(smollm2_gguf()), env={"XDG_CACHE_HOME": str(blocker)})
    assert "cache" in out.lower() and "Traceback" not in out[-500:], out[-3000:]


def test_a_full_disk_while_writing_the_gguf_directory_is_a_clear_startup_error(tmp_path):
    def small_files():  # a write past 64 KiB fails with EFBIG, as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    out = serve_fails(str(smollm2_gguf()), env={"XDG_CACHE_HOME": str(tmp_path / "cache")},
                      preexec=small_files)
    assert "File too large" in out or "No space" in out, out[-3000:]
