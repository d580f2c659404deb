"""Loading only the layers a pipeline stage keeps.

A loader builds the whole model lazily (mlx-lm's lazy safetensors load; GGUF tensors as
views of the memory-mapped file, dequantized lazily) and then evaluates its parameters
once. Inside `only_layers(kept)` that evaluation skips the decoder layers outside `kept`:
their arrays stay unevaluated graph nodes, never read from disk, and are freed when the
stage drops those layers (pipeline_parallel.keep_stage). A GGUF tensor is copied out of
the mapping when it is wrapped (MLX's CPU allocator cannot wrap foreign memory), so the
GGUF loader asks `outside_stage` first and puts a lazy placeholder in its place. So a stage's peak memory at load
is its own layers plus the embeddings, final norm and lm_head, not the whole model: what
lets a model that does not fit one Mac load across several.
"""

from __future__ import annotations

import contextlib
import contextvars
import re

import mlx.core as mx
from mlx.utils import tree_flatten

_KEPT: contextvars.ContextVar[range | None] = contextvars.ContextVar("vllm_metal_kept_layers",
                                                                      default=None)
_LAYER = re.compile(r"(?:^|\.)(?:layers|blk)\.(\d+)\.")  # mlx-lm's and GGUF's layer names


@contextlib.contextmanager
def only_layers(kept: range):
    token = _KEPT.set(kept)
    try:
        yield
    finally:
        _KEPT.reset(token)


def evaluate_parameters(model) -> None:
    """mx.eval of a freshly built model's parameters: all of them, or inside only_layers
    those of the kept decoder layers and everything outside the layers."""
    mx.eval([v for k, v in tree_flatten(model.parameters()) if not outside_stage(k)])


def outside_stage(name: str) -> bool:
    """Whether the tensor or parameter `name` belongs to a decoder layer that only_layers
    leaves out (never outside only_layers)."""
    kept = _KEPT.get()
    m = _LAYER.search(name) if kept is not None else None
    return m is not None and int(m.group(1)) not in kept
