"""vLLM's per-step ``SchedulerOutput`` -> calls on the C++ ``BatchPacker``.

The worker keeps one ``BatchPacker`` (``vllm_metal._core.BatchPacker``): its
request table mirrors what the scheduler has sent, and each step packs the
scheduled requests into flat arrays (see docs/runtime.md, "BatchPacker").
This module only forwards the step's deltas, in the order the two vLLM
model-runner contracts apply them:

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


class SchedulerDelta:
    """Applies each step's SchedulerOutput to a BatchPacker."""

    def __init__(self, packer, *, use_v2_model_runner: bool, mrope_positions: MropeFn | None = None):
        self.packer = packer
        self.v2 = use_v2_model_runner
        self._mrope = mrope_positions

    def apply(self, scheduler_output, *, pad_tokens_to: int = 0):
        """Updates the request table and packs the step; returns the packer,
        whose array properties are this step's inputs."""
        so = scheduler_output
        packer = self.packer
        removed = so.finished_req_ids
        if self.v2 and so.preempted_req_ids:
            removed = removed | so.preempted_req_ids
        if removed:
            packer.remove_requests(removed)
        for new in so.scheduled_new_reqs:
            self._add(new)
        cached = so.scheduled_cached_reqs
        if cached.req_ids:
            packer.update_requests(
                cached.req_ids,
                cached.num_computed_tokens,
                cached.new_block_ids,
                resumed_req_ids=cached.resumed_req_ids or None,
                num_output_tokens=None if self.v2 else cached.num_output_tokens,
                all_token_ids=None if self.v2 else (cached.all_token_ids or None),
            )
        packer.pack(
            so.num_scheduled_tokens,
            so.scheduled_spec_decode_tokens or None,
            pad_tokens_to=pad_tokens_to,
        )
        return packer

    def _add(self, new) -> None:
        # V2 sends prompt + outputs so far (a resumed request); V1 the prompt.
        tokens = new.prefill_token_ids if new.prefill_token_ids is not None else new.prompt_token_ids
        if tokens is None:
            raise ValueError(
                f"[BatchPacker] request '{new.req_id}' has no token ids; "
                "prompt embeddings are not supported"
            )
        positions, delta = (None, 0) if self._mrope is None else self._mrope(new, tokens)
        # replace=True: both runners drop the old state of a re-sent id (streaming input)
        self.packer.add_request(
            new.req_id,
            tokens,
            num_computed_tokens=new.num_computed_tokens,
            block_ids=new.block_ids,
            prompt_len=new.prompt_len,
            mrope_positions=positions,
            mrope_position_delta=delta,
            replace=True,
        )


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
