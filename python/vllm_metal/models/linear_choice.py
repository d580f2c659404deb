"""Which matmul a model's dense layers run on: decided here, and only here.

GGUF weights kept in block form always run on ops.gguf_matmul (nothing else reads
the blocks). MLX-quantized layers (nn.QuantizedLinear / nn.QuantizedEmbedding, the
mlx-community checkpoints) always keep MLX's quantized_matmul. Dense float layers
(safetensors checkpoints, GGUF tensors dequantized at load) depend on the device:

- GPU (Apple): keep MLX's nn.Linear / nn.Embedding. MLX's Metal GEMM is tuned for
  Apple GPUs; gguf_matmul's F16/BF16/F32 kernels exist for GGUF files' dense tensors.
- CPU: move them to gguf_matmul as types F32/F16/BF16 (GGUFLinear / GGUFEmbedding):
  our CPU GEMM, where MLX's CPU matmul is reference BLAS on Linux.
- Batch-invariant mode (VLLM_BATCH_INVARIANT) on the GPU: gguf_matmul too, whose Metal
  kernels fix one summation order per row; MLX's GEMM picks its kernel by shape.
  MLX-quantized layers have no such kernel: docs/serving.md says what that leaves out.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from vllm_metal.models.gguf_linear import swap_dense_linears


def model_runs_on_gpu() -> bool:
    """The platform fact: MLX's default device is a Metal GPU."""
    return mx.default_device() == mx.gpu and bool(mx.metal.is_available())


def dense_layers_on_gguf_matmul(linear: str, on_gpu: bool, batch_invariant: bool | None = None) -> bool:
    """linear: the loader's "gguf" (default) or "mlx" (reference: MLX's modules everywhere).
    batch_invariant: None reads the process's mode (ops.batch_invariant)."""
    if batch_invariant is None:
        from vllm_metal import ops

        batch_invariant = ops.batch_invariant()
    return linear == "gguf" and (not on_gpu or batch_invariant)


def choose_dense_layers(lm: nn.Module, linear: str, on_gpu: bool | None = None) -> int:
    """Apply the choice to an mlx-lm model (after its GGUF blocks are installed).
    on_gpu: None asks the device. Returns how many modules moved to gguf_matmul."""
    if on_gpu is None:
        on_gpu = model_runs_on_gpu()
    if not dense_layers_on_gguf_matmul(linear, on_gpu):
        return 0
    return swap_dense_linears(lm)
