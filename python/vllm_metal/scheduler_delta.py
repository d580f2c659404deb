"""vLLM's per-step ``SchedulerOutput`` -> calls on the C++ ``BatchPacker``.

The worker keeps one ``BatchPacker`` (``vllm_metal._core.BatchPacker``): its
request table mirrors what the scheduler has sent, and each step packs the
scheduled requests into flat arrays (see docs/runtime.md, "BatchPacker").
This module forwards the step's deltas, in the order the two vLLM
model-runner contracts apply them; the model runner and the tests take this
one path (the runner's own per-request state follows through DeltaHooks):

* V2 (default): finished *and preempted* requests leave the table; a resumed
  request comes back as a new request whose ``prefill_token_ids`` hold its
  prompt and the outputs so far.
* V1 (``VLLM_USE_V2_MODEL_RUNNER=0``): preempted requests keep their state; a
  resumed one arrives among the cached requests, listed in ``resumed_req_ids``,
  and its new block ids replace the old.

After sampling, the runner calls ``packer.append_sampled(token_ids)`` with the
sampled ids ``[num_seqs, k]`` in batch order (``-1`` pads rejected drafts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

# (new request data, its token ids) -> (positions [mrope_num_dims, L], delta)
MropeFn = Callable[[Any, list[int]], tuple[np.ndarray, int]]


class DeltaHooks:
    """What an owner of more per-request state than the packer's (the model runner:
    sampling table, hybrid state slots, speculation) hears of each step's deltas, in
    order. The defaults do nothing."""

    def requests_removed(self, removed: set[str], preempted: set[str]) -> None:
        """After the packer dropped `removed` (finished, and under V2 preempted);
        `preempted` is every preempted id, also those V1 keeps."""

    def request_added(self, new, row: int, tokens: list[int], prompt_len: int) -> None:
        """After a new (or V2-resumed) request took table row `row`."""

    def computed_tokens(self, req_ids: list[str], computed: list[int]) -> list[int]:
        """The cached requests' num_computed_tokens as the packer should take them
        (vLLM's, before update_requests; the runner corrects them for drafts)."""
        return computed


class SchedulerDelta:
    """Applies each step's SchedulerOutput to a BatchPacker.

    trim_outputs (V1): drop outputs past the scheduler's num_output_tokens, as vLLM's
    V1 runner does (it names KV-connector load failures as the cause). The model runner
    passes False: its packer holds exactly the tokens it read or deferred, and it has
    never trimmed (its V1 serving test checks every step against vLLM's deltas)."""

    def __init__(self, packer, *, use_v2_model_runner: bool, mrope_positions: MropeFn | None = None,
                 hooks: DeltaHooks | None = None, trim_outputs: bool = True):
        self.packer = packer
        self.v2 = use_v2_model_runner
        self._mrope = mrope_positions
        self.hooks = hooks or DeltaHooks()
        self.trim_outputs = trim_outputs

    def apply(self, scheduler_output, *, pad_tokens_to: int = 0):
        """Updates the request table and packs the step; returns the packer,
        whose array properties are this step's inputs."""
        so = scheduler_output
        self.update(so)
        self.packer.pack(
            so.num_scheduled_tokens,
            so.scheduled_spec_decode_tokens or None,
            pad_tokens_to=pad_tokens_to,
        )
        return self.packer

    def update(self, scheduler_output) -> None:
        """The request table after the step's deltas (the packing is the caller's)."""
        so = scheduler_output
        packer = self.packer
        preempted = set(so.preempted_req_ids or ())
        removed = set(so.finished_req_ids) | (preempted if self.v2 else set())
        if removed:
            packer.remove_requests(sorted(removed))
        self.hooks.requests_removed(removed, preempted)
        for new in so.scheduled_new_reqs:
            self._add(new)
        cached = so.scheduled_cached_reqs
        if cached.req_ids:
            req_ids = list(cached.req_ids)
            packer.update_requests(
                req_ids,
                self.hooks.computed_tokens(req_ids, list(cached.num_computed_tokens)),
                [None if b is None else [list(g) for g in b] for b in cached.new_block_ids],
                resumed_req_ids=list(cached.resumed_req_ids) if cached.resumed_req_ids else None,
                num_output_tokens=(list(cached.num_output_tokens)
                                   if not self.v2 and self.trim_outputs else None),
                # V2 sends none (its resumed requests come back as new ones)
                all_token_ids={k: list(v) for k, v in cached.all_token_ids.items()} or None,
            )

    def _add(self, new) -> None:
        # V2 sends prompt + outputs so far (a resumed request); V1 the prompt.
        tokens = new.prefill_token_ids if new.prefill_token_ids is not None else new.prompt_token_ids
        if tokens is None:
            raise ValueError(
                f"[BatchPacker] request '{new.req_id}' has no token ids; "
                "prompt embeddings are not supported"
            )
        tokens = list(tokens)
        prompt_len = len(new.prompt_token_ids or tokens)
        positions, delta = (None, 0) if self._mrope is None else self._mrope(new, tokens)
        # replace=True: both runners drop the old state of a re-sent id (streaming input)
        row = self.packer.add_request(
            new.req_id,
            tokens,
            num_computed_tokens=new.num_computed_tokens,
            block_ids=[list(b) for b in new.block_ids],
            prompt_len=prompt_len,
            mrope_positions=positions,
            mrope_position_delta=delta,
            replace=True,
        )
        self.hooks.request_added(new, row, tokens, prompt_len)


def mlx_inputs(packer) -> dict:
    """The packed step as ``mx.array``s. MLX's CPU allocator cannot adopt
    foreign memory, so each array is one copy of the packer's (zero-copy)
    NumPy view; the copies stay valid after the next pack(). Block tables are
    cut to the columns in use (``block_table_used_widths``): the kernels read
    ``seq_lens`` worth of entries, the rest is padding."""
    import mlx.core as mx

    out = {
        name: mx.array(getattr(packer, name))
        for name in (
            "input_ids",
            "positions",
            "slot_mappings",
            "seq_lens",
            "cu_seqlens_q",
            "logits_indices",
            "cu_num_logits",
        )
    }
    out["block_tables"] = tuple(
        mx.array(t[:, :w]) for t, w in zip(packer.block_tables, packer.block_table_used_widths)
    )
    return out
