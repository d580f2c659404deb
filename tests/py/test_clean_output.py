"""What a newcomer reads: the demo's output and the setup summary hold no false alarm.

The main job (python -m vllm_metal.demo, what ./scripts/demo runs) must answer, print the
plugin's configuration block, and print no ERROR line, no traceback and no leak report when
nothing failed. The filters and the pip-check summary behind that are tested on their own.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from serving_harness import free_port

ROOT = Path(__file__).resolve().parents[2]
ALARM = re.compile(r"\bERROR\b|Traceback|leaked|Failed to import")


@pytest.mark.slow
@pytest.mark.serving
def test_demo_answers_and_prints_no_false_alarm():
    r = subprocess.run([sys.executable, "-m", "vllm_metal.demo", "--port", str(free_port())],
                       capture_output=True, text=True, timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "Paris" in out
    alarms = [line for line in out.splitlines() if ALARM.search(line)]
    assert not alarms, "\n".join(alarms[:20])
    block = out[out.index("vllm-metal configuration:"):]
    for row in ("device", "kernels", "KV cache", "fused layers", "GGUF activations", "scheduling"):
        assert re.search(rf"\]\s+{row}\s", block), row
    assert re.search(r"\]\s+KV blocks\s+C\+\+ KvCacheManager behind vLLM's scheduler", block), block[:2000]


def _load_pip_check_summary():
    sys.path.insert(0, str(ROOT / "tools" / "setup"))
    try:
        import pip_check_summary
    finally:
        sys.path.pop(0)
    return pip_check_summary


def test_pip_check_summary_names_expected_and_keeps_the_rest():
    m = _load_pip_check_summary()
    expected = m.expected_names(ROOT / "requirements" / "vllm-gpu-only.txt")
    report = "\n".join([
        "vllm 0.33.0 requires flashinfer-python, which is not installed.",
        "vllm 0.33.0 requires flashinfer_python, which is not installed.",  # same package
        "xgrammar 0.2.8 requires triton, which is not installed.",
        "vllm 0.33.0 has requirement torch==2.14.0, but you have torch 2.13.0+cpu.",
        "vllm 0.33.0 requires regex, which is not installed.",  # a real problem
        "vllm 0.33.0 has requirement openai>=2.25.0, but you have openai 1.0.0.",
    ])
    missing, versions, other = m.classify(report, expected)
    assert missing == ["flashinfer-python", "triton"]
    assert versions == ["torch 2.13.0+cpu (asked: ==2.14.0)"]
    assert other == ["vllm 0.33.0 requires regex, which is not installed.",
                     "vllm 0.33.0 has requirement openai>=2.25.0, but you have openai 1.0.0."]


def test_engine_dead_traceback_is_dropped_only_after_a_requested_shutdown():
    from vllm.v1.engine.exceptions import EngineDeadError

    from vllm_metal import log_filters

    log_filters.install()
    async_llm = logging.getLogger("vllm.v1.engine.async_llm")
    launcher = logging.getLogger("vllm.entrypoints.launchers.launcher")
    seen = []

    class Collect(logging.Handler):
        def emit(self, record):
            seen.append(record)

    handler = Collect()
    async_llm.addHandler(handler)
    level = launcher.level
    launcher.setLevel(logging.INFO)  # as vLLM's logging config sets it
    state = next(f for f in launcher.filters if isinstance(f, log_filters._ShutdownState))
    try:
        state.stopping = False

        def fail(exc):
            try:
                raise exc
            except Exception:
                async_llm.exception("AsyncLLM output_handler failed.")

        fail(EngineDeadError())  # the engine died while serving: reported
        assert len(seen) == 1
        launcher.info("[shutdown] API server: shutdown triggered")
        fail(EngineDeadError())  # the requested stop: dropped
        assert len(seen) == 1
        fail(RuntimeError("a real failure during shutdown"))  # still reported
        assert len(seen) == 2
    finally:
        async_llm.removeHandler(handler)
        launcher.setLevel(level)
        state.stopping = False
