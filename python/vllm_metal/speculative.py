"""Speculative decoding in the runner: n-gram or draft-model proposals, and what they
change in a step.

vLLM's scheduler schedules each decoding request's last token plus its draft tokens;
the forward scores all of them at once (several query tokens per sequence, as a
prefill chunk), and sampling/verify.py keeps the drafts the target agrees with.

Where drafts come from. After a step's tokens are on the host, the C++ packer's
n-gram matcher proposes each request's next drafts from its token history
(BatchPacker.propose_ngram), or a draft model decodes them greedily (draft_model.py),
or a head reading the target's hidden states does (head_draft.py: mtp.py, eagle3.py).
With sync scheduling the engine reads them with
take_draft_token_ids and schedules them. With async scheduling (vLLM's default) the
scheduler plans step N+1 before step N's tokens exist, with placeholder drafts; the
runner then waits for step N's tokens (as it does for penalties), proposes, and
fills the placeholders with its own drafts (fewer when it has fewer: the missing
ones count as rejected).

Rejected drafts. The scheduler takes num_computed_tokens back by the rejected drafts
when it reads a step's output; under async scheduling the next step was already
planned as if all were kept. A decoding request's computed tokens are its tokens
but the last (the step's input), so the runner uses min(scheduled count, that).
The KV rows written for rejected drafts are overwritten by the next step.
"""

from __future__ import annotations

import numpy as np


class Speculation:
    """The proposer's configuration and the drafts between steps."""

    def __init__(self, speculative_config, max_model_len: int, async_scheduling: bool) -> None:
        self.method = speculative_config.method
        self.num_speculative_tokens = int(speculative_config.num_speculative_tokens)
        if self.method == "ngram":
            self.min_n = int(speculative_config.prompt_lookup_min)
            self.max_n = int(speculative_config.prompt_lookup_max)
        # set at load: draft_model.DraftModel (method draft_model), or a
        # head_draft.HeadDraft over an MTP block (mtp) or an EAGLE3 head (eagle3)
        self.draft = None
        self.max_model_len = max_model_len
        self.async_scheduling = async_scheduling
        self.drafts: dict[str, list[int]] = {}  # the latest proposals, by request
        self.proposed: list[str] = []  # the requests proposed for last, in order
        # per request: the tokens that end it (no drafts after one); absent: never drafts
        self.stop_ids: dict[str, frozenset[int]] = {}

    @classmethod
    def from_config(cls, vllm_config) -> "Speculation | None":
        spec = getattr(vllm_config, "speculative_config", None)
        if spec is None:
            return None
        return cls(spec, vllm_config.model_config.max_model_len,
                   bool(vllm_config.scheduler_config.async_scheduling))

    # ---- planning a step ----------------------------------------------------------------
    def step_drafts(self, so) -> tuple[dict[str, int], dict[str, list[int]]]:
        """(num_scheduled_tokens, drafts) to pack for the scheduler output `so`: the
        scheduler's own drafts (sync), or ours in place of its placeholders (async)."""
        scheduled = dict(so.num_scheduled_tokens)
        spec = so.scheduled_spec_decode_tokens
        if not spec:
            return scheduled, {}
        drafts: dict[str, list[int]] = {}
        for req_id, tokens in spec.items():
            if req_id not in scheduled:
                continue
            if self.async_scheduling:
                mine = self.drafts.get(req_id, [])[:len(tokens)]
                scheduled[req_id] -= len(tokens) - len(mine)
                tokens = mine
            else:
                tokens = [t for t in tokens if t >= 0]  # -1: padding of drafts a grammar refused
                scheduled[req_id] -= len(spec[req_id]) - len(tokens)
            if tokens:
                drafts[req_id] = list(tokens)
        return scheduled, drafts

    def computed_tokens(self, req_ids, scheduled_computed, num_tokens_of) -> list[int]:
        """The cached requests' num_computed_tokens: the scheduler's, capped at the
        tokens a request has but its last (async: the scheduler may not yet know the
        previous step's rejections)."""
        if not self.async_scheduling:
            return list(scheduled_computed)
        return [min(int(c), num_tokens_of(r) - 1) for r, c in zip(req_ids, scheduled_computed)]

    # ---- after a step ----------------------------------------------------------------------
    def add(self, req_id: str, params, drafts: bool = True) -> None:
        """A new request; drafts=False: never propose for it (thinking_token_budget
        forces tokens per row, one row per request)."""
        if drafts:
            self.stop_ids[req_id] = frozenset(params.all_stop_token_ids or ())
        else:
            self.stop_ids.pop(req_id, None)

    def propose(self, packer, req_ids: list[str], outputs: list[list[int]], *, group: int = 0,
                skip=frozenset()) -> None:
        """New drafts for the requests that just sampled (outputs non-empty), from their
        histories in the packer or from the draft model; none for a request whose last
        token stops it, nor for those in skip (finished or preempted since the step).
        group: the KV-cache group of the attention layers (the draft model's blocks)."""
        self.drafts = {}
        self.proposed = []
        ids = [r for r, out in zip(req_ids, outputs)
               if out and r in self.stop_ids and out[-1] not in self.stop_ids[r] and r not in skip]
        if self.draft is not None:
            # an MTP block runs over the step even when no request drafts (its cache)
            if not ids and not self.draft.needs_target_hidden:
                return
            drafts = self.draft.propose_for(packer, ids, req_ids, group)
            counts = (drafts >= 0).sum(axis=1)
        elif not ids:
            return
        else:
            rows = np.array([packer.row_of(r) for r in ids], np.int32)
            drafts, counts = packer.propose_ngram(rows, self.min_n, self.max_n,
                                                  self.num_speculative_tokens, self.max_model_len)
        for r, d, n in zip(ids, drafts, counts):
            self.drafts[r] = [int(t) for t in d[:n]]
            self.proposed.append(r)

    def take(self):
        """vLLM's DraftTokenIds for the latest proposals (take_draft_token_ids)."""
        from vllm.v1.outputs import DraftTokenIds

        if not self.proposed:
            return None
        ids = [r for r in self.proposed if r in self.drafts]  # not finished since
        self.proposed = []
        return DraftTokenIds(ids, [list(self.drafts[r]) for r in ids])

    def drop(self, req_ids) -> None:
        for r in req_ids:
            self.drafts.pop(r, None)
            self.stop_ids.pop(r, None)


def unsupported_reason(vllm_config) -> str | None:
    """Why this speculative configuration cannot be served (None: it can)."""
    spec = vllm_config.speculative_config
    if spec is None:
        return None
    if spec.method not in ("ngram", "draft_model", "mtp", "eagle3"):
        return (f"speculative method {spec.method!r} is not supported yet "
                "(supported: ngram, draft_model, mtp, eagle3)")
    rejection = getattr(spec, "rejection_sample_method", "standard")
    if rejection not in (None, "standard"):
        return (f"rejection_sample_method {rejection!r} is not supported (drafts are verified "
                "by the standard rejection sampler)")
    if getattr(spec, "draft_sample_method", "greedy") not in (None, "greedy"):
        return "draft_sample_method 'probabilistic' is not supported (drafters draft greedily)"
    from vllm_metal.hybrid import is_hybrid_config

    text = getattr(vllm_config.model_config, "hf_text_config", None)
    hybrid = text is not None and is_hybrid_config(text)
    if spec.method == "eagle3":
        if getattr(spec, "parallel_drafting", False):
            return "parallel drafting (P-EAGLE) is not supported yet"
        model_type = getattr(text, "model_type", "") or ""
        if hybrid or model_type.startswith("gemma"):
            return ("speculative method 'eagle3' is supported for llama-family (pre-norm "
                    f"attention) targets; not for {model_type!r}")
    if spec.method == "mtp":
        if not hybrid:
            return ("speculative method 'mtp' is supported for Qwen3.5 targets only (their "
                    "checkpoints' mtp.* block)")
        if not getattr(text, "mtp_num_hidden_layers", 0):
            return "speculative method 'mtp': the model's config declares no MTP layers"
    if spec.method == "draft_model":
        if getattr(spec, "parallel_drafting", False):
            return "parallel drafting (PARD) with a draft model is not supported yet"
        if getattr(spec, "draft_tensor_parallel_size", None) not in (None, 1):
            return "a draft model with tensor parallelism is not supported"
    if vllm_config.model_config.logits_processors:
        return "--logits-processors together with speculative decoding is not supported yet"
    return None
