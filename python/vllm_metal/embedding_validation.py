"""/v1/embeddings bodies of token ids or text validated against one request model, not five.

vLLM 0.33.0's EmbeddingRequest (vllm/entrypoints/pooling/embed/protocol.py) is a pydantic
union of five request models in smart mode, so every body is validated against all five.
For a batch of token-id lists the two chat-input members check each element against the
chat-message TypedDicts before they fail: 3.4 ms at 32 inputs of 16 tokens, 44 ms at 256,
168 ms at 32 of 512 and 1.6 s at 256 of 512 (the completion member alone: 0.04-1.7 ms),
all of it on the API server's event loop, ahead of the engine.

A body with no "messages" that EmbeddingCompletionRequest accepts is one no other member
accepts: they need "messages", or an "input" of chat-message dicts. Smart mode then returns
that member's model, so validating it first gives what vLLM gives. Every other body (the
chat forms, and any body the completion member refuses) goes through vLLM's union
unchanged, errors included. The classify and pooling unions cost under 0.3 ms and stay.
"""

from __future__ import annotations

import sys
import typing

from vllm_metal.lora.http_status import SERVER_MODULE

# imported lazily while `vllm serve` builds its routes; its annotation fixes the route's model
_ROUTER_MODULE = "vllm.entrypoints.pooling.embed.api_router"


def completion_first(completion_model):
    """A pydantic wrap validator for vLLM's EmbeddingRequest union: the completion member
    first for bodies without "messages"; the union itself otherwise, or if that fails."""
    from pydantic import ValidationError, WrapValidator

    def validate(data, union):
        if isinstance(data, dict) and "messages" not in data:
            try:
                return completion_model.model_validate(data)
            except ValidationError:
                pass
        return union(data)

    validate._vllm_metal_completion_first = True
    return WrapValidator(validate)


def fast_embedding_request(request_type):
    """vLLM's Annotated[union, BeforeValidator(...)] with completion_first inside the
    before-validator (Annotated metadata wraps in order, the last outermost)."""
    union, *metadata = typing.get_args(request_type)
    completion = typing.get_args(union)[0]
    return typing.Annotated[(union, completion_first(completion), *metadata)]


def installed(request_type) -> bool:
    return any(getattr(getattr(m, "func", None), "_vllm_metal_completion_first", False)
               for m in getattr(request_type, "__metadata__", ()))


def install() -> bool:
    """In `vllm serve`'s API server, before its embedding route is built: EmbeddingRequest
    with completion_first (idempotent). Returns whether the route will use it."""
    if SERVER_MODULE not in sys.modules:
        return False
    from vllm.entrypoints.pooling.embed import protocol

    if installed(protocol.EmbeddingRequest):
        return True
    if _ROUTER_MODULE in sys.modules:  # the route was built with vLLM's own annotation
        return False
    completion = typing.get_args(typing.get_args(protocol.EmbeddingRequest)[0])[0]
    if completion is not protocol.EmbeddingCompletionRequest:
        return False  # another vLLM's union: leave it alone
    protocol.EmbeddingRequest = fast_embedding_request(protocol.EmbeddingRequest)
    return True
