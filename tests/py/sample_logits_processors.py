"""Logits processors in vLLM's V1 interface for the tests (loaded by `vllm serve
--logits-processors sample_logits_processors:ForceToken`, this folder on PYTHONPATH).

ForceToken: a request with extra_args {"force_token": id} can only produce that id
(every other logit -inf); not argmax-invariant. KeepTop: a request with extra_args
{"keep_top": 1} keeps only its largest logit when it samples at random, so it draws
what greedy decoding picks; argmax-invariant (the greedy choice is unchanged).
Both record what vLLM's contract hands them, for the unit tests.
"""

from __future__ import annotations

import torch
from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor


class _ByRow(LogitsProcessor):
    key = ""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, int] = {}  # batch index -> the request's argument
        self.outputs: dict[int, list[int]] = {}  # batch index -> its output ids (a reference)
        self.updates: list[BatchUpdate | None] = []

    @classmethod
    def validate_params(cls, params) -> None:
        arg = (params.extra_args or {}).get(cls.key)
        if arg is not None and (not isinstance(arg, int) or arg < 0):
            raise VLLMValidationError(f"{cls.key} must be a non-negative int, got {arg!r}",
                                      parameter=cls.key)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        self.updates.append(batch_update)
        if batch_update is None:
            return
        for index, params, _, output_ids in batch_update.added:
            arg = (params.extra_args or {}).get(self.key)
            self.rows.pop(index, None)
            self.outputs.pop(index, None)
            if arg is not None:
                self.rows[index] = int(arg)
                self.outputs[index] = output_ids
        for index in batch_update.removed:
            self.rows.pop(index, None)
            self.outputs.pop(index, None)
        for index in list(self.rows):
            if index >= batch_update.batch_size:
                del self.rows[index]


class ForceToken(_ByRow):
    key = "force_token"

    def is_argmax_invariant(self) -> bool:
        return False

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, token in self.rows.items():
            keep = logits[index, token].clone()
            logits[index] = float("-inf")
            logits[index, token] = keep
        return logits


class KeepTop(_ByRow):
    key = "keep_top"

    def is_argmax_invariant(self) -> bool:
        return True

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index in self.rows:
            best = int(torch.argmax(logits[index]))
            keep = logits[index, best].clone()
            logits[index] = float("-inf")
            logits[index, best] = keep
        return logits
