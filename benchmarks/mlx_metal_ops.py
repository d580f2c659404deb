"""What MLX's own graph nodes cost on Apple GPUs: Metal dispatches, device bytes, flops.

Facts from MLX's Metal backend (ml-explore/mlx, mlx/backend/gpu/primitives.cpp,
backend/gpu/copy.cpp and backend/metal/*.cpp at 846d176, after v0.32.2; the Python wheel
here is 0.32.4):

- Views, never a kernel: AsStrided, Broadcast, BroadcastAxes, Copy, Depends, ExpandDims,
  NumberOfElements, Slice, Split, Squeeze, StopGradient, Transpose (`eval` shares the
  input's buffer with new strides).
- View or copy: Reshape, Flatten, Unflatten (reshape_gpu: a copy kernel when the input's
  strides cannot be reshaped), Contiguous (a copy unless the input is row-contiguous and
  its buffer at most 16 KB larger), View (a copy only for a narrowing dtype of a
  non-contiguous input). The CPU backend takes the same decisions (backend/common
  reshape, Contiguous::eval_cpu), so the recorder reads the outcome off the evaluated
  arrays: an output that shares its input's buffer was a view.
- One kernel: AsType and Full (copy_gpu), elementwise unary/binary/ternary ops, a
  Compiled (mx.compile) graph, Gather, Scatter, reductions, ArgReduce, Softmax,
  LogSumExp, Matmul, AddMM, Arange, RandomBits, sorts and partitions. Concatenate: one
  copy per input.

Bytes: each distinct input's data once (a broadcast scalar is its one element; a gather
reads the rows it gathers) plus the outputs; flops: one per output element and
elementwise op (compiled graphs: per op in their tape), 2 M N K for matmuls.
"""

from __future__ import annotations

import re

VIEW = "view"              # no dispatch
VIEW_OR_COPY = "view_or_copy"  # a copy kernel when the output got its own buffer
KERNEL = "kernel"

_VIEWS = {"AsStrided", "Broadcast", "BroadcastAxes", "Copy", "Depends", "ExpandDims",
          "NumberOfElements", "Slice", "Split", "Squeeze", "StopGradient", "Transpose",
          "CustomTransforms"}
_VIEW_OR_COPY = {"Reshape", "Flatten", "Unflatten", "Contiguous", "View"}
_ELEMENTWISE = {
    "Abs", "Add", "ArcCos", "ArcCosh", "ArcSin", "ArcSinh", "ArcTan", "ArcTan2", "ArcTanh",
    "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseInvert", "Ceil", "Cos", "Cosh", "Divide",
    "Equal", "Erf", "ErfInv", "Exp", "Expm1", "Floor", "Greater", "GreaterEqual", "Imag",
    "IsNaN", "LeftShift", "Less", "LessEqual", "Log", "Log1p", "LogAddExp", "LogicalAnd",
    "LogicalNot", "LogicalOr", "Maximum", "Minimum", "Multiply", "Negative", "NotEqual",
    "Power", "Real", "Remainder", "RightShift", "Round", "Rsqrt", "Select", "Sigmoid", "Sign",
    "Sin", "Sinh", "Sqrt", "Square", "Subtract", "Tan", "Tanh", "DivMod",
    "AsType", "Full"}
_REDUCTIONS = {"Reduce", "ArgReduce", "Softmax", "LogSumExp", "Scan"}
_ONE_KERNEL = {"Gather", "GatherAxis", "Scatter", "ScatterAxis", "Arange", "RandomBits",
               "Sort", "ArgSort", "Partition", "ArgPartition", "Matmul", "AddMM",
               "BlockMaskedMM", "GatherMM", "QuantizedMatmul", "GatherQMM", "Pad",
               "DynamicSlice", "DynamicSliceUpdate", "SliceUpdate"}


def kind(name: str) -> str:
    """VIEW, VIEW_OR_COPY or KERNEL; an unknown primitive is an error (extend the tables
    from MLX's Metal backend rather than guess)."""
    if name in _VIEWS:
        return VIEW
    if name in _VIEW_OR_COPY:
        return VIEW_OR_COPY
    if (name in _ELEMENTWISE or name in _REDUCTIONS or name in _ONE_KERNEL
            or name == "Concatenate" or name.startswith("Compiled")):
        return KERNEL
    raise KeyError(f"MLX primitive {name!r} is not classified (benchmarks/mlx_metal_ops.py)")


def compiled_ops(name: str) -> int:
    """Arithmetic ops in a Compiled node's tape, from its name (e.g.
    CompiledSigmoidBroadcastBroadcastMultiplyBroadcastBroadcastMultiply: 3)."""
    parts = re.findall(r"[A-Z][a-z0-9]*", name[len("Compiled"):])
    return max(1, sum(1 for p in parts if p not in _VIEWS))


def cost(name: str, inputs, outputs, data_bytes) -> tuple[int, int, int]:
    """(dispatches, device bytes, flops) of one MLX kernel node. inputs/outputs are
    (shape, itemsize, size) tuples; data_bytes(i) the bytes input i really holds (a
    broadcast view: its data, not its logical size)."""
    out_bytes = sum(size * item for _, item, size in outputs)
    out_elems = sum(size for _, _, size in outputs)
    if name == "Concatenate":
        return len(inputs), 2 * out_bytes, 0
    if name in ("Gather", "GatherAxis"):
        idx = sum(data_bytes(i) for i in range(1, len(inputs)))
        return 1, 2 * out_bytes + idx, 0
    read = sum(data_bytes(i) for i in range(len(inputs)))
    if name in ("Matmul", "AddMM"):
        a, b = inputs[0][0], inputs[1][0]
        k = a[-1]
        m = inputs[0][2] // max(1, k)
        n = b[-1]
        return 1, read + out_bytes, 2 * m * n * k
    if name in _REDUCTIONS:
        return 1, read + out_bytes, sum(size for _, _, size in inputs)
    if name.startswith("Compiled"):
        return 1, read + out_bytes, compiled_ops(name) * out_elems
    if name in _ELEMENTWISE and name not in ("AsType", "Full"):
        return 1, read + out_bytes, out_elems
    return 1, read + out_bytes, 0
