"""Prompt logprobs over (possibly chunked) prefills, as vLLM's GPU runner
returns them: position i scores prompt token i+1; rows fill chunk by chunk and
the request's LogprobsTensors [prompt_len - 1, n + 1] is returned with the
step that finishes its prompt (absent while it is still prefilling)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from vllm_metal.sampling.logprobs import gather_logprobs, log_softmax
from vllm_metal.sampling.table import NO_LOGPROBS, SamplingTable


@dataclass
class _Chunk:
    req_id: str
    start: int  # first prompt position scored
    count: int  # positions scored this step
    done: bool  # the prompt's last scores are in this step


class PromptLogprobs:
    def __init__(self, table: SamplingTable) -> None:
        self.table = table
        self.partial: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._chunks: list[_Chunk] = []

    def plan(self, rows: np.ndarray, cu_q: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Packed token indices whose logits the step must also compute: int32 [M].
        rows [B] table rows; cu_q [B + 1]; positions [T] of the packed tokens."""
        self._chunks = []
        want = np.flatnonzero(self.table.num_prompt_logprobs[rows] != NO_LOGPROBS)
        extra = []
        for i in want:
            row = rows[i]
            req_id = self.table.req_ids[row]
            plen = int(self.table.prompt_len[row])
            lo, hi = int(cu_q[i]), int(cu_q[i + 1])
            start = int(positions[lo])
            if start >= plen:
                continue  # decoding: the prompt's logprobs went out already
            count = max(0, min(hi - lo, plen - 1 - start))
            self._chunks.append(_Chunk(req_id, start, count, start + (hi - lo) > plen - 1))
            extra.append(np.arange(lo, lo + count, dtype=np.int32))
        return np.concatenate(extra) if extra else np.zeros(0, np.int32)

    def score(self, logits: mx.array, mode: str):
        """logits [M, V] of the planned positions (None when M = 0) -> lazy
        per-chunk results."""
        if not self._chunks:
            return []
        scores = None
        if logits is not None:
            scores = log_softmax(logits) if mode.endswith("logprobs") else logits.astype(mx.float32)
        out, offset = [], 0
        for c in self._chunks:
            row = self.table.row_of[c.req_id]
            n = int(self.table.num_prompt_logprobs[row])
            targets = self.table.extras[row].prompt_ids[c.start + 1:c.start + 1 + c.count]
            part = None
            if c.count:
                part = gather_logprobs(scores[offset:offset + c.count], n, mx.array(targets))
            out.append((c, n, part))
            offset += c.count
        return out

    def collect(self, scored) -> dict:
        """The evaluated chunks -> prompt_logprobs_dict for ModelRunnerOutput."""
        import torch
        from vllm.v1.outputs import LogprobsTensors

        result = {}
        for c, n, part in scored:
            row = self.table.row_of.get(c.req_id)
            if row is None:
                continue
            if c.req_id not in self.partial:
                p = int(self.table.prompt_len[row]) - 1
                self.partial[c.req_id] = (np.zeros((p, n + 1), np.int32),
                                          np.zeros((p, n + 1), np.float32), np.zeros(p, np.int32))
            ids, lps, ranks = self.partial[c.req_id]
            if part is not None:
                sl = slice(c.start, c.start + c.count)
                ids[sl], lps[sl], ranks[sl] = (np.array(a) for a in part)
            if c.done:
                del self.partial[c.req_id]
                result[c.req_id] = LogprobsTensors(torch.from_numpy(ids), torch.from_numpy(lps),
                                                   torch.from_numpy(ranks))
        return result

    def drop(self, req_ids) -> None:
        for r in req_ids:
            self.partial.pop(r, None)
