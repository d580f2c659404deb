"""Linear layers and embeddings on `ops.gguf_matmul`.

`GGUFLinear` replaces mlx-lm's `nn.Linear` and `GGUFEmbedding` its
`nn.Embedding`; both keep the parameter name `weight`, which holds either

- a GGUF tensor in block form: uint8 `[out, row_bytes]` (the file's bytes;
  `qtype` the GGML type id, `in_features` the logical columns), or
- a dense float `[out, in]` array (safetensors checkpoints, or weights we
  dequantized): it takes the same op as GGML type F32 / F16 / BF16 by its
  dtype, so dense checkpoints get our CPU GEMM instead of MLX's matmul (which
  is scalar reference BLAS on Linux).

Block-form weights are never cast: `set_dtype` touches float parameters only,
and `gguf_matmul` returns x's dtype whatever the weight type. A block-form
embedding dequantizes only the rows it looks up (gather the rows' bytes, then
`ops.gguf_dequantize`), and its `as_linear` (tied lm_head) multiplies straight
from the same blocks.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from vllm_metal import ops

DENSE_TYPES = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16"}
_DTYPE_NAMES = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}


def _dense_type(w: mx.array) -> str:
    t = DENSE_TYPES.get(w.dtype)
    if t is None:
        raise ValueError(f"[vllm-metal] dense weights must be float32/float16/bfloat16, got {w.dtype}")
    return t


class _BlockWeight(nn.Module):
    """`weight` (blocks or dense) and how gguf_matmul reads it."""

    def __init__(self, weight: mx.array, qtype: int | None, in_features: int | None):
        super().__init__()
        self.weight = weight
        # True: float32 sums; False: the CPU rounds activations to 8-bit blocks for the
        # integer-capable types (llama.cpp's scheme, faster). See set_exact_activations.
        self.exact = True
        if weight.dtype == mx.uint8:
            if qtype is None or in_features is None:
                raise ValueError("[vllm-metal] block-form weights need their GGML type and columns")
            self.qtype = int(qtype)
            self.in_features = int(in_features)
        else:
            if weight.ndim != 2:
                raise ValueError(f"[vllm-metal] dense weights must be [out, in], got {weight.shape}")
            self.qtype = None
            self.in_features = int(weight.shape[1])
        self.out_features = int(weight.shape[0])

    @property
    def is_blocks(self) -> bool:
        return self.weight.dtype == mx.uint8

    def matmul_args(self):
        """(blocks, type, shape) for ops.gguf_matmul / gguf_dequantize."""
        shape = [self.out_features, self.in_features]
        if self.is_blocks:
            return self.weight, self.qtype, shape
        # A dense weight's bytes are its F32/F16/BF16 "blocks" (a view, no copy).
        return mx.view(self.weight, mx.uint8), _dense_type(self.weight), shape

    def _extra_repr(self) -> str:
        kind = f"type={self.qtype}" if self.is_blocks else f"dense {self.weight.dtype}"
        return f"{self.in_features}, {self.out_features}, {kind}"


class GGUFLinear(_BlockWeight):
    """y = x @ W.T (+ bias) through ops.gguf_matmul; x [..., in] -> [..., out] in x's dtype."""

    def __init__(self, weight: mx.array, qtype: int | None = None, in_features: int | None = None,
                 bias: mx.array | None = None):
        super().__init__(weight, qtype, in_features)
        if bias is not None:
            self.bias = bias

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "GGUFLinear":
        return cls(linear.weight, bias=linear.bias if "bias" in linear else None)

    def __call__(self, x: mx.array, activation: str = "none") -> mx.array:
        """activation: "none", or "gelu" / "gelu_tanh" applied after the bias (ops.gelu)."""
        blocks, qtype, shape = self.matmul_args()
        bias = self.bias if "bias" in self else None
        # The bias (and activation) in gguf_matmul's epilogue: no extra pass over y. Only
        # in float32, where the fused add rounds exactly as a separate one did; a half-
        # precision y rounds once instead of twice fused, which would move other models' bits.
        if bias is None or (x.dtype == mx.float32 and bias.dtype == mx.float32):
            return ops.gguf_matmul(x, blocks, qtype, shape, exact=self.exact, bias=bias,
                                   activation=activation)
        y = ops.gguf_matmul(x, blocks, qtype, shape, exact=self.exact) + bias
        return y if activation == "none" else ops.gelu(y, approximate=activation == "gelu_tanh")


class GGUFEmbedding(_BlockWeight):
    """Token embeddings whose table may be in block form; `as_linear` is the tied lm_head.

    out_dtype: the dtype looked-up rows come out in (the model's); set by
    PagedCausalLM.set_dtype. Dense tables return rows in their own dtype.
    """

    def __init__(self, weight: mx.array, qtype: int | None = None, in_features: int | None = None,
                 out_dtype: mx.Dtype = mx.float32):
        super().__init__(weight, qtype, in_features)
        self.out_dtype = out_dtype

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding) -> "GGUFEmbedding":
        return cls(embedding.weight, out_dtype=embedding.weight.dtype)

    def __call__(self, ids: mx.array) -> mx.array:
        if not self.is_blocks:
            return self.weight[ids]
        flat = ids.reshape(-1)
        rows = self.weight[flat]  # [T, row_bytes]: only the looked-up rows' blocks
        out = ops.gguf_dequantize(rows, self.qtype, [flat.shape[0], self.in_features],
                                  _DTYPE_NAMES[self.out_dtype])
        return out.reshape(*ids.shape, self.in_features)

    def as_linear(self, x: mx.array) -> mx.array:
        blocks, qtype, shape = self.matmul_args()
        return ops.gguf_matmul(x, blocks, qtype, shape, exact=self.exact)


# ---- swapping modules in an mlx-lm model ------------------------------------------------


def _get(root: nn.Module, path: str):
    node = root
    for part in path.split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def _set(root: nn.Module, path: str, value) -> None:
    parent_path, _, last = path.rpartition(".")
    parent = _get(root, parent_path) if parent_path else root
    if isinstance(parent, list):
        parent[int(last)] = value
    else:
        setattr(parent, last, value)


def install_block_weights(lm: nn.Module, weights: dict) -> dict[str, mx.array]:
    """Swap the modules whose `weight` is a block-form GGUF tensor (a value with
    `blocks`, `type_id`, `shape`, see gguf_loader.GGUFWeight) for GGUFLinear /
    GGUFEmbedding holding those blocks. Returns `weights` with the blocks as
    plain arrays, ready for `lm.load_weights(..., strict=True)`."""
    out = {}
    for name, value in weights.items():
        if isinstance(value, mx.array):
            out[name] = value
            continue
        path = name.rpartition(".")[0]
        module = _get(lm, path)
        rows, cols = value.shape
        if isinstance(module, nn.Linear):
            bias = module.bias if "bias" in module else None  # loaded with the other weights
            _set(lm, path, GGUFLinear(value.blocks, value.type_id, cols, bias=bias))
        elif isinstance(module, nn.Embedding):
            _set(lm, path, GGUFEmbedding(value.blocks, value.type_id, cols))
        else:
            raise ValueError(f"[vllm-metal] GGUF tensor for {name} is not a linear layer or an "
                             f"embedding ({type(module).__name__})")
        out[name] = value.blocks
    return out


def set_exact_activations(lm: nn.Module, exact: bool) -> None:
    """Every GGUFLinear / GGUFEmbedding and GGUF expert stack (moe.GGUFSwitchGLU) of `lm`
    multiplies float32 activations (exact) or 8-bit rounded ones (not exact)."""
    from vllm_metal.models.expert_offload import StreamedSwitchGLU
    from vllm_metal.models.moe import GGUFSwitchGLU

    for _, m in lm.named_modules():
        if isinstance(m, (_BlockWeight, GGUFSwitchGLU, StreamedSwitchGLU)):
            m.exact = exact


def swap_dense_linears(lm: nn.Module) -> int:
    """Every remaining dense nn.Linear / nn.Embedding (exact types: MLX-quantized
    layers stay) -> GGUFLinear / GGUFEmbedding on the same dense weight.
    Returns how many modules were swapped."""
    swaps = []
    for name, m in lm.named_modules():
        if type(m) is nn.Linear:
            swaps.append((name, GGUFLinear.from_linear(m)))
        elif type(m) is nn.Embedding:
            swaps.append((name, GGUFEmbedding.from_embedding(m)))
    for name, new in swaps:
        _set(lm, name, new)
    return len(swaps)
