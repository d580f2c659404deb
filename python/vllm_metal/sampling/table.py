"""The persistent per-request sampling table, by request-table row.

Parameters are written once, when a request is added (the same row as in the
BatchPacker's table, so a step gathers them with ``packer.req_rows`` and does
no Python work per request). Features that need per-request lists (logit_bias,
allowed_token_ids, bad_words, min_tokens stop ids, penalties' token history)
keep a flag per row, so a step only visits the rows that use them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_metal.sampling.rng import fresh_seed

GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: temperatures below it are greedy
NO_LOGPROBS = -2  # num_logprobs of a request that asked for none (-1 means all)


@dataclass
class RowExtras:
    """The per-request lists of one row (only for rows that use them)."""
    bias_ids: np.ndarray | None = None  # int32 [n]
    bias_values: np.ndarray | None = None  # float32 [n]
    allowed_ids: np.ndarray | None = None  # int32 [n]
    bad_words: list[list[int]] | None = None
    stop_ids: np.ndarray | None = None  # int32 [n]: EOS + stop_token_ids (min_tokens)
    prompt_ids: np.ndarray | None = None  # int32 [prompt_len] (prompt logprobs)
    logprob_ids: np.ndarray | None = None  # int32 [n]: logprob_token_ids
    # prompt_logprob_token_ids: int32 [rows, n] (-1 pads), scoring prompt rows from
    # prompt_score_start on (row i predicts prompt token prompt_score_start + i + 1)
    prompt_score_ids: np.ndarray | None = None
    prompt_score_start: int = 0
    seed: int | None = None  # the request's own seed (the torch sampler's generator)


class SamplingTable:
    _FLOAT = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
              "presence_penalty")
    _INT = ("top_k", "prompt_len", "min_tokens", "num_logprobs", "num_prompt_logprobs")
    # structured: the request's output follows a grammar (its bitmask comes per step)
    _FLAG = ("has_bias", "has_allowed", "has_bad_words", "needs_history", "structured",
             "has_logprob_ids", "has_prompt_ids")

    def __init__(self, vocab_size: int, rows: int = 64, seed: int | None = None) -> None:
        self.vocab_size = vocab_size
        self._rng = np.random.default_rng(seed)
        self.req_ids: list[str | None] = []
        self.extras: list[RowExtras | None] = []
        self.row_of: dict[str, int] = {}
        self.seed = np.zeros(0, np.uint64)
        for name in self._FLOAT:
            setattr(self, name, np.zeros(0, np.float32))
        for name in self._INT:
            setattr(self, name, np.zeros(0, np.int32))
        for name in self._FLAG:
            setattr(self, name, np.zeros(0, bool))
        self._grow(rows)

    def _grow(self, rows: int) -> None:
        old = len(self.req_ids)
        if rows <= old:
            return
        for name in ("seed", *self._FLOAT, *self._INT, *self._FLAG):
            a = getattr(self, name)
            b = np.zeros(rows, a.dtype)
            b[:old] = a
            setattr(self, name, b)
        self.req_ids += [None] * (rows - old)
        self.extras += [None] * (rows - old)

    # ---- request lifetime ---------------------------------------------------------
    def add(self, row: int, req_id: str, params, prompt_token_ids, prompt_len: int,
            *, resumed: bool = False) -> None:
        """Writes the request's parameters at ``row`` (its BatchPacker row).
        resumed: it comes back with outputs (V2 preemption), its prompt
        logprobs went out already."""
        self._grow(max(row + 1, 2 * len(self.req_ids)) if row >= len(self.req_ids) else 0)
        old = self.req_ids[row]
        if old is not None and old != req_id:
            self.row_of.pop(old, None)  # the packer reused the row of a request gone earlier
        self.remove([req_id])
        self.req_ids[row] = req_id
        self.row_of[req_id] = row
        v = self.vocab_size
        temp = float(params.temperature)
        self.temperature[row] = temp
        k = int(params.top_k or 0)
        self.top_k[row] = v if k <= 0 or k >= v else k  # vocab size: no top-k
        self.top_p[row] = float(params.top_p)
        self.min_p[row] = float(params.min_p or 0.0)
        self.repetition_penalty[row] = float(params.repetition_penalty)
        self.frequency_penalty[row] = float(params.frequency_penalty)
        self.presence_penalty[row] = float(params.presence_penalty)
        self.prompt_len[row] = prompt_len
        self.min_tokens[row] = int(params.min_tokens or 0)
        n = params.logprobs
        ids = getattr(params, "logprob_token_ids", None)
        if n is None and ids:
            n = len(ids)  # vLLM's SamplingParams.num_logprobs
        self.num_logprobs[row] = NO_LOGPROBS if n is None else (v if n == -1 else int(n))
        n = None if resumed else params.prompt_logprobs
        self.num_prompt_logprobs[row] = NO_LOGPROBS if n is None else (v if n == -1 else int(n))
        self.seed[row] = fresh_seed(self._rng) if params.seed is None else int(params.seed) % 2**64

        x = RowExtras(seed=params.seed)
        if params.logit_bias:
            items = [(int(t), float(b)) for t, b in params.logit_bias.items()]
            x.bias_ids = np.array([t for t, _ in items], np.int32)
            x.bias_values = np.array([b for _, b in items], np.float32)
        if params.allowed_token_ids:
            x.allowed_ids = np.array(params.allowed_token_ids, np.int32)
        bad = getattr(params, "bad_words_token_ids", None)
        if bad:
            x.bad_words = [list(w) for w in bad]
        if self.min_tokens[row] > 0:
            x.stop_ids = np.array(sorted(params.all_stop_token_ids), np.int32)
        if ids:
            x.logprob_ids = np.array(ids, np.int32)
        prompt_ids = getattr(params, "prompt_logprob_token_ids", None)
        if prompt_ids is not None and not resumed:  # resumed: its scores went out already
            x.prompt_score_ids = np.asarray(prompt_ids, np.int32).reshape(len(prompt_ids), -1)
            x.prompt_score_start = int(params.prompt_logprob_start or 0)
        if self.num_prompt_logprobs[row] != NO_LOGPROBS:
            x.prompt_ids = np.array(prompt_token_ids, np.int32)
        self.extras[row] = x
        self.has_bias[row] = x.bias_ids is not None
        self.has_allowed[row] = x.allowed_ids is not None
        self.has_bad_words[row] = x.bad_words is not None
        self.structured[row] = getattr(params, "structured_outputs", None) is not None
        self.has_logprob_ids[row] = x.logprob_ids is not None
        self.has_prompt_ids[row] = x.prompt_score_ids is not None
        self.needs_history[row] = (x.bad_words is not None
                                   or self.repetition_penalty[row] != 1.0
                                   or self.frequency_penalty[row] != 0.0
                                   or self.presence_penalty[row] != 0.0)

    def remove(self, req_ids) -> None:
        for req_id in req_ids:
            row = self.row_of.pop(req_id, None)
            if row is not None:
                self.req_ids[row] = None
                self.extras[row] = None
                self.has_bias[row] = self.has_allowed[row] = False
                self.has_bad_words[row] = self.needs_history[row] = False
                self.structured[row] = self.has_logprob_ids[row] = False
                self.has_prompt_ids[row] = False

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.row_of

    def __len__(self) -> int:
        return len(self.row_of)
