"""The architectures we serve: which mlx-lm module builds each, and how its
HF config is read (rope parameters, per-layer sliding windows, block style).

mlx-lm (pinned 0.32.2) supplies the Model classes and the parameter names; we
keep both and swap only attention and normalization (see paged_model.py).
"""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    model_type: str       # HF config model_type
    mlx_lm_module: str    # mlx_lm.models.<name>
    hf_architecture: str  # config "architectures"[0]
    block_style: str      # "pre_norm" (llama family) | "sandwich" (gemma3: 4 norms a block)


ARCHITECTURES: dict[str, Architecture] = {
    a.model_type: a
    for a in [
        Architecture("llama", "llama", "LlamaForCausalLM", "pre_norm"),
        # mlx-lm maps mistral to its llama module (MODEL_REMAPPING); ministral too.
        Architecture("mistral", "llama", "MistralForCausalLM", "pre_norm"),
        Architecture("ministral", "llama", "MinistralForCausalLM", "pre_norm"),
        Architecture("ministral3", "ministral3", "Ministral3ForCausalLM", "pre_norm"),
        Architecture("qwen2", "qwen2", "Qwen2ForCausalLM", "pre_norm"),
        Architecture("qwen3", "qwen3", "Qwen3ForCausalLM", "pre_norm"),
        # sparse MoE MLPs on ops.fused_moe (models/moe.py)
        Architecture("qwen3_moe", "qwen3_moe", "Qwen3MoeForCausalLM", "pre_norm"),
        # q/k RMSNorm over the whole projection; softmax router, norm_topk_prob as configured
        Architecture("olmoe", "olmoe", "OlmoeForCausalLM", "pre_norm"),
        # attention sinks, sliding/full layers, YaRN, biases; MoE with router bias, top-k
        # softmax, expert biases, clamped SwiGLU (models/gpt_oss.py reads the HF layout)
        Architecture("gpt_oss", "gpt_oss", "GptOssForCausalLM", "pre_norm"),
        Architecture("gemma3_text", "gemma3_text", "Gemma3ForCausalLM", "sandwich"),
    ]
}


def architecture_of(config: dict) -> Architecture:
    model_type = config.get("model_type")
    arch = ARCHITECTURES.get(model_type)
    if arch is None:
        raise ValueError(
            f"[vllm-metal] model_type {model_type!r} is not supported "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return arch


def mlx_lm_classes(arch: Architecture):
    """(Model, ModelArgs) of the architecture's mlx-lm module."""
    if arch.model_type == "gpt_oss":  # mlx-lm's, reading transformers' expert layout
        module = importlib.import_module("vllm_metal.models.gpt_oss")
        return module.Model, module.ModelArgs
    module = importlib.import_module(f"mlx_lm.models.{arch.mlx_lm_module}")
    return module.Model, module.ModelArgs


def mlx_lm_config(config: dict) -> dict:
    """The config as mlx-lm's ModelArgs of this architecture want it.

    transformers >= 5 nests rope_theta / rope_scaling under rope_parameters
    (per layer type for gemma3), which most mlx-lm ModelArgs do not read.
    Sliding windows are ours to apply (layer_sliding_windows); llama's mlx-lm
    model cannot be built with no full-attention layer, so layer_types are
    dropped for the llama module.
    """
    arch = architecture_of(config)
    out = copy.deepcopy(config)
    rope_parameters = out.get("rope_parameters")
    if arch.model_type == "gemma3_text":
        if isinstance(rope_parameters, dict) and "full_attention" in rope_parameters:
            full = rope_parameters["full_attention"] or {}
            local = rope_parameters.get("sliding_attention") or {}
            if out.get("rope_theta") is None:
                out["rope_theta"] = full.get("rope_theta", 1_000_000.0)
            if out.get("rope_local_base_freq") is None:
                out["rope_local_base_freq"] = local.get("rope_theta", 10_000.0)
            if full.get("rope_type", "default") != "default":
                out["rope_scaling"] = _scaling_only(full)
        out["sliding_window_pattern"] = _gemma3_pattern(config)
    elif arch.model_type != "ministral3" and isinstance(rope_parameters, dict):
        if out.get("rope_theta") is None and "rope_theta" in rope_parameters:
            out["rope_theta"] = rope_parameters["rope_theta"]
        if out.get("rope_scaling") is None and rope_parameters.get("rope_type", "default") != "default":
            out["rope_scaling"] = _scaling_only(rope_parameters)
    if arch.mlx_lm_module == "llama":
        out["layer_types"] = None
    if arch.model_type == "gpt_oss":
        from vllm_metal.models.gpt_oss import check_config

        check_config(out)
    if arch.model_type == "qwen3_moe":
        # transformers >= 5 writes num_local_experts; mlx-lm reads num_experts
        if out.get("num_experts") is None and "num_local_experts" in out:
            out["num_experts"] = out["num_local_experts"]
        out.setdefault("mlp_only_layers", [])
        out.setdefault("decoder_sparse_step", 1)
    return out


def _scaling_only(rope_parameters: dict) -> dict:
    return {k: v for k, v in rope_parameters.items() if k != "rope_theta"}


def _gemma3_layer_is_sliding(config: dict) -> list[bool]:
    n = config["num_hidden_layers"]
    layer_types = config.get("layer_types")
    if layer_types:
        return [t == "sliding_attention" for t in layer_types]
    pattern = config.get("sliding_window_pattern") or 6
    return [(i + 1) % pattern != 0 for i in range(n)]


def _gemma3_pattern(config: dict) -> int:
    """mlx-lm's gemma3 knows sliding layers only as "every p-th layer is global"."""
    sliding = _gemma3_layer_is_sliding(config)
    n = len(sliding)
    for p in range(1, n + 2):
        if all(s == ((i + 1) % p != 0) for i, s in enumerate(sliding)):
            return p
    raise ValueError(f"[vllm-metal] gemma3 layer_types are not periodic: {config.get('layer_types')}")


def layer_sliding_windows(config: dict) -> list[int]:
    """Per layer: the attention window in tokens, 0 = full attention.

    Follows the HF semantics: layer_types when given; gemma3's period
    otherwise; Mistral's sliding_window covers every layer; Qwen2/3's only when
    use_sliding_window is set (from max_window_layers on).
    """
    arch = architecture_of(config)
    n = config["num_hidden_layers"]
    window = config.get("sliding_window") or 0
    if arch.model_type == "gemma3_text":
        return [window if s else 0 for s in _gemma3_layer_is_sliding(config)]
    layer_types = config.get("layer_types")
    if layer_types:
        return [window if t == "sliding_attention" else 0 for t in layer_types]
    if arch.model_type == "mistral" and window:
        return [window] * n
    if arch.model_type in ("qwen2", "qwen3", "qwen3_moe") and config.get("use_sliding_window") and window:
        first = config.get("max_window_layers", 0)
        return [window if i >= first else 0 for i in range(n)]
    return [0] * n
