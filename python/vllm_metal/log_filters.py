"""Filters for four vLLM / torch log records that report, as failures, what this
platform leaves out on purpose or what a requested shutdown does. Each drops exactly
its record, under the condition that makes it noise; everything else passes.

1. torch warns once per process that it found no Triton kernels when vLLM registers its
   Triton ops at import: there is no Triton on macOS, and none is installed on Linux.
2. vLLM's wheel vendors `triton_kernels`; without Triton its import fails and vLLM logs
   "Failed to import Triton kernels" at ERROR (in `vllm bench serve`, for example).
3. vLLM 0.33's AsyncLLM.shutdown stops the engine process before it cancels the output
   handler; when the handler wakes in between it logs "AsyncLLM output_handler failed."
   with an EngineDeadError traceback, although nothing failed. Dropped only after the
   API server has logged (at INFO, vLLM's default level) that it is shutting down: an
   engine that dies while serving is still reported in full.
4. vLLM warns that a custom scheduler class may have "async scheduling disabled" and
   "degraded performance". The platform's own classes (vllm_metal.scheduler) subclass
   vLLM's Scheduler and AsyncScheduler, so for them neither is true; a user's class
   is still warned about.
"""

from __future__ import annotations

import importlib.util
import logging

_TORCH_TRITON_LOGGER = "torch._library.triton"
_TRITON_KERNELS_LOGGER = "vllm.model_executor.layers.fused_moe.config"
_LAUNCHER_LOGGER = "vllm.entrypoints.launchers.launcher"
_ASYNC_LLM_LOGGER = "vllm.v1.engine.async_llm"
_SCHEDULER_CONFIG_LOGGER = "vllm.config.scheduler"


class _NoTritonKernels(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Failed to import Triton kernels")


class _OurSchedulerIsNotCustom(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (str(record.msg).startswith("Using custom scheduler class")
                    and str(record.args and record.args[0]).startswith("vllm_metal.scheduler."))


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
    if importlib.util.find_spec("triton") is None:
        logging.getLogger(_TORCH_TRITON_LOGGER).setLevel(logging.ERROR)
        logging.getLogger(_TRITON_KERNELS_LOGGER).addFilter(_NoTritonKernels())
    state = _ShutdownState()
    launcher.addFilter(state)
    logging.getLogger(_ASYNC_LLM_LOGGER).addFilter(_DropEngineDeadWhileStopping(state))
    logging.getLogger(_SCHEDULER_CONFIG_LOGGER).addFilter(_OurSchedulerIsNotCustom())
