"""The packed batch of an encoder (BERT family) under `--runner pooling`.

An encoder attends both ways and keeps no KV cache: vLLM sees it as attention-free
(no KV-cache groups, no blocks), and every request runs whole in the one step that
schedules it, then finishes. So there is no paged state to track and no packer: each
step packs the scheduled prompts back to back.

Cross-encoders get their pair's token types as vLLM's scoring front end sends them:
pooling_params.extra_kwargs["compressed_token_type_ids"] = (start, end), the prompt
positions of type 1 (the second text), every other position type 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class EncoderStep:
    req_ids: list[str]
    input_ids: np.ndarray  # int32 [T]
    token_type_ids: np.ndarray  # int32 [T]
    cu_seqlens: np.ndarray  # int32 [N + 1]
    positions: np.ndarray  # int32 [T], 0-based within each prompt


class EncoderBatch:
    """Prompts (and token types) of the requests scheduled but not yet run."""

    def __init__(self):
        self._prompts: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._prompts

    def add(self, req_id: str, prompt_token_ids, pooling_params) -> None:
        ids = np.asarray(prompt_token_ids, np.int32)
        types = np.zeros(ids.shape, np.int32)
        extra = getattr(pooling_params, "extra_kwargs", None) or {}
        span = extra.get("compressed_token_type_ids")
        if span is not None:
            start, end = int(span[0]), int(span[1])
            types[start:end] = 1
        self._prompts[req_id] = (ids, types)

    def drop(self, req_ids) -> None:
        for r in req_ids:
            self._prompts.pop(r, None)

    def step(self, num_scheduled_tokens: dict[str, int]) -> EncoderStep:
        """The step's packed inputs; every scheduled prompt must come whole."""
        req_ids = list(num_scheduled_tokens)
        ids, types, lengths = [], [], []
        for r in req_ids:
            if r not in self._prompts:
                raise ValueError(f"[vllm-metal] request {r} was scheduled again: an encoder runs a "
                                 "prompt in one step (no chunked prefill, no preemption)")
            prompt, tt = self._prompts[r]
            n = int(num_scheduled_tokens[r])
            if n != len(prompt):
                raise ValueError(f"[vllm-metal] request {r}: {n} of its {len(prompt)} tokens scheduled; "
                                 "an encoder needs the whole prompt in one step "
                                 "(serve it with --no-enable-chunked-prefill)")
            ids.append(prompt)
            types.append(tt)
            lengths.append(n)
        cu = np.zeros(len(req_ids) + 1, np.int32)
        np.cumsum(lengths, out=cu[1:])
        starts = np.repeat(cu[:-1], lengths)
        positions = (np.arange(cu[-1], dtype=np.int32) - starts).astype(np.int32)
        cat = (lambda xs: np.concatenate(xs).astype(np.int32)) if ids else (lambda xs: np.zeros(0, np.int32))
        return EncoderStep(req_ids, cat(ids), cat(types), cu, positions)
