"""gpt-oss (GptOssForCausalLM): mlx-lm's gpt_oss module with the HF checkpoint layout
read here, its MoE MLPs on ops.fused_moe (moe.GptOssMoeBlock).

transformers writes dense experts as gate_up_proj [E, H, 2I] (x @ W: gate and up
interleaved along the last axis), down_proj [E, I, H], and biases gate_up_proj_bias
[E, 2I], down_proj_bias [E, H]; mlx-lm's SwitchGLU holds [E, I, H] / [E, H, I].
MXFP4 checkpoints (the published ones: `*_blocks` uint8 [E, rows, cols / 32, 16] and
`*_scales` uint8 [E, rows, cols / 32], rows = gate/up interleaved or hidden) are repacked
at load into GGUF MXFP4 blocks (the same E8M0 exponent and E2M1 codes; transformers packs
elements 2b, 2b + 1 into byte b, ggml elements j, j + 16 into byte j) and run on
ops.fused_moe_gguf; mlx-lm sees broadcast placeholders for those weights.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import gpt_oss as mlx_gpt_oss

ModelArgs = mlx_gpt_oss.ModelArgs

# the clamped SwiGLU constants ops.fused_moe's swiglu_oai activation uses
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


def check_config(config: dict) -> None:
    """Refuses a gpt-oss config whose activation constants differ from the op's."""
    alpha = config.get("swiglu_alpha", SWIGLU_ALPHA)
    limit = config.get("swiglu_limit", SWIGLU_LIMIT)
    if abs(alpha - SWIGLU_ALPHA) > 1e-6 or abs(limit - SWIGLU_LIMIT) > 1e-6:
        raise ValueError(f"[vllm-metal] gpt_oss: swiglu_alpha {alpha} / swiglu_limit {limit} are "
                         f"not supported (ops.fused_moe uses {SWIGLU_ALPHA} / {SWIGLU_LIMIT})")


MXFP4_TYPE_ID = 39  # GGML type MXFP4: 32 weights in 17 bytes


def mxfp4_to_gguf_blocks(blocks: mx.array, scales: mx.array) -> mx.array:
    """transformers' MXFP4 (blocks [..., G, 16], scales [..., G]) -> GGUF MXFP4 rows
    uint8 [..., G * 17]."""
    lo = blocks & 0x0F
    hi = blocks >> 4
    codes = mx.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], 32)  # element order
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    out = mx.concatenate([scales[..., None], packed], axis=-1)           # [..., G, 17]
    return mx.contiguous(out.reshape(*blocks.shape[:-2], -1))


class Model(mlx_gpt_oss.Model):
    def sanitize(self, weights: dict) -> dict:
        out = {}
        pending = self.__dict__.setdefault("_mxfp4_experts", {})
        for name, value in weights.items():
            if name.endswith("_scales"):
                if name[: -len("_scales")] + "_blocks" not in weights:
                    raise ValueError(f"[vllm-metal] gpt_oss: {name} has no matching _blocks tensor")
                continue
            if name.endswith("_blocks"):
                base = name[: -len("_blocks")]
                if not base.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
                    raise ValueError(f"[vllm-metal] gpt_oss: unexpected MXFP4 tensor {name}")
                scales = weights.get(base + "_scales")
                if scales is None or tuple(scales.shape) != tuple(value.shape[:-1]) or value.shape[-1] != 16:
                    raise ValueError(f"[vllm-metal] gpt_oss: {name} {tuple(value.shape)} needs "
                                     f"{base}_scales of shape {tuple(value.shape[:-1])}")
                rows = mxfp4_to_gguf_blocks(value.astype(mx.uint8), scales.astype(mx.uint8))
                e, r, cols = value.shape[0], value.shape[1], value.shape[2] * 32
                prefix = base[: -len("gate_up_proj")] if base.endswith("gate_up_proj") else \
                    base[: -len("down_proj")]
                projs = ({"gate_proj": rows[:, 0::2], "up_proj": rows[:, 1::2]}
                         if base.endswith("gate_up_proj") else {"down_proj": rows})
                for proj, blk in projs.items():
                    shape = (e, blk.shape[1], cols)
                    pending[prefix + proj] = (mx.contiguous(blk), shape, MXFP4_TYPE_ID)
                    # what mlx-lm's strict load checks; never materialized (experts swapped)
                    out[prefix + proj + ".weight"] = mx.broadcast_to(mx.zeros((1, 1, 1)), shape)
                continue
            if name.endswith("mlp.experts.gate_up_proj"):
                base = name[: -len("gate_up_proj")]
                out[base + "gate_proj.weight"] = mx.contiguous(value[..., 0::2].swapaxes(1, 2))
                out[base + "up_proj.weight"] = mx.contiguous(value[..., 1::2].swapaxes(1, 2))
            elif name.endswith("mlp.experts.gate_up_proj_bias"):
                base = name[: -len("gate_up_proj_bias")]
                out[base + "gate_proj.bias"] = mx.contiguous(value[..., 0::2])
                out[base + "up_proj.bias"] = mx.contiguous(value[..., 1::2])
            elif name.endswith("mlp.experts.down_proj"):
                out[name + ".weight"] = mx.contiguous(value.swapaxes(1, 2))
            elif name.endswith("mlp.experts.down_proj_bias"):
                out[name[: -len("_bias")] + ".bias"] = value
            else:
                out[name] = value
        return out


def hold_expert_blocks(lm, weights: dict) -> dict:
    """GGUF: the block-form expert tensors (GGUFWeight values under mlp.experts.*.weight) kept
    aside for install_mxfp4_experts, broadcast placeholders in their place."""
    pending = lm.__dict__.setdefault("_mxfp4_experts", {})
    out = {}
    for name, value in weights.items():
        if ".mlp.experts." in name and name.endswith(".weight") and not isinstance(value, mx.array):
            if len(value.shape) != 3:
                raise ValueError(f"[vllm-metal] gpt_oss: GGUF expert tensor for {name} must be "
                                 f"[experts, rows, cols], got shape {tuple(value.shape)}")
            pending[name[: -len(".weight")]] = (value.blocks, tuple(value.shape), value.type_id)
            out[name] = mx.broadcast_to(mx.zeros((1, 1, 1)), tuple(value.shape))
        else:
            out[name] = value
    return out


def install_mxfp4_experts(lm) -> int:
    """Replace the experts whose blocks (MXFP4 from safetensors, any GGUF type from a GGUF
    file) were kept aside by GGUFSwitchGLU on those blocks (the biases stay); returns how
    many layers."""
    from vllm_metal.models.moe import GGUFExperts, GGUFSwitchGLU

    pending = lm.__dict__.pop("_mxfp4_experts", {})
    n = 0
    for i, layer in enumerate(lm.model.layers):
        prefix = f"model.layers.{i}.mlp.experts."
        found = [pending.get(prefix + p) for p in ("gate_proj", "up_proj", "down_proj")]
        if not any(found):
            continue
        if not all(found):
            raise ValueError(f"[vllm-metal] gpt_oss: {prefix}*: MXFP4 and dense expert tensors mixed")
        old = layer.mlp.experts
        experts = []
        for (blocks, shape, type_id), dense in zip(found, (old.gate_proj, old.up_proj, old.down_proj)):
            x = GGUFExperts(blocks.reshape(shape[0] * shape[1], -1), type_id, shape)
            x.bias = dense.bias
            experts.append(x)
        layer.mlp.experts = GGUFSwitchGLU(*experts)
        n += 1
    return n
