"""A draft model on the worker (speculative method "draft_model"): a second, smaller
model that proposes each request's next tokens greedily, verified by the target.

Its KV cache. The draft keeps its own K/V per layer, indexed by the target's block ids
(same block size, same block count): the target's block tables address both. So that
the draft's cache always holds every token the target has computed, the draft runs on
each step's packed batch too (the same positions and slots as the target: prompt chunks,
decode tokens and drafts), lazily, in the same evaluation as the target. After a step,
a request's kept tokens are in both caches; its new token (the target's sample) is not.

Proposing. For the requests that just sampled, k decode passes of the draft, one query
row each: the new token at its position, then each argmax in turn. They write positions
pos .. pos + k - 1, inside the k lookahead slots vLLM reserves for this method
(VllmConfig.num_lookahead_tokens), and capped below max_model_len. The next step's
forward writes the same positions again with the same tokens (kept drafts) or other
ones (after a rejection), so nothing needs rolling back. Drafts are the argmax: a
one-hot draft distribution, for which the verifier's rejection rule (sampling/verify.py)
keeps the target's distribution exactly.

Memory. The draft's blocks come out of the same KV budget: the worker shrinks what it
offers vLLM by target / (target + draft) bytes per block, so the blocks vLLM counts fit
both caches (draft_share).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from vllm_metal import kv_plan
from vllm_metal.models import AttentionContext, load_model


class DraftModel:
    def __init__(self, model_path: str, dtype: str | None, num_speculative_tokens: int,
                 max_model_len: int) -> None:
        self.loaded = load_model(model_path, dtype)
        if self.loaded.hybrid is not None:
            raise ValueError(f"[vllm-metal] draft model {model_path}: a hybrid (linear-attention) "
                             "draft is not supported; use an attention-only draft model")
        self.model = self.loaded.model
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.kv_caches: list = []
        self.block_size = 0

    def bytes_per_block(self, block_size: int, max_num_seqs: int) -> int:
        return kv_plan.size(self.loaded, block_size=block_size, max_num_seqs=max_num_seqs,
                            speculative=False).bytes_per_block

    def allocate(self, block_size: int, num_blocks: int, max_num_seqs: int) -> str:
        """K/V per draft layer for the target's block count; returns the summary line."""
        plan = kv_plan.plan(self.loaded, block_size=block_size, num_blocks=num_blocks,
                            max_num_seqs=max_num_seqs, speculative=False)
        self.kv_caches = [(mx.zeros(layer.cache_shape, getattr(mx, layer.dtype)),
                           mx.zeros(layer.cache_shape, getattr(mx, layer.dtype)))
                          for layer in plan.layers]
        mx.eval(self.kv_caches)
        self.block_size = block_size
        return plan.description

    needs_target_hidden = False

    def prepare_target(self, ctx) -> None:
        """Nothing: the draft reads tokens, not the target's states (head_draft.py does)."""

    def forward_step(self, input_ids: mx.array, fields: dict, **_) -> mx.array:
        """The draft over the target's packed step (same positions, slots, block tables):
        writes the step's tokens into the draft's cache. Returns the lazy logits of the
        step's sampled rows (unused: evaluating them pulls the cache writes)."""
        ctx = AttentionContext(**{**fields, "kv_caches": self.kv_caches})
        logits = self.model(input_ids, ctx)
        self.kv_caches = ctx.kv_caches
        return logits

    def step_arrays(self) -> list:
        return []

    def propose_for(self, packer, ids: list[str], step_req_ids: list[str], group: int) -> np.ndarray:
        """Greedy drafts [n, k'] for the requests ids that just sampled (-1 past a
        request's room); step_req_ids is unused (the draft ran with the step)."""
        histories = [packer.token_ids(r) for r in ids]  # copies: read each once
        last = np.array([h[-1] for h in histories], np.int64)
        positions = np.array([len(h) - 1 for h in histories], np.int64)
        tables, num_blocks = held_block_tables(packer, ids, group)
        return self.propose(last, positions, tables, num_blocks)

    def propose(self, tokens: np.ndarray, positions: np.ndarray, block_tables: np.ndarray,
                num_blocks: np.ndarray) -> np.ndarray:
        """Greedy drafts [n, k'] for n requests whose newest token tokens[i] sits at
        positions[i] (not yet in the draft's cache), with their block tables [n, width]
        (zero-padded past num_blocks[i], the blocks the request holds). A request's room:
        its drafts before max_model_len and inside its own blocks (a write past them would
        land in block 0, another request's); k' = min(k, the largest room), and a row's
        drafts past its own room are -1."""
        n = len(tokens)
        room = np.minimum(self.max_model_len - 1 - positions,
                          num_blocks * self.block_size - positions)
        steps = int(min(self.k, room.max(initial=0)))
        out = np.full((n, max(steps, 0)), -1, np.int64)
        if n == 0 or steps <= 0:
            return out
        ids = mx.array(tokens.astype(np.int32))
        drafts = []
        for j in range(steps):
            pos = np.minimum(positions + j, self.max_model_len - 1).astype(np.int64)
            ctx = decode_context(pos, block_tables, self.block_size, j < room, self.kv_caches)
            logits = self.model(ids, ctx)
            self.kv_caches = ctx.kv_caches
            ids = mx.argmax(logits, axis=-1).astype(mx.int32)
            drafts.append(ids)
        got = np.array(mx.stack(drafts, axis=1))
        mx.eval(self.kv_caches)
        keep = np.arange(steps)[None, :] < room[:, None]
        out[keep] = got[keep]
        return out


def draft_share(target_bytes_per_block: int, draft_bytes_per_block: int) -> float:
    """The part of the KV budget to offer vLLM for the target's blocks, so that the block
    count it picks also fits the draft's cache."""
    return target_bytes_per_block / (target_bytes_per_block + draft_bytes_per_block)


def held_block_tables(packer, ids: list[str], group: int) -> tuple[np.ndarray, np.ndarray]:
    """[n, width] tables of every block each request holds (zero-padded), and the counts:
    the step's own table stops at its tokens, drafts go into the lookahead blocks after."""
    held = [packer.block_ids(r)[group] for r in ids]
    tables = np.zeros((len(ids), max(len(b) for b in held)), np.int32)
    for i, b in enumerate(held):
        tables[i, :len(b)] = b
    return tables, np.array([len(b) for b in held], np.int64)


def decode_context(pos: np.ndarray, block_tables: np.ndarray, block_size: int, write: np.ndarray,
                   kv_caches: list) -> AttentionContext:
    """One query row per request at positions pos (int64 [n]) over its held blocks
    (block_tables [n, width]); rows where `write` is False write no K/V (past the
    request's room: the row is dropped)."""
    n = len(pos)
    seqs = np.arange(n + 1, dtype=np.int32)
    width = int(pos.max()) // block_size + 1
    table = block_tables[:, :width]
    slots = table[np.arange(n), np.minimum(pos // block_size, width - 1)].astype(np.int64)
    slots = slots * block_size + pos % block_size
    slots[~write] = -1
    return AttentionContext(
        positions=mx.array(pos.astype(np.int32)), slot_mapping=mx.array(slots),
        block_tables=mx.array(np.ascontiguousarray(table, np.int32)),
        seq_lens=mx.array((pos + 1).astype(np.int32)), cu_seqlens_q=mx.array(seqs),
        num_decode_seqs=n, max_seq_len=int(pos.max()) + 1, max_query_len=1,
        logits_indices=mx.array(seqs[:-1]), kv_caches=kv_caches)
