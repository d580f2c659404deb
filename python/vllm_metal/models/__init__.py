"""Models: mlx-lm architectures running over vLLM's paged KV cache.

    loaded = load_model(path, dtype=None)
    logits = loaded.model(input_ids, ctx)   # input_ids int32 [T], ctx: AttentionContext

`path` is a local directory (config.json + safetensors, or one made by
prepare_gguf_dir) or a .gguf file. Importing this package is cheap: MLX,
mlx-lm and transformers load on first use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mlx.nn as nn

__all__ = ["ModelSpec", "LoadedModel", "load_model", "prepare_gguf_dir", "AttentionContext"]


@dataclass
class ModelSpec:
    """What the KV cache needs."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str                            # cache (= model) dtype: "float32" | "float16" | "bfloat16"
    sliding_window_per_layer: list[int]   # tokens; 0 = full attention for that layer
    vocab_size: int
    architecture: str                     # HF architecture, e.g. "LlamaForCausalLM"


@dataclass
class LoadedModel:
    # forward: model(input_ids int32 [T], ctx: AttentionContext) ->
    #   logits [len(ctx.logits_indices), vocab] in the model dtype
    model: "nn.Module"
    spec: ModelSpec
    hf_config: dict[str, Any]   # the config.json content (made from the metadata for a .gguf)
    eos_token_ids: list[int]
    # hybrid models (Qwen3.5): attention vs linear-attention layers and the per-request
    # state they keep (models/qwen3_5_loader.HybridSpec); None for attention-only models
    hybrid: Any = None
    # --additional-config moe_expert_offload: the experts' cache (models/expert_cache.py)
    expert_cache: Any = None


def load_model(model_path: str, dtype: str | None = None, *, linear: str = "gguf",
               int8_activations: bool | None = None, expert_offload=None) -> LoadedModel:
    """Load a local checkpoint; dtype "float16" | "bfloat16" | "float32" | None
    (None: the dtype the weights are stored in; never upcast to float32).

    linear "gguf": linear layers and lm_head on ops.gguf_matmul, GGUF weights
    kept in block form; "mlx": the reference path (GGUF weights dequantized at
    load, MLX matmul). int8_activations: on the CPU, round activations to 8-bit
    blocks for the integer-capable GGUF types (llama.cpp's scheme, faster);
    None reads VLLM_METAL_INT8_ACTIVATIONS (default off: float32 sums).
    expert_offload: an expert_offload.OffloadConfig: MoE experts stay on disk and
    stream through a bounded cache."""
    from vllm_metal import envs
    from vllm_metal.models.gguf_linear import set_exact_activations
    from vllm_metal.models.loader import load

    loaded = load(model_path, dtype, linear=linear, expert_offload=expert_offload)
    if int8_activations is None:
        int8_activations = envs.VLLM_METAL_INT8_ACTIVATIONS
    set_exact_activations(loaded.model, not int8_activations)
    return loaded


def prepare_gguf_dir(gguf_path: str, out_dir: str | None = None) -> str:
    """A directory vLLM's front end can read for a GGUF file (config.json,
    tokenizer files, generation_config.json, model.gguf -> the file); cached."""
    from vllm_metal.models.gguf_dir import prepare_gguf_dir as prepare

    return prepare(gguf_path, out_dir)


def __getattr__(name: str):
    if name == "AttentionContext":
        from vllm_metal.models.context import AttentionContext

        return AttentionContext
    raise AttributeError(name)
