"""Memory traffic of the Metal kernels: the least each op must move, and what the kernels move.

``minimum`` of a case is the bytes an op cannot avoid: every input byte it needs read once,
every output byte written once (a perfect cache, nothing re-read, no scratch). ``measure``
runs the op's real plan on the emulator's counting builds (``emulation.run_plan(...,
counts=...)``) and sums its launches. Used by tests/py/test_kernel_traffic.py (budgets) and
benchmarks/metal_roofline.py (predicted times on Apple GPUs).
"""

from __future__ import annotations

import dataclasses

import mlx.core  # noqa: F401 -- before _core: rope tables come back as mx.array
import numpy as np

from vllm_metal import _core, emulation

_SIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
# NumPy stand-ins with the same byte size (counts do not depend on the values)
# decoder_layer's outputs: the split-KV partial outputs (DecoderLayerSlots: out + 12)
_PARTIAL_OUT = 12
_NP = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "int32": np.int32}


@dataclasses.dataclass
class Case:
    """One op at one shape: its plan, NumPy arrays by slot, and its floor."""

    name: str
    plan: list
    arrays: list
    minimum: int      # bytes the op must read + write at least
    flops: int = 0    # arithmetic, for the roofline's compute bound
    scratch: int = 0  # bytes of intermediate results the plan must write and read back
    spec: object = None  # decoder_layer: the DecoderLayerSpec
    dtype: str = ""      # decoder_layer: the activation dtype


@dataclasses.dataclass
class Traffic:
    """Device bytes of all launches of a case (args structs excluded)."""

    case: Case
    launches: list    # mslemu.accounting.LaunchCounts, one per launch
    total: int        # every load and store of every thread
    unique: int       # distinct bytes per launch, summed over launches
    tg_unique: int    # distinct bytes per threadgroup, summed
    simd: int = 0     # like total, a simdgroup's broadcast load (same address) counted once

    @property
    def ratio(self) -> float:
        """unique / minimum: >1 means bytes the op did not need (or scratch)."""
        return self.unique / self.case.minimum

    @property
    def simd_ratio(self) -> float:
        """simd / minimum: re-reads that remain once broadcasts are merged."""
        return self.simd / self.case.minimum

    @property
    def lane_use(self) -> float:
        """Lane utilisation over all launches (mslemu LaunchCounts.lane_use): device loads
        summed over lanes / 32 x the busiest lane's per simdgroup; 1.0: no lane idled."""
        dev = [c.device for c in self.launches]
        slots = sum(d.lane_load_slots for d in dev)
        return sum(d.lane_loads for d in dev) / slots if slots else 1.0

    @property
    def total_ratio(self) -> float:
        """total / minimum: >1 means bytes read or written more than once."""
        return self.total / self.case.minimum


def measure(case: Case) -> Traffic:
    counts: list = []
    emulation.run_plan(case.plan, case.arrays, counts=counts)
    dev = [c.device for c in counts]
    return Traffic(
        case,
        counts,
        total=sum(d.read + d.written for d in dev),
        unique=sum(d.read_unique + d.written_unique for d in dev),
        tg_unique=sum(d.read_tg_unique + d.written_tg_unique for d in dev),
        simd=sum(d.read_simd + d.written_simd for d in dev),
    )


def _rand(shape, dtype: str, rng) -> np.ndarray:
    a = rng.standard_normal(shape).astype(np.float32)
    if dtype == "bfloat16":
        return (a.view(np.uint32) >> 16).astype(np.uint16)
    return a.astype(_NP[dtype])


def _empty(shape, dtype: str) -> np.ndarray:
    return np.zeros(shape, _NP[dtype])


def rms_norm(dtype: str, rows: int, hidden: int, fused: bool = False) -> Case:
    rng = np.random.default_rng(rows * hidden)
    s = _SIZE[dtype]
    plan = _core.plan_rms_norm(dtype, rows, hidden, fused_add=fused)
    x, w, out = _rand((rows, hidden), dtype, rng), _rand(hidden, dtype, rng), _empty((rows, hidden), dtype)
    if fused:
        r, res_out = _rand((rows, hidden), dtype, rng), _empty((rows, hidden), dtype)
        arrays = [x, r, w, out, res_out]
        minimum = 4 * rows * hidden * s + hidden * s  # x, residual in; out, residual out
    else:
        arrays = [x, w, out]
        minimum = 2 * rows * hidden * s + hidden * s
    name = f"{'add_' if fused else ''}rms_norm(rows={rows},hidden={hidden},{dtype})"
    return Case(name, plan, arrays, minimum, flops=4 * rows * hidden)


def cache_write(dtype: str, tokens: int, heads: int, head_size: int, num_slots: int) -> Case:
    """One reshape_and_cache cache (the op runs it for K and for V), cache updated in place."""
    rng = np.random.default_rng(tokens + num_slots)
    s = _SIZE[dtype]
    src = _rand((tokens, heads, head_size), dtype, rng)
    cache = _empty((num_slots, heads, head_size), dtype)
    slots = rng.permutation(num_slots)[:tokens].astype(np.int64)
    if tokens > 1:
        slots[tokens // 2] = -1  # padding token: skipped
    plan = _core.plan_cache_write(dtype, tokens, heads, head_size, num_slots, [heads * head_size, head_size, 1])
    kept = int((slots >= 0).sum())
    minimum = 8 * tokens + 2 * kept * heads * head_size * s  # a skipped token's row is never read
    return Case(f"cache_write(T={tokens},H={heads},D={head_size},{dtype})", plan,
                [src, cache, slots, cache], minimum)


def rope(dtype: str, tokens: int, heads: int, head_size: int, is_neox: bool = True) -> Case:
    rng = np.random.default_rng(tokens * heads)
    s = _SIZE[dtype]
    x = _rand((tokens, heads, head_size), dtype, rng)
    positions = rng.integers(0, 4096, size=tokens).astype(np.int64)
    table, mscale = _core.rope_turn_table(head_size)
    table = np.array(table)
    out = _empty(x.shape, dtype)
    plan = _core.plan_rope(dtype, "int64", tokens, heads, head_size, is_neox=is_neox, mscale=mscale)
    minimum = 2 * x.size * s + 8 * tokens + table.nbytes
    return Case(f"rope(T={tokens},H={heads},D={head_size},{dtype})", plan, [x, positions, table, out],
                minimum, flops=6 * x.size)


def apply_token_bitmask(dtype: str, num_rows: int, vocab: int, rows, in_place: bool = False) -> Case:
    """A grammar mask on some rows of the logits: words of 32 tokens all allowed, none
    allowed or mixed (a third each). A disallowed token's logit is not needed, in place
    nothing of the logits is: there only the -infs are written."""
    rng = np.random.default_rng(num_rows * vocab)
    s = _SIZE[dtype]
    words = (vocab + 31) // 32
    mask = rng.integers(0, 2**32, size=(len(rows), words), dtype=np.uint64).astype(np.uint32)
    kind = rng.integers(0, 3, size=mask.shape)
    mask[kind == 0] = 0xFFFFFFFF
    mask[kind == 1] = 0
    mask_of_row = np.full(num_rows, -1, np.int32)
    mask_of_row[list(rows)] = np.arange(len(rows), dtype=np.int32)
    t = np.arange(vocab)
    allowed = int(((mask[:, t // 32] >> (t % 32).astype(np.uint32)) & 1).sum())
    disallowed = len(rows) * vocab - allowed
    logits = _rand((num_rows, vocab), dtype, rng)
    out = logits if in_place else _empty((num_rows, vocab), dtype)
    plan = _core.plan_apply_token_bitmask(dtype, num_rows, vocab, words, in_place=in_place)
    minimum = mask.nbytes + mask_of_row.nbytes
    if in_place:
        minimum += disallowed * s
    else:  # unmasked rows and allowed tokens read; every value written
        minimum += ((num_rows - len(rows)) * vocab + allowed) * s + num_rows * vocab * s
    name = (f"apply_token_bitmask(rows={num_rows},vocab={vocab},masked={len(rows)},{dtype}"
            f"{',in_place' if in_place else ''})")
    return Case(name, plan, [logits, mask.view(np.int32), mask_of_row, out], minimum)


def gguf_dequantize(qtype: str, dtype: str, rows: int, cols: int) -> Case:
    rng = np.random.default_rng(rows * cols)
    row_bytes = _row_bytes(qtype, cols)
    blocks = _random_blocks(qtype, rows, row_bytes, rng)
    out = _empty((rows, cols), dtype)
    plan = _core.plan_gguf_dequantize(qtype, dtype, rows, cols)
    minimum = rows * row_bytes + rows * cols * _SIZE[dtype]
    return Case(f"gguf_dequantize({qtype},{rows}x{cols},{dtype})", plan, [blocks, out], minimum)


def gguf_matvec(qtype: str, dtype: str, m: int, n: int, k: int) -> Case:
    """y[m, n] = x[m, k] @ W[n, k]^T with the kernel the planner picks (m <= 8, or any m in
    batch-invariant mode: the mat-vec kernel)."""
    rng = np.random.default_rng(m * n + k)
    row_bytes = _row_bytes(qtype, k)
    x, y = _rand((m, k), dtype, rng), _empty((m, n), dtype)
    blocks = _random_blocks(qtype, n, row_bytes, rng)
    plan = _core.plan_gguf_matmul(qtype, dtype, m, n, k)
    minimum = n * row_bytes + (m * k + m * n) * _SIZE[dtype]
    return Case(f"gguf_matvec({qtype},m={m},n={n},k={k},{dtype})", plan, [x, blocks, y], minimum,
                flops=2 * m * n * k)


def _row_bytes(qtype: str, cols: int) -> int:
    _, block, size, _ = _core.gguf_type_info(qtype)
    return cols // block * size


def _random_blocks(qtype: str, rows: int, row_bytes: int, rng) -> np.ndarray:
    """Random bytes: traffic does not depend on the values (NaN scales included)."""
    return rng.integers(0, 256, size=rows * row_bytes, dtype=np.uint8)


def paged_attention(dtype: str, q_lens, seq_lens, num_q_heads: int, num_kv_heads: int,
                    head_size: int, block_size: int = 16, partition_size: int = 512) -> Case:
    """Decode rows (q_len 1) first, then prefill chunks; each sequence's blocks are spread
    over a shuffled pool, as the block manager leaves them."""
    rng = np.random.default_rng(sum(seq_lens) + len(q_lens))
    s = _SIZE[dtype]
    q_lens, seq_lens = list(q_lens), list(seq_lens)
    num_seqs, tokens = len(q_lens), sum(q_lens)
    blocks_per_seq = [-(-L // block_size) for L in seq_lens]
    max_blocks = max(blocks_per_seq)
    num_blocks = sum(blocks_per_seq) + 3
    perm = rng.permutation(num_blocks).astype(np.int32)
    tables = np.zeros((num_seqs, max_blocks), np.int32)
    at = 0
    for i, nb in enumerate(blocks_per_seq):
        tables[i, :nb] = perm[at:at + nb]
        at += nb
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = _rand((tokens, num_q_heads, head_size), dtype, rng)
    kc = _rand((num_blocks, block_size, num_kv_heads, head_size), dtype, rng)
    vc = _rand(kc.shape, dtype, rng)
    out = _empty((tokens, num_q_heads, head_size), dtype)
    num_decode = sum(1 for n in q_lens if n == 1)
    plan = _core.plan_paged_attention(
        dtype, tokens, num_seqs, num_q_heads, num_kv_heads, head_size, block_size, num_blocks,
        max_blocks, num_decode_seqs=num_decode, max_seq_len=max(seq_lens), max_query_len=max(q_lens),
        scale=head_size ** -0.5, partition_size=partition_size)
    split = any("reduce" in l.kernel for l in plan)
    parts = max(1, plan[0].grid[2]) if split else 1
    # batch-invariant mode: every query token is a decode-kernel row with its own partitions
    split_rows = tokens if _core.batch_invariant() else num_decode
    rows = max(1, split_rows)
    scratch = [np.zeros((rows, num_q_heads, parts, head_size), np.float32),
               np.zeros((rows, num_q_heads, parts), np.float32),
               np.zeros((rows, num_q_heads, parts), np.float32)]
    arrays = [q, kc, vc, tables, np.array(seq_lens, np.int32), cu, np.zeros(1, np.float32), out, *scratch]
    kv_bytes = 2 * sum(seq_lens) * num_kv_heads * head_size * s
    # split-KV decode round-trips per (row, head, partition) a float32 partial output, max
    # and sum through memory: the price of filling the GPU, reported apart from the floor
    scratch = 2 * 4 * split_rows * num_q_heads * parts * (head_size + 2) if split else 0
    minimum = (2 * q.nbytes + kv_bytes + 4 * sum(blocks_per_seq) + 4 * num_seqs + 4 * (num_seqs + 1))
    flops = 4 * num_q_heads * head_size * sum(
        sum(L - n + 1 + j for j in range(n)) for n, L in zip(q_lens, seq_lens))
    name = (f"paged_attention(q={q_lens},ctx={seq_lens},hq={num_q_heads},hkv={num_kv_heads},"
            f"d={head_size},bs={block_size},{dtype})")
    return Case(name, plan, arrays, minimum, flops=flops, scratch=scratch)


_TYPE_IDS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12,
             "Q6_K": 14}  # GGML ids
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def decoder_layer(qtype, dtype: str, m: int, hidden: int, heads: int, kv_heads: int,
                  head_dim: int, intermediate: int, ctx: int = 100, sandwich: bool = False,
                  block_size: int = 16) -> Case:
    """The fused Metal decoder layer (plan_decoder_layer) over m decode rows of context
    `ctx` each, every projection of type qtype (or qtype[i] for the i-th of q, k, v, o,
    gate, up, down: a tuple of 7 names). The floor counts the layer's inputs and
    output, the weights, the K/V context and the new tokens' cache rows; `scratch` is what
    crosses between its dispatches (q, attention, residual stream, MLP activation; the
    layer input read again for the residual; gemma's pre-norm o and down outputs)."""
    rng = np.random.default_rng(m * hidden + ctx)
    s = _SIZE[dtype]
    spec = _core.DecoderLayerSpec()
    spec.hidden, spec.num_heads, spec.num_kv_heads = hidden, heads, kv_heads
    spec.head_dim, spec.intermediate = head_dim, intermediate
    spec.sandwich, spec.gelu, spec.qk_norm = sandwich, sandwich, sandwich
    types = (qtype,) * 7 if isinstance(qtype, str) else tuple(qtype)
    spec.types = [_TYPE_IDS[t] for t in types]
    spec.rotary_dim = head_dim
    spec.scale = head_dim ** -0.5
    table, mscale = _core.rope_turn_table(head_dim)
    spec.rope_mscale = mscale
    q_w, kv_w = heads * head_dim, kv_heads * head_dim
    dims = dict(q_proj=(q_w, hidden), k_proj=(kv_w, hidden), v_proj=(kv_w, hidden),
                o_proj=(hidden, q_w), gate_proj=(intermediate, hidden),
                up_proj=(intermediate, hidden), down_proj=(hidden, intermediate))
    weights = {n: _random_blocks(t, dims[n][0], _row_bytes(t, dims[n][1]), rng)
               for n, t in zip(_PROJECTIONS, types)}
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = m * blocks_per_seq + 2
    tables = rng.permutation(num_blocks)[:m * blocks_per_seq].astype(np.int32).reshape(m, -1)
    positions = np.full(m, ctx - 1, np.int32)
    slots = (tables[:, (ctx - 1) // block_size].astype(np.int64) * block_size
             + (ctx - 1) % block_size)
    cache = (num_blocks, block_size, kv_heads, head_dim)
    inputs = [_rand((m, hidden), dtype, rng), positions, slots, tables,
              np.full(m, ctx, np.int32), np.arange(m + 1, dtype=np.int32),
              _rand(cache, dtype, rng), _rand(cache, dtype, rng), np.array(table)]
    small = {"q_norm": head_dim, "k_norm": head_dim}
    for name in spec.weight_names():
        inputs.append(weights[name] if name in weights else _rand(small.get(name, hidden), dtype, rng))
    plan, outs = _core.plan_decoder_layer(spec, dtype, m, m, num_blocks, block_size,
                                          blocks_per_seq, m, ctx, 1)
    outputs = [np.zeros(shape, _NP[dt]) for shape, dt in outs]
    norms = sum(a.nbytes for n, a in zip(spec.weight_names(), inputs[9:]) if n not in weights)
    minimum = (sum(w.nbytes for w in weights.values()) + 2 * m * hidden * s + norms
               + positions.nbytes + slots.nbytes + np.array(table).nbytes + tables.nbytes
               + 4 * (2 * m + 1) + 2 * m * ctx * kv_w * s + 2 * m * kv_w * s)
    # split-KV attention (long contexts, few rows): per (row, q head, partition) a float32
    # partial output, max and sum written by the decode kernel and read back once (unique
    # bytes count the o projection's threadgroups' reads once), as kt.paged_attention's
    partial_out = outs[_PARTIAL_OUT][0]
    parts = partial_out[2] if len(partial_out) == 4 else 1
    partials = 2 * 4 * m * heads * parts * (head_dim + 2) if parts > 1 else 0
    # the o projection folds the reduce in (combines the partitions while staging its
    # input): the attention output then never crosses
    folded = parts > 1 and not any("reduce" in l.kernel for l in plan)
    # per row: q and attention (write + read; not when folded), the MLP activation (write
    # + read), x read again; llama: h written by o, read by gate/up and down; gemma: o, h,
    # down twice each
    crossing = (2 * q_w + (0 if folded else 2 * q_w) + 2 * intermediate + hidden
                + (6 * hidden if sandwich else 3 * hidden))
    flops = 2 * m * sum(r * c for r, c in dims.values()) + 4 * heads * head_dim * m * ctx
    tname = qtype if isinstance(qtype, str) else "/".join(types)
    name = (f"decoder_layer({tname},{dtype},m={m},hidden={hidden},heads={heads}/{kv_heads},"
            f"d={head_dim},I={intermediate},ctx={ctx}{',gemma' if sandwich else ''})")
    return Case(name, plan, inputs + outputs, minimum, flops=flops,
                scratch=m * crossing * s + partials, spec=spec, dtype=dtype)


_MATVEC_KERNELS = ("layer_qkv", "layer_matvec", "layer_gate_up")


def decoder_layer_lanes(case: Case, traffic: Traffic | None = None) -> list[dict]:
    """Lane use of each mat-vec launch of a fused decoder_layer case (layer_qkv, layer_matvec
    for o, layer_gate_up, layer_matvec for down, in plan order) next to the per-op
    gguf_matvec kernel's at the same (type, m, n, k): dicts of kernel, k, lane_use and
    gguf_matvec."""
    traffic = traffic or measure(case)
    spec, dtype = case.spec, case.dtype
    m = case.arrays[0].shape[0]
    hid, q_w, inter = spec.hidden, spec.num_heads * spec.head_dim, spec.intermediate
    names = {v: n for n, v in _TYPE_IDS.items()}
    t = [names[int(i)] for i in spec.types]
    # (k, type, n) of each launch, in plan order
    todo = {"layer_qkv": [(hid, t[0], q_w)],
            "layer_matvec": [(q_w, t[3], hid), (inter, t[6], hid)],
            "layer_gate_up": [(hid, t[4], inter)]}
    rows = []
    for launch in traffic.launches:
        kind = launch.kernel.rsplit("_", 1)[0]
        if kind not in _MATVEC_KERNELS:
            continue
        k, qtype, n = todo[kind].pop(0)
        ref = measure(gguf_matvec(qtype, dtype, m, n, k)).lane_use
        rows.append({"kernel": kind, "k": k, "lane_use": launch.lane_use, "gguf_matvec": ref})
    return rows
