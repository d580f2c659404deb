"""A clean `vllm serve` stop: no "engine dead" traceback after a requested shutdown.

vLLM 0.33's AsyncLLM.shutdown stops the engine process first and cancels its output
handler after; when the handler wakes in between, it finds the engine gone and logs
"AsyncLLM output_handler failed." with an EngineDeadError traceback, although nothing
failed. This filter drops exactly that record once the API server has logged that it is
shutting down; an engine that dies while serving is still reported in full.
"""

from __future__ import annotations

import logging

# Where vLLM logs the two events (its module loggers).
_LAUNCHER_LOGGER = "vllm.entrypoints.launchers.launcher"
_ASYNC_LLM_LOGGER = "vllm.v1.engine.async_llm"


class _ShutdownState(logging.Filter):
    """Notes the API server's "[shutdown]" record; passes every record."""

    def __init__(self) -> None:
        super().__init__()
        self.stopping = False

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("[shutdown]"):
            self.stopping = True
        return True


class _DropEngineDeadWhileStopping(logging.Filter):
    def __init__(self, state: _ShutdownState) -> None:
        super().__init__()
        self.state = state

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.state.stopping or not record.exc_info:
            return True
        from vllm.v1.engine.exceptions import EngineDeadError

        return not isinstance(record.exc_info[1], EngineDeadError)


def install() -> None:
    """Idempotent (vLLM loads plugins more than once per process)."""
    launcher = logging.getLogger(_LAUNCHER_LOGGER)
    if any(isinstance(f, _ShutdownState) for f in launcher.filters):
        return
    state = _ShutdownState()
    launcher.addFilter(state)
    logging.getLogger(_ASYNC_LLM_LOGGER).addFilter(_DropEngineDeadWhileStopping(state))
