"""Speculative proposers that read the target's hidden states: a head (mtp.py's MTP
block, eagle3.py's EAGLE3 head) drafting from each step's rows.

When it runs. The head's row q needs the token at q + 1, which for a step's last rows is
the token the step samples. So the head runs after the step's tokens are read, in
propose: first one pass over every row of that step (the next tokens from the packer's
histories; rows past a request's kept tokens get a placeholder, and the next step writes
their positions again), which fills the head's KV cache for every computed position;
then, for the requests that sampled, draft 1 from the row of their last kept input (the
row at P - 1, P being the newest token's position), and k - 1 decode passes at P, P + 1,
..., each fed the head's own output (the target's state for those positions does not
exist yet, as in vLLM). Drafts are the argmax: the verifier's rejection rule keeps random
sampling exact.

Its KV cache is one attention layer, indexed by the target's block ids (as
draft_model.py's), its bytes out of the same budget (draft_model.draft_share). The
target's states for a step are recorded lazily with it and evaluated in the same
evaluation (step_arrays).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from vllm_metal.draft_model import decode_context, held_block_tables
from vllm_metal.models import AttentionContext


@dataclass
class _StepRecord:
    """What pass 1 needs of a target step: its rows and the target's states the head reads."""

    req_ids: list
    positions: np.ndarray       # int64 [T]
    cu_seqlens_q: np.ndarray    # int64 [n + 1]
    fields: dict                # the step's AttentionContext fields (mx arrays)
    hidden: mx.array            # [T, ...], lazy until the step is evaluated


class HeadDraft:
    """The runner's proposer for a head that reads the target's hidden states (the same
    role as draft_model.DraftModel). `head` (mtp.MtpHead, eagle3.Eagle3Head) provides:
    name, cache_shape (kv heads, head dim), dtype; prepare_target(ctx) (what the target's
    forward must keep) and target_states(ctx) (those states, [T, ...]); first(embeds,
    states, ctx) and next(embeds, feed, ctx), each -> (hidden for the logits, what the
    next pass is fed); draft_ids(hidden) (target vocabulary ids, int32); embed(ids)."""

    needs_target_hidden = True

    def __init__(self, head, num_speculative_tokens: int, max_model_len: int) -> None:
        self.head = head
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.kv_caches: list = []
        self.block_size = 0
        self._cache_shape = head.cache_shape
        self._dtype = head.dtype
        self._steps: deque[_StepRecord] = deque()

    # ---- memory ---------------------------------------------------------------------------
    def bytes_per_block(self, block_size: int, max_num_seqs: int) -> int:
        heads, dim = self._cache_shape
        return 2 * block_size * heads * dim * self._dtype.size

    def allocate(self, block_size: int, num_blocks: int, max_num_seqs: int) -> str:
        heads, dim = self._cache_shape
        shape = (num_blocks, block_size, heads, dim)
        self.kv_caches = [(mx.zeros(shape, self._dtype), mx.zeros(shape, self._dtype))]
        mx.eval(self.kv_caches)
        self.block_size = block_size
        mib = self.bytes_per_block(block_size, max_num_seqs) * num_blocks / 2**20
        return f"{self.head.name}, 1 attention layer ({mib:.1f} MiB)"

    # ---- each target step -----------------------------------------------------------------
    def prepare_target(self, ctx) -> None:
        self.head.prepare_target(ctx)

    def forward_step(self, input_ids: mx.array, fields: dict, *, target_ctx=None,
                     req_ids=()) -> None:
        """Records the step (its rows, the target's states the head reads) for propose."""
        self._steps.append(_StepRecord(
            req_ids=list(req_ids), positions=np.array(fields["positions"], np.int64),
            cu_seqlens_q=np.array(fields["cu_seqlens_q"], np.int64), fields=fields,
            hidden=self.head.target_states(target_ctx)))
        while len(self._steps) > 4:  # warm-up or unread steps: never proposed from
            self._steps.popleft()

    def step_arrays(self) -> list:
        """Evaluated with the step: the hidden states pass 1 reads later."""
        return [s.hidden for s in self._steps]

    # ---- proposing -----------------------------------------------------------------------
    def propose_for(self, packer, ids: list[str], step_req_ids: list[str], group: int) -> np.ndarray:
        """Pass 1 over the step that just sampled (step_req_ids), then greedy drafts [n, k']
        for the requests ids (-1 past a request's room)."""
        rec = self._take(step_req_ids)
        histories = {r: packer.token_ids(r) for r in rec.req_ids if r in packer}
        nxt = np.zeros(len(rec.positions), np.int32)
        for b, r in enumerate(rec.req_ids):
            h = histories.get(r)
            if h is None:
                continue
            lo, hi = int(rec.cu_seqlens_q[b]), int(rec.cu_seqlens_q[b + 1])
            want = rec.positions[lo:hi] + 1
            ok = want < len(h)
            nxt[lo:hi][ok] = np.asarray(h)[want[ok]]
        ctx = AttentionContext(**{**rec.fields, "kv_caches": self.kv_caches})
        out, feed = self.head.first(self.head.embed(mx.array(nxt)), rec.hidden, ctx)
        self.kv_caches = ctx.kv_caches
        n = len(ids)
        if n == 0:
            mx.eval(self.kv_caches)
            return np.zeros((0, 0), np.int64)
        # the row of each request's last kept input: position P - 1 (P: its newest token)
        where = {r: b for b, r in enumerate(rec.req_ids)}
        rows, newest = np.empty(n, np.int64), np.empty(n, np.int64)
        for i, r in enumerate(ids):
            b, p = where[r], len(histories[r]) - 1
            lo, hi = int(rec.cu_seqlens_q[b]), int(rec.cu_seqlens_q[b + 1])
            rows[i] = lo + (p - 1 - int(rec.positions[lo]))
            if not lo <= rows[i] < hi:
                raise RuntimeError(f"[vllm-metal] {self.head.name}: request {r!r} sampled position {p} "
                                   "outside its step's rows")
            newest[i] = p
        tables, num_blocks = held_block_tables(packer, ids, group)
        # draft j sits at P + j (below max_model_len); pass j >= 2 writes position P + j - 2
        room = np.minimum(self.max_model_len - 1 - newest, num_blocks * self.block_size - newest + 1)
        steps = int(min(self.k, room.max(initial=0)))
        drafts = np.full((n, max(steps, 0)), -1, np.int64)
        if steps <= 0:
            mx.eval(self.kv_caches)
            return drafts
        pick = mx.array(rows)
        feed = feed[pick]
        ids_j = self.head.draft_ids(out[pick])
        got = [ids_j]
        for j in range(2, steps + 1):
            pos = np.minimum(newest + j - 2, self.max_model_len - 1).astype(np.int64)
            ctx = decode_context(pos, tables, self.block_size, j <= room, self.kv_caches)
            out, feed = self.head.next(self.head.embed(ids_j), feed, ctx)
            self.kv_caches = ctx.kv_caches
            ids_j = self.head.draft_ids(out)
            got.append(ids_j)
        values = np.array(mx.stack(got, axis=1))
        mx.eval(self.kv_caches)
        keep = np.arange(1, steps + 1)[None, :] <= room[:, None]
        drafts[keep] = values[keep]
        return drafts

    def _take(self, step_req_ids: list[str]) -> _StepRecord:
        while self._steps:
            rec = self._steps.popleft()
            if rec.req_ids == list(step_req_ids):
                return rec
        raise RuntimeError(f"[vllm-metal] {self.head.name}: no recorded target step for the "
                           "step being read")
