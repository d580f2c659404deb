"""The compute ops, on ``mx.array``.

Each op is an MLX primitive implemented in C++ (src/cpp/ops) with a CPU
kernel and a Metal kernel. ``VLLM_METAL_KERNELS=emulated`` makes ops created
afterwards run their Metal kernels in the emulator (see vllm_metal.emulation).
"""

from __future__ import annotations

import mlx.core as mx  # noqa: F401  (loads MLX's types before the extension)

from vllm_metal import _core, envs

rms_norm = _core.rms_norm
add_rms_norm = _core.add_rms_norm
reshape_and_cache = _core.reshape_and_cache
rope = _core.rope  # rope(x, positions, *, rotary_dim, is_neox, base, scaling)
gguf_dequantize = _core.gguf_dequantize  # GGUF blocks -> dense weights (docs/gguf.md)
gguf_matmul = _core.gguf_matmul  # x @ W.T straight from GGUF blocks
paged_attention = _core.paged_attention

__all__ = ["rms_norm", "add_rms_norm", "reshape_and_cache", "rope", "gguf_dequantize", "gguf_matmul",
           "paged_attention", "set_kernel_backend", "kernel_backend",
           "set_batch_invariant", "batch_invariant"]


def kernel_backend() -> str:
    return _core.kernel_backend()


def set_kernel_backend(name: str) -> None:
    """'native' or 'emulated'; ops created afterwards use it."""
    if name == "emulated":
        from vllm_metal import emulation

        emulation.load_all()
    _core.set_kernel_backend(name)


def set_batch_invariant(on: bool) -> None:
    """Batch-invariant kernels (VLLM_BATCH_INVARIANT): a row's result independent of the batch."""
    _core.set_batch_invariant(bool(on))


def batch_invariant() -> bool:
    return _core.batch_invariant()


def _configure_from_env() -> None:
    _core.set_num_threads(envs.VLLM_METAL_NUM_THREADS)
    set_kernel_backend(envs.VLLM_METAL_KERNELS)
    _core.set_batch_invariant(envs.VLLM_BATCH_INVARIANT)


_configure_from_env()

# Hybrid models (Qwen3-Next / Qwen3.5 linear attention, Qwen-VL multimodal rope);
# equations in docs/kernels.md.
causal_conv1d = _core.causal_conv1d  # causal_conv1d(x, weight, bias, *, conv_state, cu_seqlens, slots)
gated_delta_rule = _core.gated_delta_rule  # (q, k, v, a, b, A_log, dt_bias, *, state, cu_seqlens, slots)
mrope = _core.mrope  # mrope(x, positions [3, T], *, sections, interleaved, rotary_dim, base)

__all__ += ["causal_conv1d", "gated_delta_rule", "mrope"]

# Structured outputs (issue 21): a grammar's token bitmask on logits, xgrammar's layout.
apply_token_bitmask = _core.apply_token_bitmask  # (logits, bitmask, rows) -> logits, -inf where disallowed

__all__ += ["apply_token_bitmask"]

# Mixture-of-experts MLP (issue 25): routing + grouped SwiGLU experts (docs/kernels.md).
fused_moe = _core.fused_moe  # (hidden, router_logits, w_gate, w_up, w_down, *, top_k, renormalize, scoring)

fused_moe_gguf = _core.fused_moe_gguf  # the same, experts as GGUF blocks (llama.cpp ffn_*_exps)

__all__ += ["fused_moe", "fused_moe_gguf"]

# Encoder models (issue 23): attention within each packed sequence over contiguous q/k/v.
varlen_attention = _core.varlen_attention  # (q, k, v, *, cu_seqlens, scale, causal=False)
gelu = _core.gelu  # gelu(x, *, approximate=False): erf GELU (MLX's CPU erf is scalar)
# layer_norm(x, weight, bias, *, eps, residual=None): LayerNorm of x (+ residual), threaded
layer_norm = _core.layer_norm

__all__ += ["varlen_attention", "gelu", "layer_norm"]

# LoRA (issue 24): per-row adapters on a linear's output, one fused shrink+expand op.
lora_apply = _core.lora_apply  # (y, x, *, lora_a, lora_b, scale, row_slot) -> y + scale*B@A@x per row

__all__ += ["lora_apply"]
