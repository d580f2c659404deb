"""Prompt logprobs over (possibly chunked) prefills, as vLLM's GPU runner
returns them: position i scores prompt token i+1; rows fill chunk by chunk and
the request's LogprobsTensors [prompt_len - 1, n + 1] is returned with the
step that finishes its prompt (absent while it is still prefilling).

prompt_logprob_token_ids (vLLM V2's PromptLogprobsWorker): row i scores the
request's own ids at prompt position prompt_logprob_start + i; the float32
[rows, n] scores (-inf where the ids are -1 padding) come back the same way,
in prompt_token_id_logprobs_dict. Positions before the start are not computed
unless the request also wants top-n prompt logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from vllm_metal.sampling.logprobs import gather_logprobs, log_softmax
from vllm_metal.sampling.table import NO_LOGPROBS, SamplingTable
from vllm_metal.sampling.token_logprobs import gather_token_ids


@dataclass
class _Chunk:
    req_id: str
    start: int  # first prompt position scored
    count: int  # positions scored this step
    done: bool  # the prompt's last scores are in this step
    top: bool  # the request wants top-n prompt logprobs (else only its token ids)


@dataclass
class _Scored:
    """One chunk's lazy results."""
    chunk: _Chunk
    n: int  # top n
    part: tuple | None  # (ids, logprobs, ranks) of its positions, top-n requests
    id_first: int = 0  # first row of the request's prompt_logprob_token_ids scored
    id_part: mx.array | None = None  # float32 [rows, num_ids]

    def arrays(self) -> list[mx.array]:
        return [*(self.part or ()), *(() if self.id_part is None else (self.id_part,))]


class PromptLogprobs:
    def __init__(self, table: SamplingTable) -> None:
        self.table = table
        self.partial: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.partial_ids: dict[str, np.ndarray] = {}  # req_id -> float32 [rows, num_ids]
        self._chunks: list[_Chunk] = []

    def plan(self, rows: np.ndarray, cu_q: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Packed token indices whose logits the step must also compute: int32 [M].
        rows [B] table rows; cu_q [B + 1]; positions [T] of the packed tokens."""
        self._chunks = []
        t = self.table
        top = t.num_prompt_logprobs[rows] != NO_LOGPROBS  # [B]
        want = np.flatnonzero(top | t.has_prompt_ids[rows])
        extra = []
        for i in want:
            row = rows[i]
            req_id = t.req_ids[row]
            plen = int(t.prompt_len[row])
            lo, hi = int(cu_q[i]), int(cu_q[i + 1])
            start = int(positions[lo])
            if start >= plen:
                continue  # decoding: the prompt's logprobs went out already
            # only token ids: nothing before their first scored row
            first = start if top[i] else max(start, t.extras[row].prompt_score_start)
            count = max(0, min(start + hi - lo, plen - 1) - first)
            self._chunks.append(_Chunk(req_id, first, count, start + (hi - lo) > plen - 1,
                                       bool(top[i])))
            lo += first - start
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
            x = self.table.extras[row]
            n = int(self.table.num_prompt_logprobs[row])
            s = _Scored(c, n, None)
            if c.count and c.top:
                targets = x.prompt_ids[c.start + 1:c.start + 1 + c.count]
                s.part = gather_logprobs(scores[offset:offset + c.count], n, mx.array(targets))
            if c.count and x.prompt_score_ids is not None:
                a = max(c.start, x.prompt_score_start)  # first position with ids
                b = min(c.start + c.count, x.prompt_score_start + len(x.prompt_score_ids))
                if b > a:
                    s.id_first = a - x.prompt_score_start
                    ids = x.prompt_score_ids[s.id_first:s.id_first + b - a]
                    rows_scores = scores[offset + a - c.start:offset + b - c.start]
                    s.id_part = gather_token_ids(rows_scores, ids)[1]
            out.append(s)
            offset += c.count
        return out

    @staticmethod
    def arrays(scored) -> list[mx.array]:
        """The lazy arrays of score()'s results (to evaluate with the step)."""
        return [a for s in scored for a in s.arrays()]

    def collect(self, scored) -> dict:
        """The evaluated chunks -> prompt_logprobs_dict for ModelRunnerOutput."""
        import torch
        from vllm.v1.outputs import LogprobsTensors

        result = {}
        for s in scored:
            c, n, part = s.chunk, s.n, s.part
            row = self.table.row_of.get(c.req_id)
            if row is None or not c.top:
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

    def collect_token_ids(self, scored) -> dict:
        """The evaluated chunks -> prompt_token_id_logprobs_dict (req_id -> float32
        [rows, num_ids] torch tensor, on the step that finishes the prompt)."""
        import torch

        result = {}
        for s in scored:
            c = s.chunk
            row = self.table.row_of.get(c.req_id)
            x = None if row is None else self.table.extras[row]
            if x is None or x.prompt_score_ids is None:
                continue
            buf = self.partial_ids.get(c.req_id)
            if buf is None:
                # -inf: the -1 padding, and rows never computed (none, as vLLM skips
                # the prefix cache for these requests)
                buf = self.partial_ids[c.req_id] = np.full(x.prompt_score_ids.shape,
                                                            -np.inf, np.float32)
            if s.id_part is not None:
                part = np.array(s.id_part)
                buf[s.id_first:s.id_first + len(part)] = part
            if c.done:
                del self.partial_ids[c.req_id]
                result[c.req_id] = torch.from_numpy(buf)
        return result

    def drop(self, req_ids) -> None:
        for r in req_ids:
            self.partial.pop(r, None)
            self.partial_ids.pop(r, None)
