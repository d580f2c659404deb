"""vllm-metal: a vLLM hardware plugin for Apple Silicon.

Importing this package is cheap: vLLM imports plugins in every process and
calls ``register()`` more than once. The C++ core loads with
``vllm_metal.ops`` or ``vllm_metal._core``.
"""

from __future__ import annotations

import importlib.util
import os

from vllm_metal.log import get_logger

__version__ = "0.1.0"

logger = get_logger(__name__)

PLATFORM = "vllm_metal.platform.MetalPlatform"


def register() -> str | None:
    """vllm.platform_plugins entry point: the platform's qualified name, or
    None (with the reason logged) when the plugin should stay off."""
    from vllm_metal import envs

    if envs.VLLM_METAL_DISABLE:
        logger.info("vllm-metal is disabled by VLLM_METAL_DISABLE")
        return None
    if importlib.util.find_spec("mlx") is None:
        logger.info("vllm-metal is inactive: MLX is not installed")
        return None
    from vllm_metal import log_filters

    log_filters.install()  # before vLLM imports what logs them
    # Without Triton vLLM falls back to the V1 runner contract unless asked;
    # our runner needs no Triton, so V2 is the default (=0 still selects V1).
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    return PLATFORM


def register_general() -> None:
    """vllm.general_plugins entry point, run in every vLLM process.

    vLLM's engine calls torch.accelerator.empty_cache() between phases and
    empty_host_cache() at shutdown; with the CPU build of torch and no accelerator
    both raise, so they become no-ops. A requested shutdown logs no engine-dead
    traceback (log_filters.py). Architectures whose vLLM classes cannot be
    imported here get descriptors. In the API server, a refused LoRA adapter at
    /v1/load_lora_adapter answers 400 (lora/http_status.py), and /v1/embeddings validates
    token-id and text bodies against one request model (embedding_validation.py).
    """
    from vllm_metal import envs

    if envs.VLLM_METAL_DISABLE:
        return
    import torch

    if not torch.accelerator.is_available():
        for name in ("empty_cache", "empty_host_cache"):
            if not getattr(getattr(torch.accelerator, name, None), "_vllm_metal_noop", False):
                setattr(torch.accelerator, name, _noop())  # idempotent: vLLM loads plugins repeatedly
    from vllm_metal import log_filters

    log_filters.install()
    _register_architectures()
    from vllm_metal.lora import http_status

    http_status.install()  # a refused LoRA adapter: 400, not vLLM's 500
    from vllm_metal import embedding_validation

    embedding_validation.install()  # token-id batches: one request model validated, not five


def _noop():
    def noop(*args, **kwargs) -> None:
        return None

    noop._vllm_metal_noop = True
    return noop


def _register_architectures() -> None:
    # vLLM's own classes of these architectures do not import here (vllm_models.py)
    from vllm import ModelRegistry

    from vllm_metal.vllm_models import REGISTRY_OVERRIDES

    for arch, where in REGISTRY_OVERRIDES.items():
        ModelRegistry.register_model(arch, where)
