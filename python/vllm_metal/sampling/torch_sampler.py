"""vLLM's own torch Sampler on the same logits (VLLM_METAL_NATIVE_SAMPLING=0).

For comparison and as a reference: the step's SamplingBatch becomes vLLM's
SamplingMetadata. logit_bias and min_tokens are applied
inside the Sampler by a small processor (after the raw logprobs, before the
penalties, where vLLM's own builtin processors run); min_p runs inside the Sampler
through vLLM's own MinPLogitsProcessor, after temperature as in vLLM.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from vllm_metal.sampling.batch import SamplingBatch
from vllm_metal.sampling.rng import splitmix64
from vllm_metal.sampling.sampler import SampleResult
from vllm_metal.sampling.thinking_budget import force_tokens


class TorchSampler:
    def __init__(self, logprobs_mode: str = "raw_logprobs") -> None:
        from vllm.v1.sample.sampler import Sampler

        self.sampler = Sampler(logprobs_mode=logprobs_mode)

    def __call__(self, logits: mx.array, b: SamplingBatch) -> SampleResult:
        import torch

        # thinking budget: forced rows masked before vLLM's sampler (which has no such
        # stage), so here even raw logprobs score the forced row
        x = torch.from_numpy(np.array(force_tokens(logits.astype(mx.float32), b.forced)))
        meta = self.metadata(x, b)
        out = self.sampler(x, meta)
        tokens = mx.array(out.sampled_token_ids[:, 0].numpy().astype(np.int32))
        lp = None
        if out.logprobs_tensors is not None:
            t = out.logprobs_tensors
            lp = (mx.array(t.logprob_token_ids.numpy()), mx.array(t.logprobs.numpy()),
                  mx.array(t.selected_token_ranks.numpy().astype(np.int32)))
        return SampleResult(tokens, lp)

    def metadata(self, x, b: SamplingBatch):
        import torch
        from vllm.v1.sample.logits_processor import LogitsProcessors
        from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
        from vllm.v1.sample.metadata import SamplingMetadata

        greedy = b.greedy
        size, vocab = x.shape
        procs = []
        if (b.min_p > 0).any():
            minp = MinPLogitsProcessor.__new__(MinPLogitsProcessor)  # its apply(), our table
            minp.min_p_count = int((b.min_p > 0).sum())
            minp.min_p = torch.from_numpy(b.min_p.copy())[:, None]
            procs.append(minp)
        if b.bias is not None or b.banned is not None:
            procs.append(_Edits(b))
        if b.custom is not None:  # --logits-processors, after vLLM's builtins as in vLLM
            procs.extend(b.custom.procs if hasattr(b.custom, "edits") else [b.custom])
        generators = {}
        steps = b.num_generated if b.num_generated is not None else np.zeros(size, np.int32)
        for i, seed in enumerate(b.seeds):
            if seed is not None:
                key = splitmix64(np.array([seed], np.uint64), steps[i:i + 1])[0]
                generators[i] = torch.Generator().manual_seed(int(key >> np.uint64(1)))
        allowed = None
        if b.allowed is not None:
            allowed = torch.zeros((size, vocab), dtype=torch.bool)
            allowed[torch.from_numpy(b.allowed_rows)] = True  # True = masked out
            rows, toks = b.allowed
            allowed[torch.from_numpy(rows).long(), torch.from_numpy(toks).long()] = False
        bad = {i: e.bad_words for i, e in enumerate(b.extras) if e is not None and e.bad_words}
        pen = b.uses_penalties
        return SamplingMetadata(
            temperature=torch.from_numpy(b.temperature.copy()),
            all_greedy=bool(greedy.all()), all_random=bool(not greedy.any()),
            top_p=torch.from_numpy(b.top_p.copy()) if (b.top_p < 1).any() else None,
            top_k=torch.from_numpy(b.top_k.astype(np.int64)) if (b.top_k < vocab).any() else None,
            generators=generators,
            max_num_logprobs=b.max_num_logprobs,
            no_penalties=not pen,
            prompt_token_ids=torch.from_numpy(b.prompt_tokens.astype(np.int64)) if pen else None,
            frequency_penalties=torch.from_numpy(b.frequency_penalty.copy()),
            presence_penalties=torch.from_numpy(b.presence_penalty.copy()),
            repetition_penalties=torch.from_numpy(b.repetition_penalty.copy()),
            output_token_ids=b.output_lists or [[] for _ in range(size)],
            allowed_token_ids_mask=allowed,
            bad_words_token_ids=bad,
            logitsprocs=LogitsProcessors(procs),
            logprob_token_ids=None if b.logprob_ids is None else {
                i: [int(t) for t in row if t >= 0] for i, row in enumerate(b.logprob_ids)
                if row[0] >= 0},
        )


class _Edits:
    """logit_bias and min_tokens' stop-token mask as a non-argmax-invariant
    logits processor, so vLLM's Sampler applies them where its builtins do."""

    def __init__(self, b: SamplingBatch) -> None:
        self.b = b

    def is_argmax_invariant(self) -> bool:
        return False

    def apply(self, logits):
        import torch

        if self.b.bias is not None:
            rows, toks, vals = self.b.bias
            logits.index_put_((torch.from_numpy(rows).long(), torch.from_numpy(toks).long()),
                              torch.from_numpy(vals), accumulate=True)
        if self.b.banned is not None:
            rows, toks = self.b.banned
            logits[torch.from_numpy(rows).long(), torch.from_numpy(toks).long()] = float("-inf")
        return logits
