"""Architectures as vLLM's model registry sees them, for models whose vLLM (torch)
implementation cannot even be imported here.

vLLM inspects a model class before it starts a worker (is it hybrid? does it generate
text?). Its Qwen3.5 module imports torchvision, which a CPU-only install lacks, so the
inspection fails and `vllm serve` refuses the model. Our runner never builds vLLM's
torch models (it runs MLX, models/qwen3_5_paged.py): these classes only answer the
registry's questions and are registered through the documented hook
(ModelRegistry.register_model, from the general plugin).
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch


class _DescribedOnly(torch.nn.Module):
    """What vLLM's registry inspects of a model class; never built (our runner runs MLX)."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        raise RuntimeError(f"[vllm-metal] {type(self).__name__} is run by the vllm-metal runner "
                           "on MLX; this class only describes it to vLLM's registry")

    def forward(self, input_ids, positions, **kwargs):
        raise NotImplementedError

    def embed_input_ids(self, input_ids):
        raise NotImplementedError

    def compute_logits(self, hidden_states):
        raise NotImplementedError


class Qwen3_5ForCausalLM(_DescribedOnly):
    """Qwen3.5 text: hybrid (gated delta net + full attention), per-request state."""

    is_hybrid: ClassVar[Literal[True]] = True
    has_inner_state: ClassVar[Literal[True]] = True
    # --enable-lora: our runner applies the adapters (vllm_metal/lora); vLLM only asks
    supports_lora: ClassVar[Literal[True]] = True
    packed_modules_mapping: ClassVar[dict] = {}
    embedding_modules: ClassVar[dict] = {}
    # --pipeline-parallel-size: our runner splits the layers (models/pipeline_parallel.py);
    # vLLM's config check asks for SupportsPP's attributes and forward argument
    supports_pp: ClassVar[Literal[True]] = True

    def make_empty_intermediate_tensors(self, batch_size, dtype, device):
        raise NotImplementedError

    def forward(self, input_ids, positions, intermediate_tensors=None, **kwargs):
        raise NotImplementedError

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config):
        from vllm_metal.models.qwen3_5_paged import state_shapes_of

        shapes = state_shapes_of(vllm_config.model_config.hf_text_config.to_dict(),
                                 vllm_config.parallel_config.tensor_parallel_size)
        return shapes.conv, shapes.ssm

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config):
        return vllm_config.model_config.dtype, torch.float32


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """The published Qwen3.5 checkpoints (vision + language): served text-only. Declaring no
    multimodal support makes vLLM build no image processor and accept text prompts only;
    the loader skips the vision tower's weights."""


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE text: the same hybrid layers with MoE MLPs (models/moe.py)."""


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForConditionalGeneration):
    """The published Qwen3.5-MoE checkpoints (vision + language): served text-only."""


class Qwen3_5MTP(_DescribedOnly):
    """The MTP block of a Qwen3.5 checkpoint as vLLM's speculative config names it
    (method "mtp"): one attention layer, no recurrent state (our runner: mtp.py)."""


class Qwen3_5MoeMTP(Qwen3_5MTP):
    """Qwen3.5-MoE's MTP block (its MLP an MoE block: mtp.py)."""


# architecture -> "module:class", registered by vllm_metal.register_general
REGISTRY_OVERRIDES = {
    name: f"vllm_metal.vllm_models:{name}"
    for name in ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration",
                 "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration",
                 "Qwen3_5MTP", "Qwen3_5MoeMTP")
}
