"""Custom logits processors in vLLM's V2 interface
(vllm.v1.worker.gpu.sample.logits_processor.LogitsProcessor), which vLLM's front end
loads with the V2 runner contract (the default): `--logits-processors` and installed
"vllm.logits_processors" plugins, built by vLLM's own build_custom_logits_processors.

A processor's request slot (req_idx) is one of [0, max_num_seqs), taken from a free list
when the request is added and given back when it leaves, as V2's slots (the packer's rows
are not bounded by max_num_seqs: a freed row is reused only after the next pack).
The request state it reads (LogitsProcRequestState) is kept on the host, created only
when a processor is loaded: all_token_ids [max_num_reqs, max_model_len] int32
(max_num_seqs x max_model_len x 4 bytes), prompt_len, prefill_len, total_len, each with
.np and .gpu (a CPU torch view of the same memory: this runner's tensors live on the
host) as vLLM's buffers. A step's rows are brought up to date (the tokens fed so far)
before apply(), which gets vLLM's LogitsContext for the step (one logits row per
request: expanded_idx_mapping = idx_mapping = the rows, local positions 0).

Where: after logit_bias and the penalties (V2's pipeline: bias, penalties, bad words,
then custom processors), before temperature; all rows, greedy ones too.
When: on steps with a row for which a processor's add_request() returned True.
Cost: as custom_processors.py (a host torch copy of the step's [B, V] logits and back,
the step sampled in sample_tokens).
"""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np


class _HostBuffer:
    """vLLM's UvaBackedTensor / StagedWriteTensor as processors read them: .np and
    .gpu (and .cpu) over one host array."""

    def __init__(self, shape, dtype=np.int32) -> None:
        import torch

        self.np = np.zeros(shape, dtype)
        self.cpu = self.gpu = torch.from_numpy(self.np)


class V2Processors:
    @classmethod
    def load(cls, vllm_config, names, max_num_reqs: int) -> V2Processors | None:
        from vllm.v1.worker.gpu.sample.logits_processor import build_custom_logits_processors

        self = cls.__new__(cls)
        import torch

        mc = vllm_config.model_config
        self.state = SimpleNamespace(
            device=torch.device("cpu"), max_num_reqs=max_num_reqs,
            vocab_size=mc.get_vocab_size(),
            # calloc'd: pages are touched only as tokens are written (freed if no processor)
            all_token_ids=_HostBuffer((max_num_reqs, mc.max_model_len)),
            prompt_len=_HostBuffer(max_num_reqs), prefill_len=_HostBuffer(max_num_reqs),
            total_len=_HostBuffer(max_num_reqs))
        self.procs = build_custom_logits_processors(vllm_config, self.state, False, list(names))
        if not self.procs:
            return None
        self.active = np.zeros(max_num_reqs, bool)  # [rows] a processor acts on the request
        self.slot_of: dict[str, int] = {}
        self.free = list(range(max_num_reqs - 1, -1, -1))  # free slots, lowest last
        self.batch: tuple[list[str], np.ndarray, np.ndarray] | None = None
        return self

    # ---- request lifetime -------------------------------------------------------
    def add(self, req_id: str, params, prompt_ids, output_ids, row: int = 0) -> None:
        st = self.state
        row = self.slot_of.get(req_id)
        if row is None:
            row = self.slot_of[req_id] = self.free.pop()
        ids = list(prompt_ids) + list(output_ids)
        st.all_token_ids.np[row, :len(ids)] = ids
        st.prompt_len.np[row] = len(prompt_ids)
        st.prefill_len.np[row] = st.total_len.np[row] = len(ids)
        self.active[row] = False
        for p in self.procs:
            self.active[row] |= bool(p.add_request(row, params))
        for p in self.procs:
            p.apply_staged_writes()

    def remove(self, req_ids) -> None:
        for r in req_ids:
            row = self.slot_of.pop(r, None)
            if row is not None:
                self.active[row] = False
                self.free.append(row)

    # ---- one step -----------------------------------------------------------------
    def step(self, req_ids: list[str], rows, seq_lens: np.ndarray) -> bool:
        """seq_lens int32 [B] of the step's requests -> whether a processor acts on one
        of them (rows: the table rows, unused: slots are the processors')."""
        slots = np.array([self.slot_of[r] for r in req_ids], np.int32)  # [B]
        self.batch = (list(req_ids), slots, np.asarray(seq_lens, np.int32))
        return bool(self.active[self.batch[1]].any())

    def sync_outputs(self, token_ids_of) -> None:
        """Writes each row's tokens fed so far (token_ids_of(req_id) -> prompt + output
        ids) into all_token_ids, up to total_len."""
        st = self.state
        req_ids, rows, _ = self.batch
        for r, row in zip(req_ids, rows):
            ids = token_ids_of(r)
            have = int(st.total_len.np[row])
            if len(ids) > have:
                st.all_token_ids.np[row, have:len(ids)] = ids[have:]
                st.total_len.np[row] = len(ids)

    def apply_edits(self, x: mx.array) -> mx.array:
        return x  # V1's place (custom_processors.py)

    def apply_argmax_invariant(self, x: mx.array) -> mx.array:
        return x

    def apply_after_penalties(self, x: mx.array) -> mx.array:
        import torch

        t = self.apply(torch.from_numpy(np.array(x.astype(mx.float32))))
        return mx.array(t.to(torch.float32).numpy())

    # vLLM's torch Sampler (VLLM_METAL_NATIVE_SAMPLING=0) runs this object as one of its
    # V1 processors (there: before its penalties)
    def is_argmax_invariant(self) -> bool:
        return False

    def apply(self, t):
        """float32 torch [B, V] through every processor, with the step's context."""
        ctx = self._context()
        for p in self.procs:
            t = p.apply(t, ctx)
        return t

    def _context(self):
        """vLLM's LogitsContext of the step: one logits row per request."""
        import torch
        from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext

        _, rows, seq_lens = self.batch
        pos = np.maximum(seq_lens - 1, 0).astype(np.int64)  # [B] position fed now
        fed = self.state.all_token_ids.np[rows, pos]  # [B] (synced up to the fed token)
        idx = torch.from_numpy(rows.copy())
        return LogitsContext(
            expanded_idx_mapping=idx, idx_mapping=idx, idx_mapping_np=rows.copy(),
            expanded_local_pos=torch.zeros(len(rows), dtype=torch.int32),
            input_ids=torch.from_numpy(fed.astype(np.int32)), pos=torch.from_numpy(pos),
            seq_lens_upper_bound_np=seq_lens.copy())
