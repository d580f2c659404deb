"""A refused adapter at /v1/load_lora_adapter answers 400, not vLLM's 500.

vLLM 0.33.0's OpenAIServingModels.load_lora_adapter
(vllm/entrypoints/openai/models/serving.py) calls engine_client.add_lora and turns any
exception into a 500 "InternalServerError" carrying its text; only the text of
LoRAAdapterNotFoundError becomes a 404. The worker's exception reaches the API server
as text only (the engine core runs in another process), so no exception type of ours
can select the status. Our refusals (adapter.py, gguf_adapter.py: a bad rank, shape,
target module, config or file) all begin with REFUSED; this wraps that one method so a
500 carrying REFUSED becomes a 400 "BadRequestError" with the same message. Every other
answer is vLLM's, unchanged.
"""

from __future__ import annotations

import functools
import sys
from http import HTTPStatus

# every adapter refusal's message starts with this (adapter.where)
REFUSED = "[vllm-metal] LoRA adapter "

# `vllm serve`'s API server imports this module before it loads the general plugins;
# the engine core and worker processes never serve HTTP and skip the wrap
SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"


def install() -> bool:
    """Wraps OpenAIServingModels.load_lora_adapter in an API server process (idempotent).
    Returns whether it is wrapped."""
    if SERVER_MODULE not in sys.modules:
        return False
    from vllm.entrypoints.openai.models import serving

    cls = serving.OpenAIServingModels
    if getattr(cls.load_lora_adapter, "_vllm_metal_status", False):
        return True
    original = cls.load_lora_adapter

    @functools.wraps(original)
    async def load_lora_adapter(self, request, base_model_name=None):
        result = await original(self, request, base_model_name)
        return as_bad_request(result, serving.create_error_response)

    load_lora_adapter._vllm_metal_status = True
    cls.load_lora_adapter = load_lora_adapter
    return True


def as_bad_request(result, create_error_response):
    """`result` (a str or vLLM's ErrorResponse), a 500 refusal of ours made a 400."""
    error = getattr(result, "error", None)
    if (error is None or error.code != HTTPStatus.INTERNAL_SERVER_ERROR
            or REFUSED not in error.message):
        return result
    return create_error_response(message=error.message, err_type="BadRequestError",
                                 status_code=HTTPStatus.BAD_REQUEST)
