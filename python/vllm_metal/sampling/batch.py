"""One step's sampling parameters: the table's rows gathered in batch order.

Everything per request is a NumPy array gathered with the step's rows (no
Python loop); only rows flagged in the table for list-valued features
(logit_bias, allowed_token_ids, bad_words, penalties, min_tokens) are visited,
and a stage whose flag is off for the whole batch is skipped by the sampler.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vllm_metal.sampling.rng import accept_uniforms, uniforms
from vllm_metal.sampling.table import GREEDY_EPS, NO_LOGPROBS, SamplingTable
from vllm_metal.sampling.token_logprobs import pad_token_ids


@dataclass
class SamplingBatch:
    vocab_size: int
    temperature: np.ndarray  # float32 [B]; < GREEDY_EPS: greedy
    top_k: np.ndarray  # int32 [B]; vocab_size: off
    top_p: np.ndarray  # float32 [B]; 1: off
    min_p: np.ndarray  # float32 [B]; 0: off
    repetition_penalty: np.ndarray  # float32 [B]
    frequency_penalty: np.ndarray  # float32 [B]
    presence_penalty: np.ndarray  # float32 [B]
    uniforms: np.ndarray  # float64 [B]: this step's draw of each request
    max_num_logprobs: int | None = None  # None: no row wants logprobs
    logprob_rows: np.ndarray | None = None  # bool [B]: rows that asked for logprobs
    # logprob_token_ids: int32 [B, K], each row's ids then -1 (None: no row has ids)
    logprob_ids: np.ndarray | None = None
    num_top_logprobs: int = 0  # the top n of the logprob rows without ids
    custom: object | None = None  # custom_processors.CustomProcessors active on the step
    # (batch index, token) pairs whose logits become -inf: bad words, min_tokens stops
    banned: tuple[np.ndarray, np.ndarray] | None = None
    # (batch index, token, bias)
    bias: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    # (batch index, token) pairs allowed; rows without allowed_token_ids are all allowed
    allowed: tuple[np.ndarray, np.ndarray] | None = None
    allowed_rows: np.ndarray | None = None  # bool [B]: rows restricted to their allowed ids
    # (batch index, token): the only token allowed (thinking_budget.py), after processing
    forced: tuple[np.ndarray, np.ndarray] | None = None
    # penalties: tokens padded with vocab_size, [B, Lp] and [B, Lo]
    prompt_tokens: np.ndarray | None = None
    output_tokens: np.ndarray | None = None
    # for the torch reference sampler
    seeds: list[int | None] = field(default_factory=list)
    extras: list = field(default_factory=list)
    output_lists: list[list[int]] = field(default_factory=list)
    num_generated: np.ndarray | None = None  # int32 [B]
    # speculative decoding (verify.py): the draft each row scores, -1 none; and the rows'
    # acceptance-test numbers
    draft_tokens: np.ndarray | None = None  # int32 [B]
    accept_uniforms: np.ndarray | None = None  # float64 [B]

    @property
    def size(self) -> int:
        return len(self.temperature)

    @property
    def greedy(self) -> np.ndarray:
        return self.temperature < GREEDY_EPS

    @property
    def all_greedy(self) -> bool:
        return bool(self.greedy.all())

    @property
    def uses_penalties(self) -> bool:
        return self.prompt_tokens is not None


def gather_batch(table: SamplingTable, rows: np.ndarray, num_generated: np.ndarray,
                 token_ids_of=None, *, for_reference: bool = False,
                 drafts_before: list[list[int]] | None = None) -> SamplingBatch:
    """rows: int32 [B] table rows in batch order; num_generated: int32 [B]
    output tokens each request has so far (the index of the token drawn now);
    token_ids_of(req_id) -> prompt + output ids, read only for rows that need
    their history (penalties, bad words); drafts_before: per row, draft tokens that
    precede it and count as output (speculative decoding, gather_draft_batch)."""
    t = table
    num_generated = np.maximum(num_generated, 0).astype(np.int32)
    nlp = t.num_logprobs[rows]
    b = SamplingBatch(
        vocab_size=t.vocab_size,
        temperature=t.temperature[rows], top_k=t.top_k[rows], top_p=t.top_p[rows],
        min_p=t.min_p[rows], repetition_penalty=t.repetition_penalty[rows],
        frequency_penalty=t.frequency_penalty[rows], presence_penalty=t.presence_penalty[rows],
        uniforms=uniforms(t.seed[rows], num_generated),
        max_num_logprobs=int(nlp.max()) if (nlp != NO_LOGPROBS).any() else None,
        num_generated=num_generated, logprob_rows=nlp != NO_LOGPROBS,
    )
    size = len(rows)
    id_rows = t.has_logprob_ids[rows]  # [B]
    if id_rows.any():
        b.logprob_ids = pad_token_ids([t.extras[r].logprob_ids if id_rows[i] else None
                                       for i, r in enumerate(rows)])
        top = nlp[(nlp != NO_LOGPROBS) & ~id_rows]
        b.num_top_logprobs = int(top.max()) if len(top) else 0
    else:
        b.num_top_logprobs = b.max_num_logprobs or 0
    history: dict[int, list[int]] = {}  # batch index -> output tokens
    prompts: dict[int, list[int]] = {}
    known: dict[int, list[int]] = {}  # table row -> its ids (rows repeat with drafts)
    for i in np.flatnonzero(t.needs_history[rows]):
        row = int(rows[i])
        if row not in known:
            known[row] = list(token_ids_of(t.req_ids[row])) if token_ids_of is not None else []
        ids = known[row]
        plen = int(t.prompt_len[row])
        prompts[i], history[i] = ids[:plen], ids[plen:]
        if drafts_before is not None:
            history[i] = history[i] + drafts_before[i]

    banned_b, banned_t = [], []
    for i in np.flatnonzero(t.has_bad_words[rows]):
        past = history.get(i, [])
        for word in t.extras[rows[i]].bad_words:
            prefix = word[:-1]
            if len(prefix) <= len(past) and (not prefix or past[-len(prefix):] == prefix):
                banned_b.append(i)
                banned_t.append(word[-1])
    for i in np.flatnonzero(num_generated < t.min_tokens[rows]):
        stops = t.extras[rows[i]].stop_ids
        banned_b += [i] * len(stops)
        banned_t += stops.tolist()
    if banned_b:
        b.banned = (np.array(banned_b, np.int32), np.array(banned_t, np.int32))

    bias_rows = np.flatnonzero(t.has_bias[rows])
    if len(bias_rows):
        ex = [t.extras[rows[i]] for i in bias_rows]
        b.bias = (np.repeat(bias_rows, [len(x.bias_ids) for x in ex]).astype(np.int32),
                  np.concatenate([x.bias_ids for x in ex]),
                  np.concatenate([x.bias_values for x in ex]))
    allowed_rows = np.flatnonzero(t.has_allowed[rows])
    if len(allowed_rows):
        ex = [t.extras[rows[i]] for i in allowed_rows]
        b.allowed = (np.repeat(allowed_rows, [len(x.allowed_ids) for x in ex]).astype(np.int32),
                     np.concatenate([x.allowed_ids for x in ex]))
        b.allowed_rows = t.has_allowed[rows].copy()

    pen = ((b.repetition_penalty != 1.0) | (b.frequency_penalty != 0.0)
           | (b.presence_penalty != 0.0))
    if pen.any():
        b.prompt_tokens = _pad([prompts.get(i, []) for i in range(size)], t.vocab_size)
        b.output_tokens = _pad([history.get(i, []) for i in range(size)], t.vocab_size)
    if for_reference:
        b.extras = [t.extras[r] for r in rows]
        b.seeds = [x.seed for x in b.extras]
        b.output_lists = [history.get(i, []) for i in range(size)]
    return b


def _pad(lists: list[list[int]], pad: int) -> np.ndarray:
    width = max(1, max(len(x) for x in lists))
    out = np.full((len(lists), width), pad, np.int32)
    for i, x in enumerate(lists):
        out[i, :len(x)] = x
    return out


def gather_draft_batch(table: SamplingTable, rows: np.ndarray, num_generated: np.ndarray,
                       drafts: list[list[int]], token_ids_of=None) -> SamplingBatch:
    """A step with draft tokens: request s (table row rows[s], drafts[s]) has
    len(drafts[s]) + 1 logits rows, request after request, and its row j scores
    output index num_generated[s] + j with drafts[s][:j] as output before it; each
    row carries the draft it checks (-1: the bonus row), for sampling/verify.py."""
    counts = np.array([len(d) + 1 for d in drafts], np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    offsets = np.arange(int(counts.sum())) - np.repeat(starts, counts)
    x_rows = np.repeat(rows, counts).astype(np.int32)
    x_generated = (np.repeat(np.maximum(num_generated, 0), counts) + offsets).astype(np.int32)
    before = [d[:j] for d in drafts for j in range(len(d) + 1)]
    b = gather_batch(table, x_rows, x_generated, token_ids_of, drafts_before=before)
    b.draft_tokens = np.array([(d + [-1])[j] for d in drafts for j in range(len(d) + 1)], np.int32)
    b.accept_uniforms = accept_uniforms(table.seed[x_rows], x_generated)
    return b
