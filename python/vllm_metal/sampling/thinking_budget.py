"""thinking_token_budget: once a request has spent its budget inside a thinking section,
the end-of-thinking tokens are forced, one per step (vLLM's contract, as its Model Runner
V2 applies it in vllm/v1/worker/gpu/sample/thinking_budget.py).

Per step and per request with a budget, from the request's tokens so far (prompt +
output, the packer's): the section is open when the last start marker (reasoning_start
token ids) comes after the last natural end marker (the reasoning parser's end); the
tokens after the start marker count, prompt tokens included; at `budget` or more, the next
token of the forced end sequence (reasoning_end token ids; its prefix already at the tail
is skipped) is the only one allowed. The sampler sets every other logit of the row to -inf
after its logits processing (force_tokens), so raw logprobs still score the model's own
distribution and the row's random draw is consumed as on any step.

The state is recomputed from the tokens each step (no counters to keep in sync with
preemption, prefix caching or resumed requests); the runner waits for the previous step's
tokens when a row in the step has a budget (async scheduling stays on).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from vllm_metal.sampling.rows import put as put_rows

NO_BUDGET = -1


class ThinkingBudget:
    def __init__(self, start_ids, natural_end_ids, end_ids, rows: int = 64) -> None:
        self.start_ids = np.asarray(start_ids, np.int64)  # [S] opens a section
        self.natural_end_ids = np.asarray(natural_end_ids, np.int64)  # [N] closes one
        self.end_ids = np.asarray(end_ids, np.int64)  # [E] forced when the budget is spent
        self.budget = np.full(rows, NO_BUDGET, np.int64)  # request row -> budget

    @classmethod
    def from_config(cls, vllm_config, rows: int) -> "ThinkingBudget | None":
        """None unless vLLM's reasoning config has its marker token ids (--reasoning-parser);
        without them vLLM's front end refuses thinking_token_budget itself."""
        rc = getattr(vllm_config, "reasoning_config", None)
        if rc is None or not getattr(rc, "enabled", False):
            return None
        start, end = rc.reasoning_start_token_ids, rc.reasoning_end_token_ids
        natural = rc.natural_reasoning_end_token_ids or end
        if not (start and end and natural):
            return None
        return cls(start, natural, end, rows)

    def add(self, row: int, params) -> None:
        """The request at `row` (its BatchPacker / SamplingTable row) and its budget."""
        if row >= len(self.budget):
            grown = np.full(max(row + 1, 2 * len(self.budget)), NO_BUDGET, np.int64)
            grown[:len(self.budget)] = self.budget
            self.budget = grown
        b = getattr(params, "thinking_token_budget", None)
        self.budget[row] = NO_BUDGET if b is None else int(b)

    def used(self, rows: np.ndarray) -> bool:
        """Whether a row of the step has a budget (then its tokens must be real, not
        placeholders of the step still computing)."""
        rows = rows[rows < len(self.budget)]
        return bool((self.budget[rows] >= 0).any())

    def forced(self, rows: np.ndarray, req_ids, token_ids_of) -> tuple[np.ndarray, np.ndarray] | None:
        """(batch index, token) for the rows whose next token is forced; rows: int [B]
        request rows in batch order, req_ids their ids, token_ids_of(req_id) -> prompt +
        output token ids."""
        batch_idx, tokens = [], []
        known = rows < len(self.budget)
        for i in np.flatnonzero(known):
            budget = self.budget[rows[i]]
            if budget < 0:
                continue
            token = self.forced_token(np.asarray(token_ids_of(req_ids[i]), np.int64), int(budget))
            if token is not None:
                batch_idx.append(i)
                tokens.append(token)
        if not batch_idx:
            return None
        return np.array(batch_idx, np.int32), np.array(tokens, np.int32)

    def forced_token(self, ids: np.ndarray, budget: int) -> int | None:
        """The token forced after `ids` (int [L]), or None."""
        start = last_index(ids, self.start_ids)
        if start < 0 or start <= last_index(ids, self.natural_end_ids):
            return None  # not inside a thinking section
        if len(ids) - (start + len(self.start_ids)) < budget:
            return None
        # the forced sequence may be under way: continue after the longest prefix of it
        # the tokens end with
        done = 0
        for k in range(1, min(len(self.end_ids), len(ids) + 1)):
            if np.array_equal(ids[len(ids) - k:], self.end_ids[:k]):
                done = k
        return int(self.end_ids[done])


def last_index(ids: np.ndarray, pattern: np.ndarray) -> int:
    """Where the last occurrence of `pattern` in `ids` starts, or -1."""
    k = len(pattern)
    if k == 0 or len(ids) < k:
        return -1
    if k == 1:
        hits = np.flatnonzero(ids == pattern[0])
    else:
        windows = np.lib.stride_tricks.sliding_window_view(ids, k)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
    return int(hits[-1]) if len(hits) else -1


def force_tokens(x: mx.array, forced: tuple[np.ndarray, np.ndarray] | None) -> mx.array:
    """float [B, V] with rows forced[0] allowed only their token forced[1] (logit 0, the
    rest -inf); other rows unchanged."""
    if forced is None:
        return x
    batch_idx, toks = forced
    only = mx.where(mx.arange(x.shape[-1])[None, :] == mx.array(toks)[:, None],
                    mx.array(0.0, x.dtype), mx.array(float("-inf"), x.dtype))  # [n, V]
    return put_rows(only, batch_idx, x)
