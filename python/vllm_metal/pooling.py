"""Pooling for `--runner pooling`: embeddings, classification, per-token outputs.

The runner packs pooling requests like any prefill; the model hands back its final
hidden states (after the last norm, before any lm_head) for the packed rows this
module asks for, and the Pooler turns them into one output per finished request:

    LAST  the prompt's last token (Qwen3-Embedding, *ForSequenceClassification)
    MEAN  the mean over every prompt token
    CLS   the first token
    ALL   every token (token_embed / token_classify)

A long prompt may arrive in several chunks (chunked prefill). With causal attention a
chunk's hidden states never change afterwards, so each type accumulates across chunks:
LAST waits for the final chunk, CLS keeps chunk 0's first row, MEAN keeps a running
sum, ALL keeps the rows. A bidirectional source (an encoder) must see a prompt in one
step; the platform refuses chunked prefill for it.

After pooling, vLLM's own pooler heads do the rest (sentence-transformers Dense
projections, Matryoshka `dimensions`, normalisation, the classifier, logit calibration, activation), so outputs mean what
they mean on vLLM's GPU runner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np

if TYPE_CHECKING:
    import mlx.core as mx

    from vllm_metal.models.context import AttentionContext

SEQ_TASKS = ("embed", "classify")
TOKEN_TASKS = ("token_embed", "token_classify")


class HiddenStateSource(Protocol):
    """A model the pooling runner can pool: a decoder (PagedCausalLM) or an encoder.

    causal: True when a token's hidden state depends only on the tokens before it, so a
    prompt may be prefilled in chunks; False (bidirectional encoders): one step per prompt.
    hidden_states: the final hidden states [len(rows), hidden] of the packed batch at the
    packed row indices `rows` (int32). ctx describes the packed sequences as for
    generation (cu_seqlens_q, positions; decoders also write the paged KV cache). An
    encoder (causal False) also takes rows=None: every packed row, in order, ungathered.
    """

    causal: bool

    def hidden_states(self, input_ids: "mx.array", ctx: "AttentionContext",
                      rows: "mx.array | None") -> "mx.array": ...


class PoolingError(ValueError):
    """A request the pooler cannot serve (the platform refuses the settings that lead here)."""


@dataclass
class _Request:
    task: str
    params: object  # vllm.pooling_params.PoolingParams
    prompt_len: int
    method: str  # LAST | MEAN | CLS | ALL
    pooled_tokens: int = 0  # prompt tokens seen so far (chunks must be contiguous)
    total: np.ndarray | None = None  # MEAN: float64 running sum
    first: np.ndarray | None = None  # CLS
    rows: list = field(default_factory=list)  # ALL


@dataclass
class StepPlan:
    """A step's pooling: which packed rows to fetch and, per scheduled sequence, where
    its rows land in the fetched block."""
    rows: np.ndarray  # int32 [R]: packed row indices to fetch
    seqs: list  # per sequence: (req_id or None, start, stop) into the fetched block, final

    def takes_all_rows(self, num_rows: int) -> bool:
        """True when rows is 0, 1, .., num_rows - 1 (every sequence MEAN or ALL pooled whole),
        so the source can hand over its hidden states without gathering them."""
        r = self.rows
        return len(r) == num_rows and (num_rows == 0 or bool(np.array_equal(r, np.arange(num_rows))))


class _Metadata:
    """What vLLM's pooler heads read from PoolingMetadata."""

    def __init__(self, pooling_params: list):
        self.pooling_params = pooling_params


class Pooler:
    """Per-request pooling state and vLLM's heads for the served model's tasks.

    classifier: the score layer (torch [n, hidden] -> [n, num_labels]) of a
    classification model, None for an embedding model. projector: an embedding model's
    sentence-transformers Dense layers (torch), applied before normalisation."""

    def __init__(self, model_config, classifier: Callable | None = None, *, causal: bool = True,
                 projector: Callable | None = None):
        from vllm.model_executor.layers.pooler.activations import (PoolerNormalize,
                                                                   resolve_classifier_act_fn)
        from vllm.model_executor.layers.pooler.seqwise.heads import (ClassifierPoolerHead,
                                                                     EmbeddingPoolerHead)
        from vllm.model_executor.layers.pooler.tokwise.heads import (TokenClassifierPoolerHead,
                                                                     TokenEmbeddingPoolerHead)

        config = model_config.pooler_config
        self.seq_method = config.seq_pooling_type or "LAST"
        self.tok_method = config.tok_pooling_type or "ALL"
        self.head_dtype = model_config.head_dtype
        self.causal = causal  # False: every prompt must come whole in one step
        if classifier is None:
            self.heads = {
                "embed": EmbeddingPoolerHead(projector=projector, head_dtype=self.head_dtype,
                                             activation=PoolerNormalize()),
                "token_embed": TokenEmbeddingPoolerHead(head_dtype=self.head_dtype, projector=projector,
                                                        activation=PoolerNormalize()),
            }
        else:
            calibration = dict(logit_mean=config.logit_mean, logit_sigma=config.logit_sigma,
                               head_dtype=self.head_dtype,
                               activation=resolve_classifier_act_fn(model_config, static_num_labels=False))
            self.heads = {
                "classify": ClassifierPoolerHead(classifier=classifier, **calibration),
                "token_classify": TokenClassifierPoolerHead(classifier=classifier, **calibration),
            }
        self._requests: dict[str, _Request] = {}

    def supported_tasks(self) -> tuple[str, ...]:
        return tuple(self.heads)

    def add(self, req_id: str, params, prompt_len: int) -> None:
        task = getattr(params, "task", None)
        if task not in self.heads:
            raise PoolingError(f"[vllm-metal] pooling task {task!r} is not served by this model "
                               f"(supported: {', '.join(self.heads)})")
        method = self.tok_method if task in TOKEN_TASKS else self.seq_method
        self._requests[req_id] = _Request(task, params, prompt_len, method)

    def drop(self, req_ids) -> None:
        for r in req_ids:
            self._requests.pop(r, None)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._requests

    def plan(self, req_ids: list[str], cu_seqlens_q: np.ndarray, positions: np.ndarray) -> StepPlan:
        """The rows this step needs: per sequence [a, b) of the packed batch, whose first
        token is at prompt position positions[a]."""
        rows, seqs, fetched = [], [], 0
        for i, req_id in enumerate(req_ids):
            a, b = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
            req = self._requests.get(req_id)
            if req is None or b == a:
                seqs.append((None, 0, 0, False))
                continue
            start = int(positions[a])
            final = start + (b - a) >= req.prompt_len
            if not self.causal and (start != 0 or not final):
                raise PoolingError(f"[vllm-metal] request {req_id}: a bidirectional model pools a "
                                   "prompt in one step; serve it with --no-enable-chunked-prefill")
            if req.method != "LAST" and start != req.pooled_tokens:
                # a prefix-cache hit skipped tokens a MEAN/CLS/ALL pooling needs
                raise PoolingError(f"[vllm-metal] request {req_id}: {req.method} pooling needs every "
                                   f"prompt token, but this step starts at token {start} "
                                   f"(expected {req.pooled_tokens})")
            req.pooled_tokens = start + (b - a)
            if req.method == "LAST":
                want = range(b - 1, b) if final else range(0)
            elif req.method == "CLS":
                want = range(a, a + 1) if start == 0 else range(0)
            else:  # MEAN, ALL
                want = range(a, b)
            rows.extend(want)
            seqs.append((req_id, fetched, fetched + len(want), final))
            fetched += len(want)
        return StepPlan(np.array(rows, np.int32), seqs)

    def pool(self, plan: StepPlan, hidden: np.ndarray) -> list:
        """hidden: float32 [len(plan.rows), hidden] -> per scheduled sequence, its output
        (a torch tensor) when its prompt is complete, else None."""
        import torch

        from vllm_metal.ops import batch_invariant

        finished: dict[str, list] = {}  # task -> [(seq index, pooled, params)]
        for i, (req_id, lo, hi, final) in enumerate(plan.seqs):
            if req_id is None:
                continue
            req = self._requests[req_id]
            block = hidden[lo:hi]
            if req.method == "MEAN":
                part = block.sum(axis=0, dtype=np.float64)
                req.total = part if req.total is None else req.total + part
            elif req.method == "CLS" and len(block):
                req.first = block[0].copy()
            elif req.method == "ALL":
                req.rows.append(block.copy())
            if not final:
                continue
            if req.method == "LAST":
                pooled = block[-1]
            elif req.method == "MEAN":
                pooled = (req.total / req.prompt_len).astype(np.float32)
            elif req.method == "CLS":
                pooled = req.first
            else:
                pooled = np.concatenate(req.rows)
            finished.setdefault(req.task, []).append((i, pooled, req.params))
        out = [None] * len(plan.seqs)
        for task, items in finished.items():
            head = self.heads[task]
            meta = _Metadata([p for _, _, p in items])
            if task in SEQ_TASKS and batch_invariant():
                # torch picks its GEMM kernel by the batch's shape (a classifier's or Dense
                # projector's row then differs in the last bits alone and among 63 others):
                # every request through the head as a batch of one
                results = [head(torch.from_numpy(x[None]), _Metadata([p]))[0] for _, x, p in items]
            elif task in SEQ_TASKS:  # one [n, hidden] batch: a NumPy stack, not n tensors
                results = head(torch.from_numpy(np.stack([x for _, x, _ in items])), meta)
            else:
                results = head([torch.from_numpy(np.ascontiguousarray(x)) for _, x, _ in items], meta)
            for (i, _, _), r in zip(items, results):
                out[i] = r.to(torch.float32).contiguous()
        return out


def score_classifier(weight: np.ndarray, bias: np.ndarray | None, dtype) -> Callable:
    """A *ForSequenceClassification score layer as a torch function in the head dtype."""
    import torch

    w = torch.from_numpy(np.asarray(weight, np.float32)).to(dtype)
    b = None if bias is None else torch.from_numpy(np.asarray(bias, np.float32)).to(dtype)

    def classify(x):
        return torch.nn.functional.linear(x.to(dtype), w, b)

    return classify
