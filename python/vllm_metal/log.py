"""Loggers that print through vLLM's logging setup.

vLLM configures the "vllm" logger tree only; a logger named "vllm_metal.x" is not in it
and prints nothing at INFO. Ours live at "vllm.metal.<module>", so they carry vLLM's
format (process, level, time, file:line) and obey VLLM_LOGGING_LEVEL.
"""

from __future__ import annotations

import logging


def get_logger(module: str) -> logging.Logger:
    """The logger of `module` (pass __name__), e.g. vllm_metal.worker -> vllm.metal.worker."""
    tail = module.split(".", 1)[1] if module.startswith("vllm_metal.") else module
    return logging.getLogger(f"vllm.metal.{tail}")
