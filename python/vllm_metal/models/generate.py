"""A minimal paged-cache driver: KV pool, block tables and AttentionContext
built with NumPy, and greedy generation over a packed batch.

For tests, smoke checks and `python -m vllm_metal.models ... --prompt`; the
model runner (with vLLM's scheduler and the C++ batch packer) is the real one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from vllm_metal.models.context import AttentionContext

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


class KVPool:
    """Per-layer K/V caches [num_blocks, block_size, kv_heads, head_dim] and a free list."""

    def __init__(self, spec, num_blocks: int, block_size: int = 16):
        self.block_size = block_size
        dtype = _DTYPES[spec.dtype]
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.kv_caches = [(mx.zeros(shape, dtype), mx.zeros(shape, dtype))
                          for _ in range(spec.num_layers)]
        self.free = list(range(num_blocks - 1, -1, -1))

    def allocate(self, table: list[int], num_tokens: int) -> None:
        """Grow `table` so it covers `num_tokens` positions."""
        while len(table) * self.block_size < num_tokens:
            if not self.free:
                raise RuntimeError("KV pool out of blocks")
            table.append(self.free.pop())

    def release(self, table: list[int]) -> None:
        self.free.extend(table)
        table.clear()


@dataclass
class SeqChunk:
    """One sequence's share of a step: `tokens` at positions num_computed.."""
    tokens: list[int]
    num_computed: int
    block_table: list[int]
    logits: str = "last"  # "last" | "all" | "none": which of its rows need logits


@dataclass
class PackedStep:
    input_ids: mx.array
    ctx: AttentionContext
    row_of_logit: list = field(default_factory=list)  # (chunk index, token index) per logits row


def build_step(chunks: list[SeqChunk], kv_caches: list, block_size: int) -> PackedStep:
    """Pack chunks into one step. Decode chunks (one token) must come first."""
    q_lens = [len(c.tokens) for c in chunks]
    num_decode = 0
    while num_decode < len(chunks) and q_lens[num_decode] == 1:
        num_decode += 1
    ids, positions, slots, logits_rows, row_of_logit = [], [], [], [], []
    row = 0
    for ci, c in enumerate(chunks):
        for j, tok in enumerate(c.tokens):
            pos = c.num_computed + j
            ids.append(tok)
            positions.append(pos)
            slots.append(c.block_table[pos // block_size] * block_size + pos % block_size)
            if c.logits == "all" or (c.logits == "last" and j == len(c.tokens) - 1):
                logits_rows.append(row)
                row_of_logit.append((ci, j))
            row += 1
    max_blocks = max(len(c.block_table) for c in chunks)
    tables = np.zeros((len(chunks), max_blocks), np.int32)
    for i, c in enumerate(chunks):
        tables[i, : len(c.block_table)] = c.block_table
    seq_lens = [c.num_computed + len(c.tokens) for c in chunks]
    ctx = AttentionContext(
        positions=mx.array(np.array(positions, np.int32)),
        slot_mapping=mx.array(np.array(slots, np.int64)),
        block_tables=mx.array(tables),
        seq_lens=mx.array(np.array(seq_lens, np.int32)),
        cu_seqlens_q=mx.array(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)),
        num_decode_seqs=num_decode,
        max_seq_len=max(seq_lens),
        max_query_len=max(q_lens),
        logits_indices=mx.array(np.array(logits_rows, np.int32)),
        kv_caches=kv_caches,
    )
    return PackedStep(mx.array(np.array(ids, np.int32)), ctx, row_of_logit)


def greedy_generate(loaded, prompts: list[list[int]], max_tokens: int, *, block_size: int = 16,
                    prefill_chunk: int = 512, stop_ids: list[int] | None = None,
                    step_times: list | None = None) -> list[list[int]]:
    """Greedy continuation of every prompt, all decoded together in packed steps.

    Prefill runs in chunks of at most `prefill_chunk` tokens per sequence,
    packed behind the decode rows of sequences already generating.
    `step_times`, if given, receives per step (decode rows, prefill tokens,
    seconds from building the step to its tokens on the host).
    """
    import time

    stop = set(loaded.eos_token_ids if stop_ids is None else stop_ids)
    max_len = max(len(p) for p in prompts) + max_tokens
    blocks_per_seq = -(-max_len // block_size)
    pool = KVPool(loaded.spec, blocks_per_seq * len(prompts) + 1, block_size)
    tables = [[] for _ in prompts]
    computed = [0] * len(prompts)
    outputs = [[] for _ in prompts]
    done = [False] * len(prompts)
    while not all(done):
        decode, prefill = [], []
        for i, prompt in enumerate(prompts):
            if done[i]:
                continue
            if computed[i] < len(prompt):
                toks = prompt[computed[i]: computed[i] + prefill_chunk]
                last = computed[i] + len(toks) == len(prompt)
                prefill.append((i, toks, "last" if last else "none"))
            else:
                decode.append((i, [outputs[i][-1]], "last"))
        order = decode + prefill
        t0 = time.perf_counter()
        chunks = []
        for i, toks, logits in order:
            pool.allocate(tables[i], computed[i] + len(toks))
            chunks.append(SeqChunk(toks, computed[i], tables[i], logits))
        step = build_step(chunks, pool.kv_caches, block_size)
        logits = loaded.model(step.input_ids, step.ctx)
        next_ids = mx.argmax(logits, axis=-1) if step.row_of_logit else mx.zeros((0,), mx.uint32)
        mx.eval(next_ids, step.ctx.kv_caches)
        pool.kv_caches = step.ctx.kv_caches
        next_ids = next_ids.tolist()
        if step_times is not None:
            step_times.append((len(decode), sum(len(t) for _, t, _ in prefill),
                               time.perf_counter() - t0))
        for i, toks, _ in order:
            computed[i] += len(toks)
        for (ci, _), tok in zip(step.row_of_logit, next_ids):
            i = order[ci][0]
            outputs[i].append(tok)
            if tok in stop or len(outputs[i]) >= max_tokens:
                done[i] = True
    return outputs
