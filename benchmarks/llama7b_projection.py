"""Our predicted decode rate for LLaMA-2 7B Q4_0 next to llama.cpp's measured Metal rate.

No 7B model runs here. The recorded SmolLM2 step (llama architecture, same path) is the
template: every op of its layer and of the rest of the step maps to the same op at LLaMA-2
7B's shapes (32 layers, d 4096, 32 heads of 128, no GQA, ffn 11008, vocab 32000; Q4_0
weights, Q6_K output matrix as llama.cpp's Q4_0 files have it, float16 activations,
batch 1). Our ops run at those shapes in the emulator's counting builds (the real k;
matrices of more than SAMPLE_ROWS rows on SAMPLE_ROWS of them, bytes scaled by the floor
as metal_roofline.py does for the lm head); MLX's kernels scale with their elements.
The fused decoder layer maps kernel by kernel: each fused kernel moves what its per-op
counterparts move (layer_qkv: the q, k and v mat-vecs and the cache writes, rope working in
registers; layer_matvec: the o or down mat-vec and the residual it adds; layer_gate_up: the
gate and up mat-vecs and the norm's weights), a slight overcount (x read once per fused
kernel, not once per mat-vec) at 5 dispatches a layer.
Time = Σ max(bytes / bandwidth, flops / fp16 rate) + dispatches × the per-dispatch cost.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

from vllm_metal import kernel_traffic as kt

sys.path.insert(0, str(Path(__file__).resolve().parent))
import apple_published as pub  # noqa: E402
import step_recorder as sr  # noqa: E402

LAYERS, HIDDEN, HEADS, HEAD, FFN, VOCAB = 32, 4096, 32, 128, 11008, 32000
DT = "float16"
CONTEXT = 128  # tg128 generates 128 tokens from an empty context: at most 128 cached
SAMPLE_ROWS = 512
BLOCK_SLACK = 16  # cache slots beyond the context (the pool's last partial block)
LLAMA_CPP_FILE_GIB = 3.56  # llama-bench's size of the LLaMA-2 7B Q4_0 file (discussion #4167)
# SmolLM2-135M's dimensions -> LLaMA-2 7B's (hidden = q width 576; kv width 192; heads
# 9 and kv heads 3 -> 32; head 64 -> 128; ffn; vocab)
_DIMS = {576: HIDDEN, 192: HIDDEN, 1536: FFN, 49152: VOCAB, 9: HEADS, 3: HEADS, 64: HEAD}


def _shapes(text: str):
    """'1x576,576x360->1x576' -> ([(1, 576), (576, 360)], [(1, 576)])."""
    def parse(part):
        return [tuple(int(v) for v in s.split("x")) if s != "()" else () for s in part.split(",") if s]
    ins, outs = text.split("->")
    return parse(ins), parse(outs)


def _elems(shape, mapped: bool) -> int:
    n = 1
    for v in shape:
        n *= _DIMS.get(v, v) if mapped else v
    return n


@functools.lru_cache(maxsize=None)
def _measure(case_fn, *args):
    """(launches: [(kernel, bytes)], flops) of a kernel_traffic case, rows sampled when large."""
    case = case_fn(*args)
    m = kt.measure(case)
    return [(l.kernel, l.device.read_unique + l.device.written_unique) for l in m.launches], case


def _matvec(qtype: str, n: int, k: int):
    rows = min(n, SAMPLE_ROWS)
    launches, case = _measure(kt.gguf_matvec, qtype, DT, 1, rows, k)
    row_bytes = k // kt._core.gguf_type_info(qtype)[1] * kt._core.gguf_type_info(qtype)[2]
    full_min = n * row_bytes + (k + n) * 2
    scale = full_min / case.minimum
    return [(kernel, b * scale) for kernel, b in launches], 2 * n * k


def _our_op(op: str, shapes: str, in_layer: bool, context: int):
    """[(kernel, bytes)], flops of one of our ops at 7B shapes."""
    ins, outs = _shapes(shapes) if shapes else ([], [])
    if op == "GgufMatmul":
        n, k = _DIMS[outs[0][-1]], _DIMS[ins[0][-1]]
        return _matvec("Q4_0" if in_layer else "Q6_K", n, k)
    if op in ("RmsNorm", "AddRmsNorm"):
        launches, case = _measure(kt.rms_norm, DT, 1, HIDDEN, op == "AddRmsNorm")
        return launches, case.flops
    if op == "Rope":
        launches, case = _measure(kt.rope, DT, 1, _DIMS[ins[0][1]], HEAD)
        return launches, case.flops
    if op == "CacheWrite":
        launches, case = _measure(kt.cache_write, DT, 1, HEADS, HEAD, context + BLOCK_SLACK)
        return launches, case.flops
    if op == "PagedAttention":
        launches, case = _measure(kt.paged_attention, DT, (1,), (context,), HEADS, HEADS, HEAD)
        return launches, case.flops
    if op == "GgufDequantize":
        launches, case = _measure(kt.gguf_dequantize, "Q4_0", DT, 1, HIDDEN)
        return launches, HIDDEN
    if op == "DecoderLayer":
        return _decoder_layer(context)
    raise KeyError(f"no LLaMA-7B counterpart for our op {op}")


def _decoder_layer(context: int):
    """[(kernel, bytes)], [flops per launch] of the fused layer's Metal plan at 7B shapes
    (one decode row)."""
    def merged(kernel, *parts):
        return kernel, sum(b for launches, _ in parts for _, b in launches)

    def flops(*parts):
        return sum(f for _, f in parts)

    qkv = [_matvec("Q4_0", HIDDEN, HIDDEN) for _ in range(3)]
    cache = _our_op("CacheWrite", "", True, context)
    o, down = _matvec("Q4_0", HIDDEN, HIDDEN), _matvec("Q4_0", HIDDEN, FFN)
    gate_up = [_matvec("Q4_0", FFN, HIDDEN) for _ in range(2)]
    attention, attention_flops = _our_op("PagedAttention", "", True, context)
    residual = [([("", 2 * HIDDEN)], 0)]  # x (or h) read for the residual add; the norm's weights
    launches = [merged("layer_qkv", *qkv, cache, cache), *attention,
                merged("layer_matvec", o, *residual), merged("layer_gate_up", *gate_up, *residual),
                merged("layer_matvec", down, *residual)]
    per_launch = ([flops(*qkv), attention_flops] + [0] * (len(attention) - 1)
                  + [flops(o), flops(*gate_up), flops(down)])
    return launches, per_launch


def project(layer, outside, context: int = CONTEXT) -> list:
    """7B dispatches (step_recorder.Dispatch) from a recorded SmolLM2 step's layer and rest."""
    out = []
    for rows, in_layer, times in ((layer, True, LAYERS), (outside, False, 1)):
        nodes = {}
        for d in rows:  # one op, several launches: map the op once
            nodes.setdefault(d.node, []).append(d)
        for group in nodes.values():
            d = group[0]
            if d.source == sr.OURS:
                launches, flops = _our_op(d.op, d.shapes, in_layer, context)
                if not isinstance(flops, list):  # the op's flops, counted on its first launch
                    flops = [flops] + [0] * (len(launches) - 1)
                mapped = [sr.Dispatch(sr.OURS, d.op, kernel, int(b), f, d.shapes)
                          for (kernel, b), f in zip(launches, flops)]
            else:
                ins, outs = _shapes(d.shapes)
                ratio = (sum(_elems(s, True) for s in ins + outs)
                         / max(1, sum(_elems(s, False) for s in ins + outs)))
                mapped = [sr.Dispatch(sr.MLX, g.op, g.kernel, int(g.bytes * ratio),
                                      int(g.flops * ratio), g.shapes) for g in group]
            out += mapped * times
    return out


def table(projected: dict, context: int) -> str:
    """projected: layer path ("fused", "per-op") -> its 7B dispatches; the fused path (what
    serving runs) is the prediction, the per-op one a column next to it."""
    from metal_step_model import step_time_us

    path = "fused" if "fused" in projected else next(iter(projected))
    dispatches = projected[path]
    per_op = projected.get("per-op") if path == "fused" else None
    n = len(dispatches)
    total = sum(d.bytes for d in dispatches)
    rows = []
    for name, gbs, tflops, measured in pub.llama_cpp_machines():
        roof, over = step_time_us(dispatches, gbs, tflops, pub.DISPATCH_US)
        ours = 1e6 / (roof + over)
        # llama.cpp's achieved bandwidth: its file's bytes per token x tokens/s
        achieved = measured * LLAMA_CPP_FILE_GIB * 2**30 / 1e9
        frac = achieved / gbs
        at_theirs = 1e6 / (roof / frac + over)
        extra = ""
        if per_op:
            extra = f" {1e6 / sum(step_time_us(per_op, gbs, tflops, pub.DISPATCH_US)):.1f} |"
        rows.append(f"| {name} | {gbs} | {measured:.1f} | {achieved:.0f} ({100 * frac:.0f}%) | "
                    f"{1e6 / roof:.1f} | **{ours:.1f}** | {at_theirs:.1f} | {ours / measured:.2f} |" + extra)
    head = [
        f"LLaMA-2 7B Q4_0 decode (batch 1, context {context}): llama.cpp's measured Metal rate "
        f"([discussion #4167]({pub.LLAMA_CPP_SOURCE}), llama-bench tg128) next to ours predicted "
        f"by `benchmarks/llama7b_projection.py`: our recorded SmolLM2 step ({path} layers) mapped op by op to "
        f"LLaMA-2 7B's shapes, our kernels counted in the emulator at those shapes (the real k; "
        f"{SAMPLE_ROWS} rows of each matrix, bytes scaled to all rows), {n} dispatches per token "
        f"({total / 2**30:.2f} GiB unique bytes; llama.cpp's file: {LLAMA_CPP_FILE_GIB} GiB), each "
        f"dispatch adding {pub.DISPATCH_US:.2f} µs. **Ours is a model, not a measurement: no Mac "
        f"has run it.** Predicted assumes the table's peak bandwidth, which no kernel reaches: "
        f"llama.cpp's own achieved bandwidth (file bytes × tok/s) is given, and the column "
        f"\"at llama.cpp's GB/s\" runs our bytes at it plus our dispatches (pessimistic for us: "
        f"llama.cpp's measured time already holds its own dispatch costs). fp16 rates are "
        f"estimated from GPU cores and clock (apple_published.py).",
        "",
        "| chip | GB/s | llama.cpp tok/s (measured) | llama.cpp GB/s achieved | ours, bytes at peak | "
        "ours predicted (peak + dispatches) | ours at llama.cpp's GB/s + dispatches | predicted ÷ llama.cpp |"
        + (f" per-op layers predicted ({len(per_op)} dispatches) |" if per_op else ""),
        "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if per_op else ""),
    ]
    return "\n".join(head + rows)
