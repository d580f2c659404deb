"""Every Metal dispatch of one model step, recorded from the step's own MLX graph.

`record(build)` calls `build()` for the step's lazy outputs (logits, sampled tokens,
caches), walks their graph before eval (`_core.graph_nodes`: every primitive node), then
evaluates it on the emulated backend with launch recording on. Each node becomes:

- one of our ops (a KernelPrimitive): its kernel launches, as the emulator ran them
  (`_core.start/stop_launch_recording`, tagged with the op), with the unique device bytes
  the counting builds measured;
- an MLX op that runs a Metal kernel (mlx_metal_ops.kind): dispatches, bytes and flops
  from its shapes;
- an MLX view: no dispatch (a view-or-copy op whose output kept its input's buffer).

Nothing is dropped: a launch whose op is not in the graph, or a node nobody classifies,
is an error. The path is whatever the model takes (fused layers included).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from vllm_metal import _core, emulation

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mlx_metal_ops  # noqa: E402

OURS, MLX = "ours", "mlx"


@dataclasses.dataclass
class Dispatch:
    source: str   # OURS or MLX
    op: str       # the graph node's primitive
    kernel: str   # our Metal kernel, or the MLX op (Contiguous copy, Gather, ...)
    bytes: int    # unique device bytes
    flops: int
    shapes: str   # input and output shapes, to group identical dispatches
    threads: int = 0
    simd_ops_per_thread: float = 0.0
    barriers_per_thread: float = 0.0
    sampled: bool = False  # counted on part of the grid and extrapolated
    node: int = 0          # the graph node (one op may launch several kernels)

    @property
    def key(self):
        return self.source, self.op, self.kernel, self.shapes


@dataclasses.dataclass
class StepRecord:
    dispatches: list
    views: collections.Counter   # MLX nodes that dispatched nothing, by primitive
    nodes: int                   # primitive nodes in the step's graph
    launches: int                # our kernel launches the emulator ran

    def count(self, source=None) -> int:
        return sum(1 for d in self.dispatches if source in (None, d.source))

    def total(self, field: str, source=None) -> int:
        return sum(getattr(d, field) for d in self.dispatches if source in (None, d.source))


@functools.lru_cache(maxsize=None)
def enable_counting() -> None:
    """Emulated and counting builds of every kernel source (built once, cached)."""
    emulation.load_all()
    for source in emulation.kernel_sources():
        _core.register_counting_emulated_library(source, emulation.counting_library(source).so_path)


def record(build, reuse_counts: bool = False) -> StepRecord:
    """build() -> list of lazy arrays: the step's outputs, built here with our ops on their
    Metal kernels (emulated backend; the process's backend is restored after). Its inputs
    (weights, caches, step metadata) must be evaluated already, or their producers are
    recorded too. reuse_counts: identical launches of earlier recordings keep their counts."""
    from vllm_metal import ops

    enable_counting()
    backend = ops.kernel_backend()
    ops.set_kernel_backend("emulated")
    try:
        outputs = build()
        nodes = _core.graph_nodes(outputs)
        _core.start_launch_recording(reset_counts=not reuse_counts)
        try:
            mx.eval(outputs)
        finally:
            launches = _core.stop_launch_recording()
    finally:
        ops.set_kernel_backend(backend)
    by_tag = collections.defaultdict(list)
    for launch in launches:
        by_tag[launch["tag"]].append(launch)
    dispatches, views = [], collections.Counter()
    for node in nodes:
        if node["ours"]:
            dispatches += _our_dispatches(node, by_tag.pop(node["id"], []))
        else:
            d = _mlx_dispatch(node)
            if d is None:
                views[node["name"]] += 1
            else:
                dispatches += d
    if by_tag:
        stray = sorted({l["kernel"] for ls in by_tag.values() for l in ls})
        raise RuntimeError(f"launches of ops outside the step's graph: {stray}")
    return StepRecord(dispatches, views, len(nodes), len(launches))


def _shape_text(arrays) -> str:
    return ",".join("x".join(map(str, a.shape)) or "()" for a in arrays)


def _our_dispatches(node, launches) -> list:
    inputs, outputs = node["inputs"], node["outputs"]
    shapes = f"{_shape_text(inputs)}->{_shape_text(outputs)}"
    flops = _our_flops(node["name"], inputs, outputs)
    for launch in launches:
        if launch["counts"] is None:
            raise RuntimeError(f"{launch['kernel']}: no counting build registered")
    moved = [l["counts"]["read_unique"] + l["counts"]["written_unique"] for l in launches]
    out = []
    for launch, b in zip(launches, moved):
        # an op's arithmetic spread over its launches by their bytes (a fused layer's
        # mat-vec kernels hold nearly all of both)
        c, threads = launch["counts"], max(1, launch["counts"]["threads"])
        out.append(Dispatch(
            OURS, node["name"], launch["kernel"], b, flops * b // max(1, sum(moved)),
            shapes, c["threads"], c["simd_ops"] / threads,
            c["barriers"] / threads, launch["sampled_axis"] >= 0, node["id"]))
    return out


def _attended(seq_lens, cu_seqlens_q) -> int:
    """(query token, key) pairs of a causal paged-attention batch."""
    seq_lens, cu = np.array(seq_lens), np.array(cu_seqlens_q)
    total = 0
    for i, ctx in enumerate(seq_lens.tolist()):
        n = int(cu[i + 1] - cu[i])
        total += sum(ctx - n + 1 + j for j in range(n))
    return total


def _our_flops(name: str, inputs, outputs) -> int:
    """Arithmetic of our ops, for the roofline's compute bound (kernel_traffic's formulas)."""
    if name == "GgufMatmul":
        n = outputs[0].shape[-1]
        k = inputs[0].shape[-1]
        return 2 * (outputs[0].size // n) * n * k
    if name in ("RmsNorm", "AddRmsNorm"):
        return 4 * inputs[0].size
    if name == "Rope":
        return 6 * inputs[0].size
    if name == "PagedAttention":
        q = inputs[0]
        return 4 * q.shape[1] * q.shape[2] * _attended(inputs[4], inputs[5])
    if name == "DecoderLayer":
        # inputs: x, 8 metadata and cache arrays, then the weights: 1-D norms (and biases)
        # and the 7 projections in q, k, v, o, gate, up, down order, as block rows
        x, rows = inputs[0], [w.shape[0] for w in inputs[9:] if w.ndim == 2]
        tokens, hidden = x.shape
        q, k, v, o, gate, up, down = rows
        weights = (q + k + v + gate + up) * hidden + o * q + down * gate
        return 2 * tokens * weights + 4 * q * _attended(inputs[4], inputs[5])
    if name == "GgufDequantize":
        return outputs[0].size
    return 0


def _mlx_dispatch(node):
    name, inputs, outputs = node["name"], node["inputs"], node["outputs"]
    kind = mlx_metal_ops.kind(name)
    if kind == mlx_metal_ops.VIEW:
        return None
    if kind == mlx_metal_ops.VIEW_OR_COPY:
        if _core.array_buffer_id(outputs[0]) == _core.array_buffer_id(inputs[0]):
            return None
        moved = _core.array_data_bytes(inputs[0]) + outputs[0].nbytes
        return [Dispatch(MLX, name, f"{name} (copy)", moved, 0,
                         f"{_shape_text(inputs)}->{_shape_text(outputs)}", node=node["id"])]
    desc = lambda arrays: [(tuple(a.shape), a.dtype.size, a.size) for a in arrays]  # noqa: E731
    count, moved, flops = mlx_metal_ops.cost(name, desc(inputs), desc(outputs),
                                             lambda i: _core.array_data_bytes(inputs[i]))
    shapes = f"{_shape_text(inputs)}->{_shape_text(outputs)}"
    return [Dispatch(MLX, name, name, moved // count, flops if i == 0 else 0, shapes,
                     node=node["id"]) for i in range(count)]
