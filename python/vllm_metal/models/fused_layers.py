"""Llama-family, qwen3-MoE and gemma3 decoder layers run as one fused C++ op each.

`fused_layers(model)` returns, for a PagedCausalLM whose layers all qualify, one
`FusedDecoderLayer` per layer; each calls `_core.decoder_layer` with the layer's
weights collected once.
- Native CPU backend: the CPU kernels the per-op path runs, rounded at the same points.
  MLX's CPU backend pays ~10 us per graph node, and a layer is ~20 nodes of a few
  microseconds of work each at decode sizes, so this is most of a decode step's time.
- GPU (Apple) and the emulated backend: the op's Metal plan (docs/kernels.md "Metal decoder
  layer plan"): for steps of up to 8 tokens (any step in batch-invariant mode) fused kernels
  back to back, 5 dispatches a llama layer and 6 a gemma3 layer instead of ~14 plus MLX's
  elementwise ops; for longer steps (prefill) the per-op kernels (tiled mat-mul) in one plan.
A qwen3-MoE layer's sparse MLP (FusedMoeBlock: router + dense or GGUF-block experts, no
shared expert) runs inside the op as the per-op model runs it: rms_norm, the router's
gguf_matmul, fused_moe / fused_moe_gguf, the residual add (CPU kernels, or those Metal
kernels in the op's plan).
For layers it cannot express (float16 gemma's clipped residuals, position-scaled queries,
rope types our kernel lacks, MLX-quantized or biased MLPs, streamed experts, LoRA on an MoE
model) the model keeps the per-op path; `why_not_fused` says which.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from vllm_metal import _core, envs, ops
from vllm_metal.models.context import AttentionContext
from vllm_metal.models.gguf_linear import DENSE_TYPES, GGUFLinear
from vllm_metal.models.layers import PagedAttention, RMSNorm
from vllm_metal.models.moe import FusedMoeBlock, GGUFSwitchGLU
from vllm_metal.lora.layers import LoraLinear, base_of

# GGML type ids of dense weights (gguf_linear names them by string)
_DENSE_TYPE_IDS = {"F32": 0, "F16": 1, "BF16": 30}
# Metal plan: most tokens a step may have to run the fused kernels (decoder_layer.metal
# reads each weight block once per 8 rows); decoder_layer_plan.cpp decides, this mirrors it
METAL_MAX_TOKENS = 8
# the mlx-lm modules whose MLP is down(act(gate(x)) * up(x)), and act
_GATED_MLP_MODULES = {"mlx_lm.models.llama": "silu", "mlx_lm.models.qwen2": "silu",
                      "mlx_lm.models.qwen3": "silu", "mlx_lm.models.qwen3_moe": "silu",
                      "mlx_lm.models.gemma3_text": "gelu_tanh"}


class FusedDecoderLayer:
    """One layer: the residual stream x [T, hidden] in, x + attn + mlp out."""

    def __init__(self, layer: nn.Module, layer_idx: int, sandwich: bool):
        attn: PagedAttention = layer.self_attn
        mlp = layer.mlp
        spec = _core.DecoderLayerSpec()
        moe = isinstance(mlp, FusedMoeBlock)
        wrapped = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
        if not moe:
            wrapped += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        # vllm_metal.lora wraps every projection or none: a step with adapters passes
        # their slots (spec.lora), the others run the base layer as it is (MoE layers
        # never see adapters here: why_not_fused keeps LoRA on MoE models per op)
        self.loras = wrapped if all(isinstance(p, LoraLinear) for p in wrapped) else None
        projections = [base_of(p) for p in wrapped]
        q, k, v, o = projections[:4]
        spec.hidden = q.in_features
        spec.num_heads = attn.num_heads
        spec.num_kv_heads = attn.num_kv_heads
        spec.head_dim = attn.head_dim
        n1, n2 = _mlp_input_norms(layer, sandwich)
        spec.norm_eps = n1.eps
        spec.sandwich = sandwich
        spec.qkv_bias = "bias" in q
        spec.o_bias = "bias" in o
        spec.qk_norm = "q_norm" in attn
        if spec.qk_norm:
            spec.qk_norm_eps = attn.q_norm.eps
        args = [p.matmul_args() for p in projections]
        if moe:
            args += _moe_spec(spec, mlp)
        else:
            spec.intermediate = projections[4].out_features
            spec.gelu = _GATED_MLP_MODULES[type(mlp).__module__] == "gelu_tanh"
        spec.types = [_type_id(qtype) for _, qtype, _ in args]
        rope = attn.rope
        spec.rotary_dim = rope.rotary_dim
        spec.neox = rope.is_neox
        self.rope_table, spec.rope_mscale = _core.rope_turn_table(
            rope.rotary_dim, base=rope.base, scaling=rope.scaling)
        spec.scale = attn.scale
        spec.sliding_window = attn.sliding_window
        spec.softcap = attn.softcap
        self.weights = [n1.multiplier(), n2.multiplier()] + [blocks for blocks, _, _ in args]
        if sandwich:
            self.weights += [layer.post_attention_layernorm.multiplier(),
                             layer.post_feedforward_layernorm.multiplier()]
        if spec.qkv_bias:
            self.weights += [q.bias, k.bias, v.bias]
        if spec.o_bias:
            self.weights.append(o.bias)
        if spec.qk_norm:
            self.weights += [attn.q_norm.multiplier(), attn.k_norm.multiplier()]
        if moe:
            self.weights.append(mlp.gate.matmul_args()[0])  # the router
        self.spec = spec
        self.projection = q  # its `exact` flag is read each call (set_exact_activations)
        self.layer_idx = layer_idx

    def __call__(self, x: mx.array, ctx: AttentionContext) -> mx.array:
        """The layer's caches in ctx.kv_caches are written in place (the op's contract)."""
        spec, weights = self.spec, self.weights
        row_slot = None if self.loras is None else self.loras[0]._step.row_slot
        spec.lora = row_slot is not None  # the op copies the spec: set per call
        if spec.lora:  # rows with adapters this step (vllm_metal.lora.manager)
            weights = weights + [row_slot]
            for p in self.loras:
                weights += list(p._arrays)  # A, B, scale: rebuilt when a slot is written
        spec.exact = self.projection.exact
        key_cache, value_cache = ctx.kv_caches[self.layer_idx]
        return _core.decoder_layer(
            x, ctx.positions, ctx.slot_mapping, ctx.block_tables, ctx.seq_lens, ctx.cu_seqlens_q,
            key_cache, value_cache, self.rope_table, weights, spec,
            num_decode_seqs=ctx.num_decode_seqs, max_seq_len=ctx.max_seq_len,
            max_query_len=ctx.max_query_len)


def _moe_spec(spec, block: FusedMoeBlock) -> list:
    """Fills the spec's MoE fields from a FusedMoeBlock (why_not_fused checked it); returns
    its experts' (weight, type, shape) for gate, up and down."""
    sw = block.switch_mlp
    _, router_type, (num_experts, _) = block.gate.matmul_args()
    spec.num_experts = num_experts
    spec.top_k = block.top_k
    spec.moe_renormalize = block.renormalize
    spec.router_type = _type_id(router_type)
    projs = [sw.gate_proj, sw.up_proj, sw.down_proj]
    spec.expert_blocks = isinstance(sw, GGUFSwitchGLU)
    if spec.expert_blocks:  # GGUFExperts: blocks of [E, rows, cols]
        spec.intermediate = sw.gate_proj.rows
        return [(p.weight, p.type_id, None) for p in projs]
    spec.intermediate = int(sw.gate_proj.weight.shape[1])  # SwitchLinear [E, I, H]
    return [(p.weight, DENSE_TYPES[p.weight.dtype], None) for p in projs]


def _why_not_fused_moe(i: int, block: FusedMoeBlock) -> str | None:
    """None when the MoE block runs in the fused layer (the per-op FusedMoeBlock's plain
    case), else why not."""
    sw = block.switch_mlp
    if "shared_expert" in block:
        return f"layer {i}: a shared expert (Qwen3.5-MoE)"
    if block.scoring != "softmax":
        return f"layer {i}: {block.scoring} routing"
    gate = block.gate
    if not isinstance(gate, GGUFLinear) or "bias" in gate:
        return f"layer {i}: the router is not a GGUFLinear without bias"
    if isinstance(sw, GGUFSwitchGLU):
        return None
    if type(sw).__name__ != "SwitchGLU" or type(sw.activation).__name__ != "SwiGLU":
        return f"layer {i}: experts {type(sw).__name__} (streamed or another activation)"
    weights = [getattr(sw, n).weight for n in ("gate_proj", "up_proj", "down_proj")]
    if any("scales" in getattr(sw, n) or "bias" in getattr(sw, n)
           for n in ("gate_proj", "up_proj", "down_proj")):
        return f"layer {i}: MLX-quantized or biased experts"
    if weights[0].dtype not in DENSE_TYPES or any(w.dtype != weights[0].dtype
                                                        for w in weights):
        return f"layer {i}: experts of dtype {weights[0].dtype} or of mixed dtypes"
    return None


def on_metal() -> bool:
    """Ops run Metal kernels: on the GPU, or emulated on the CPU."""
    return mx.default_device() != mx.cpu or ops.kernel_backend() != "native"


def runs_fused_kernels(num_tokens: int) -> bool:
    """On the Metal kernels: whether a step of `num_tokens` packed tokens runs the fused
    kernels (else the per-op kernels in the op's plan)."""
    return on_metal() and (num_tokens <= METAL_MAX_TOKENS or ops.batch_invariant())


def _mlp_input_norms(layer, sandwich: bool):
    """(norm before attention, norm before the MLP)."""
    if sandwich:
        return layer.input_layernorm, layer.pre_feedforward_layernorm
    return layer.input_layernorm, layer.post_attention_layernorm


def _type_id(qtype) -> int:
    return _DENSE_TYPE_IDS[qtype] if isinstance(qtype, str) else int(qtype)


def why_not_fused(model) -> str | None:
    """None when every layer of `model` (a PagedCausalLM) can run fused, else why not."""
    if not envs.VLLM_METAL_FUSED_LAYERS:
        return "VLLM_METAL_FUSED_LAYERS=0"
    if getattr(model, "tensor_parallel_size", 1) > 1:
        return "tensor parallel: o_proj and down_proj all-sum across ranks between the fused ops"
    if getattr(model, "pipeline_stage", None) is not None:
        return "pipeline parallel: a stage hands its residual stream on unsummed"
    metal = on_metal()
    if model.llama4_beta is not None:
        return f"{model.arch.model_type} scales queries by position"
    sandwich = model.sandwich
    dtype = None
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(attn, PagedAttention) or attn.rope.fallback is not None:
            return f"layer {i}: its rope runs on the mlx-lm fallback"
        if attn.qk_norm_whole:
            return f"layer {i}: q/k norms over the whole projection (olmoe)"
        if metal and _core.paged_attention_head_size_problem(attn.head_dim, metal=True):
            return f"layer {i}: no Metal attention kernel for head size {attn.head_dim}"
        wrapped = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
        if type(mlp) is FusedMoeBlock:
            if any(isinstance(p, LoraLinear) for p in wrapped + [mlp.gate]):
                return f"layer {i}: LoRA on an MoE model (its expert adapters run per op)"
            if (why := _why_not_fused_moe(i, mlp)) is not None:
                return why
            mlp_linears = []
        else:
            mlp_linears = [base_of(getattr(mlp, n, None))
                           for n in ("gate_proj", "up_proj", "down_proj")]
            if type(mlp).__module__ not in _GATED_MLP_MODULES or not all(
                    isinstance(m, GGUFLinear) for m in mlp_linears):
                return f"layer {i}: the MLP is not a gated MLP of GGUFLinear layers"
        projections = [base_of(p) for p in wrapped]
        if not all(isinstance(p, GGUFLinear) for p in projections):
            return f"layer {i}: attention projections are not GGUFLinear"
        biases = ["bias" in p for p in projections[:3]]
        if any("bias" in m for m in mlp_linears) or (any(biases) and not all(biases)):
            return f"layer {i}: biases on the MLP or on some of q, k, v only"
        layer_norms = list(_mlp_input_norms(layer, sandwich))  # one eps (spec.norm_eps)
        if sandwich:
            layer_norms += [layer.post_attention_layernorm, layer.post_feedforward_layernorm]
        norms = layer_norms + ([attn.q_norm, attn.k_norm] if "q_norm" in attn else [])
        if not all(isinstance(n, RMSNorm) and n.offset == 0 for n in norms):
            return f"layer {i}: norms are not plain RMSNorm"
        if any(n.eps != layer_norms[0].eps for n in layer_norms):
            return f"layer {i}: its norms have different eps"
        dtype = dtype or layer.input_layernorm.weight.dtype
        if any(n.weight.dtype != dtype for n in norms):
            return f"layer {i}: norms of different dtypes"
    if sandwich and dtype == mx.float16:
        return "float16 gemma clips its residual adds (mlx-lm's clip_residual)"
    return None


def fused_layers(model) -> list[FusedDecoderLayer] | None:
    """One FusedDecoderLayer per layer, or None when the model keeps the per-op path."""
    if why_not_fused(model) is not None:
        return None
    return [FusedDecoderLayer(layer, i, model.sandwich) for i, layer in enumerate(model.layers)]
