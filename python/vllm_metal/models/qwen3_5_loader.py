"""Loading Qwen3.5 text checkpoints (safetensors or GGUF) as PagedQwen3_5.

mlx-lm's ``qwen3_5.TextModel`` is built from the HF text config and its ``sanitize``
(HF conv1d layout, zero-centred norms stored as w - 1, MTP tensors dropped) takes the
checkpoint's weights, so a checkpoint loads exactly as mlx-lm loads it. MoE checkpoints
(Qwen3.5-MoE) have their expert tensors stacked into mlx-lm's SwitchGLU layout first. GGUF files go
through gguf_loader, which names their tensors as an HF checkpoint would.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from vllm_metal.models.qwen3_5_paged import PagedQwen3_5, StateShapes, layer_is_linear
from vllm_metal.models.stage_loading import evaluate_parameters

HF_ARCHITECTURE = "Qwen3_5ForCausalLM"
HF_MOE_ARCHITECTURE = "Qwen3_5MoeForCausalLM"


@dataclass
class HybridSpec:
    """What the runner needs besides the attention KV cache."""

    attention_layers: list[int]   # model layer indices with full attention (paged KV cache)
    linear_layers: list[int]      # model layer indices with gated delta net (state slots)
    state_shapes: StateShapes
    conv_dtype: str               # conv state dtype (the model's); the ssm state is float32
    # the global index of the model's layer 0: a pipeline stage's first layer (the lists
    # above keep global indices: vLLM's layer names)
    first_layer: int = 0


def text_config(config: dict) -> dict:
    """The text part of a Qwen3.5 config (a VL config nests it under text_config)."""
    if "text_config" in config:
        out = dict(config["text_config"])
        out.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
        return out
    return config


_VISION_PREFIXES = ("model.visual.", "visual.", "vision_tower.", "model.vision_tower.")
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))


def text_weight_name(name: str) -> str | None:
    """A (vision + language) checkpoint's tensor name as the text model's; None for the
    vision tower's tensors (served text-only)."""
    if name.startswith(_VISION_PREFIXES):
        return None
    for old, new in _TEXT_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp)\.experts\."
                      r"(?:(\d+)\.(gate_proj|up_proj|down_proj)\.weight|(gate_up_proj|down_proj))$")


def stack_experts(weights: dict, num_experts: int) -> dict:
    """MoE expert tensors as mlx-lm's SwitchGLU holds them (switch_mlp.{gate,up,down}_proj
    [E, out, in]), from either HF layout: fused (experts.gate_up_proj [E, 2I, H] and
    experts.down_proj [E, H, I], the published Qwen3.5-MoE checkpoints) or one tensor per
    expert (experts.{e}.gate_proj.weight ...). A layer missing an expert is refused."""
    out, per_expert = {}, {}
    for name, value in weights.items():
        m = _EXPERTS.match(name)
        if m is None:
            out[name] = value
            continue
        prefix, expert, proj, fused = m.groups()
        if fused == "gate_up_proj":
            if value.ndim != 3 or value.shape[1] % 2:
                raise ValueError(f"[vllm-metal] {name}: expected [experts, 2 * inter, hidden], "
                                 f"got {tuple(value.shape)}")
            half = value.shape[1] // 2
            out[f"{prefix}.switch_mlp.gate_proj.weight"] = value[:, :half]
            out[f"{prefix}.switch_mlp.up_proj.weight"] = value[:, half:]
        elif fused == "down_proj":
            out[f"{prefix}.switch_mlp.down_proj.weight"] = value
        else:
            per_expert.setdefault((prefix, proj), {})[int(expert)] = value
    for (prefix, proj), experts in per_expert.items():
        if sorted(experts) != list(range(num_experts)):
            raise ValueError(f"[vllm-metal] {prefix}.experts.*.{proj}.weight: expected experts "
                             f"0..{num_experts - 1}, found {len(experts)}")
        out[f"{prefix}.switch_mlp.{proj}.weight"] = mx.stack([experts[e] for e in range(num_experts)])
    return out


def model_classes():
    from mlx_lm.models import qwen3_5

    class TextModel(qwen3_5.TextModel):
        def sanitize(self, weights):
            renamed = {text_weight_name(k): v for k, v in weights.items()}
            renamed = {k: v for k, v in renamed.items() if k is not None}
            if self.args.num_experts:
                renamed = stack_experts(renamed, self.args.num_experts)
            return super().sanitize(renamed)

    return TextModel, qwen3_5.TextModelArgs


def load_safetensors(path: Path, dtype: str | None, linear: str, expert_offload=None):
    from mlx_lm.utils import load_config, load_model as mlx_lm_load_model

    from vllm_metal.models import expert_offload as offload, loader

    hf_config = json.loads((path / "config.json").read_text())
    config = text_config(load_config(path))
    if expert_offload is not None:
        offload.check_safetensors_layout(path, hf_config)
    lm, _ = mlx_lm_load_model(path, lazy=True, model_config=config,
                              get_model_classes=lambda config: model_classes())
    stored = loader._stored_dtype(lm)
    target = loader._dtype(dtype) if dtype else stored
    cache = None
    if expert_offload is not None:  # before anything reads them: the experts stay on disk
        cache = offload.install(lm, expert_offload, directory=path, dtype=target)
    loaded = finish(lm, config, hf_config, target, loader._eos_ids(config.get("eos_token_id")),
                    linear)
    loaded.expert_cache = cache
    return loaded


def load_gguf(gguf_path: Path, hf_config: dict, dtype: str | None, linear: str,
              expert_offload=None):
    from vllm_metal.models import expert_offload as offload, gguf_loader, gguf_qwen35, loader
    from vllm_metal.models.gguf_linear import install_block_weights
    from vllm_metal.models.moe import install_expert_blocks

    ckpt = gguf_loader.GGUFCheckpoint(str(gguf_path))
    config = text_config(hf_config)
    target = loader._dtype(dtype or gguf_loader.native_dtype(ckpt))
    model_class, args_class = model_classes()
    lm = model_class(args_class.from_dict(config))
    cache = None
    if expert_offload is not None:  # the expert tensors are never read at load
        cache = offload.install(lm, expert_offload, ckpt=ckpt)
        ckpt = offload.hide_gguf_experts(ckpt)
    # already in mlx-lm's sanitized form (gguf_qwen35.py); sanitize would re-centre norms
    weights = gguf_qwen35.load_weights(ckpt, config, target, blocks=linear == "gguf")
    weights = install_expert_blocks(lm, weights)  # qwen35moe: ffn_*_exps in block form
    weights = install_block_weights(lm, weights)
    lm.load_weights(list(weights.items()), strict=True)
    lm.eval()
    loaded = finish(lm, config, hf_config, target, gguf_loader.eos_token_ids(ckpt), linear)
    loaded.expert_cache = cache
    return loaded


def finish(lm, config: dict, hf_config: dict, dtype: mx.Dtype, eos_ids: list[int], linear: str):
    from vllm_metal.models import LoadedModel, ModelSpec, loader
    from vllm_metal.models.gguf_linear import GGUFEmbedding
    from vllm_metal.models.linear_choice import choose_dense_layers

    choose_dense_layers(lm, linear)
    model = PagedQwen3_5(lm, config)
    # A_log stays float32 as mlx-lm keeps it (cast_predicate): the decay is exp(A_log).
    a_logs = [(layer.linear_attn, layer.linear_attn.A_log.astype(mx.float32))
              for layer in model.layers if layer.is_linear]
    model.set_dtype(dtype)
    for gdn, a_log in a_logs:
        gdn.A_log = a_log
    for _, m in model.named_modules():
        if isinstance(m, GGUFEmbedding):
            m.out_dtype = dtype if m.is_blocks else m.weight.dtype
    model.eval()
    evaluate_parameters(model)  # a pipeline stage's layers only (stage_loading.py)

    is_linear = layer_is_linear(config)
    attention = [i for i, lin in enumerate(is_linear) if not lin]
    first = model.layers[attention[0]].self_attn
    spec = ModelSpec(
        num_layers=len(model.layers),
        num_kv_heads=first.num_kv_heads,
        head_dim=first.head_dim,
        dtype=loader._dtype_name(dtype),
        sliding_window_per_layer=[0] * len(model.layers),
        vocab_size=int(config["vocab_size"]),
        architecture=HF_MOE_ARCHITECTURE if config.get("num_experts") else HF_ARCHITECTURE,
    )
    hybrid = HybridSpec(attention_layers=attention,
                        linear_layers=[i for i, lin in enumerate(is_linear) if lin],
                        state_shapes=model.state_shapes, conv_dtype=loader._dtype_name(dtype))
    return LoadedModel(model=model, spec=spec, hf_config=hf_config, eos_token_ids=eos_ids,
                       hybrid=hybrid)
