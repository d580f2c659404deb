"""The native sampler: logits [B, V] -> tokens [B] (+ logprobs), lazily in MLX.

vLLM's order: raw logprobs of the unmodified logits; allowed ids, bad words,
min_tokens, logit_bias, penalties; greedy rows take the argmax there; random
rows go on through temperature, min_p, top-k/top-p and draw from the rest.
An all-greedy batch without edits is one argmax. With speculative decoding each
row scores one position of a request's drafts and verify.py keeps or replaces them.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from vllm_metal.sampling import rows
from vllm_metal.sampling.batch import SamplingBatch
from vllm_metal.sampling.draw import draw
from vllm_metal.sampling.filters import apply_filters
from vllm_metal.sampling.logprobs import gather_logprobs, log_softmax
from vllm_metal.sampling.processors import process
from vllm_metal.sampling.thinking_budget import force_tokens
from vllm_metal.sampling.token_logprobs import gather_logprobs_with_ids
from vllm_metal.sampling.verify import verify

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@dataclass
class SampleResult:
    tokens: mx.array  # int32 [B]
    logprobs: tuple[mx.array, mx.array, mx.array] | None = None  # ids, logprobs, ranks
    kept: mx.array | None = None  # bool [B]: speculative decoding, which drafts were kept


class Sampler:
    def __init__(self, logprobs_mode: str = "raw_logprobs") -> None:
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"[vllm-metal] logprobs_mode {logprobs_mode!r} is not supported")
        self.logprobs_mode = logprobs_mode

    def __call__(self, logits: mx.array, b: SamplingBatch) -> SampleResult:
        want_lp = b.max_num_logprobs is not None
        # logprobs only for the rows that asked (the others' rows stay zero and
        # are never read by vLLM's output processor)
        lp_idx = rows.subset(b.logprob_rows) if want_lp else None
        scores = None
        if want_lp and self.logprobs_mode == "raw_logprobs":
            scores = log_softmax(rows.take(logits, lp_idx))
        elif want_lp and self.logprobs_mode == "raw_logits":
            scores = rows.take(logits, lp_idx).astype(mx.float32)
        x = force_tokens(process(logits.astype(mx.float32), b), b.forced)
        greedy = b.greedy
        final, weights = (x, None) if greedy.all() else apply_filters(x, b)
        kept = None
        if b.draft_tokens is not None:  # speculative decoding: keep or replace each draft
            tokens, kept = verify(x, weights, b.draft_tokens, greedy, b.uniforms, b.accept_uniforms)
        elif weights is None:
            tokens = mx.argmax(x, axis=-1).astype(mx.int32)
        else:
            tokens = draw(weights, b.uniforms)
            if greedy.any():
                tokens = mx.where(mx.array(greedy), mx.argmax(x, axis=-1).astype(mx.int32), tokens)
        if not want_lp:
            return SampleResult(tokens, kept=kept)
        if scores is None:  # processed_*: what the tokens were drawn from
            final = rows.take(final, lp_idx)
            scores = log_softmax(final) if self.logprobs_mode == "processed_logprobs" else final
        lp_tokens = rows.take(tokens, lp_idx)
        if b.logprob_ids is None:
            sub = gather_logprobs(scores, b.max_num_logprobs, lp_tokens)
        else:  # logprob_token_ids
            ids = b.logprob_ids if lp_idx is None else b.logprob_ids[lp_idx]
            sub = gather_logprobs_with_ids(scores, b.num_top_logprobs, lp_tokens, ids)
        return SampleResult(tokens, tuple(rows.put_new(a, lp_idx, b.size) for a in sub), kept)
