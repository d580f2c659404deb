"""gpt-oss (GptOssForCausalLM): mlx-lm's gpt_oss module with the HF checkpoint layout
read here, its MoE MLPs on ops.fused_moe (moe.GptOssMoeBlock).

transformers writes dense experts as gate_up_proj [E, H, 2I] (x @ W: gate and up
interleaved along the last axis), down_proj [E, I, H], and biases gate_up_proj_bias
[E, 2I], down_proj_bias [E, H]; mlx-lm's SwitchGLU holds [E, I, H] / [E, H, I].
MXFP4 checkpoints (*_blocks / *_scales) are refused at load, naming the tensor.
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


class Model(mlx_gpt_oss.Model):
    def sanitize(self, weights: dict) -> dict:
        out = {}
        for name, value in weights.items():
            if name.endswith(("_blocks", "_scales")):
                raise ValueError(f"[vllm-metal] gpt_oss: {name}: MXFP4 expert weights from "
                                 f"safetensors are not supported yet (dense bfloat16/float32 "
                                 f"experts are)")
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
