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


# ---- vLLM's V2 interface (the V2 runner contract, the default) -------------------------
from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2LogitsProcessor  # noqa: E402


class ForceTokenV2(V2LogitsProcessor):
    """{"force_token": id}: only that id; {"repeat_last": 1}: only the request's last
    committed token (read from the request state vLLM V2 shares), so the output repeats
    the prompt's last token."""

    def __init__(self, vllm_config, req_states) -> None:
        self.req_states = req_states
        self.force: dict[int, int] = {}  # slot -> token (-1: its last committed token)

    @classmethod
    def validate_params(cls, params) -> None:
        ForceToken.validate_params(params)

    def add_request(self, req_idx: int, params) -> bool:
        args = params.extra_args or {}
        self.force.pop(req_idx, None)
        if "force_token" in args:
            self.force[req_idx] = int(args["force_token"])
        elif args.get("repeat_last"):
            self.force[req_idx] = -1
        return req_idx in self.force

    def apply(self, logits: torch.Tensor, ctx) -> torch.Tensor:
        st = self.req_states
        for row, slot in enumerate(ctx.expanded_idx_mapping.tolist()):
            token = self.force.get(slot)
            if token is None:
                continue
            if token == -1:
                token = int(st.all_token_ids.gpu[slot, int(st.total_len.gpu[slot]) - 1])
            keep = logits[row, token].clone()
            logits[row] = float("-inf")
            logits[row, token] = keep
        return logits
