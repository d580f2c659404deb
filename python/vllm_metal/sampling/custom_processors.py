"""Custom logits processors (`--logits-processors`, and installed plugins of vLLM's
"vllm.logits_processors" entry-point group) in vLLM's V1 interface,
vllm.v1.sample.logits_processor.LogitsProcessor, on the native sampler's steps.

vLLM loads such classes only with the V1 runner contract (VLLM_USE_V2_MODEL_RUNNER=0);
with V2 (the default) its front end wants V2-interface classes: custom_processors_v2.py.
Each processor is built once as vLLM builds it,
cls(vllm_config, torch.device("cpu"), is_pin_memory=False).

Batch: a processor's batch index is the row of the step (the packer's order). Before
a step the processors get one BatchUpdate (vLLM's rules: batch_size, `added` rows with
(index, params, prompt ids, output ids), `removed` indices no longer in the batch; an
added row replaces the one at its index). A request whose row changed since the last
step comes back as added at its new row, which processors handle as vLLM's own
re-adding of a request that was not scheduled; no `moved` entries are sent. The
output-id lists handed over are the ones later extended in place with the request's
new tokens, as vLLM's contract says (they are brought up to date before apply()).

Where they run, as in vLLM's Sampler: processors that are not argmax-invariant after
allowed_token_ids, bad words, min_tokens and logit_bias and before the penalties;
argmax-invariant ones after temperature and min_p, before top-k/top-p, and only when
a row samples at random.

Cost: apply() takes torch tensors, so a step with active processors copies its
[B, V] float32 logits to the host (waiting for the forward), runs the processors
there and copies them back: ~2 x 4 B x V bytes (B = 8, V = 49152: 3 MiB) and the
loss of the forward/host overlap of async scheduling for that step (the step samples
in sample_tokens, as a grammar-constrained one). A processor is active on a step
unless it is one of vLLM's AdapterLogitsProcessor with no request of the batch
(other processors cannot tell, so they run on every step of a server that loads them).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

def load(vllm_config, use_v2: bool, max_num_reqs: int = 0):
    """The server's custom processors (CustomProcessors, or V2Processors with the V2
    contract), or None when it has none."""
    names = tuple(getattr(vllm_config.model_config, "logits_processors", None) or ())
    if use_v2:
        from vllm_metal.sampling.custom_processors_v2 import V2Processors

        return V2Processors.load(vllm_config, names, max_num_reqs)
    from vllm.v1.sample.logits_processor import cached_load_custom_logitsprocs

    classes = cached_load_custom_logitsprocs(names)
    return CustomProcessors(vllm_config, classes) if classes else None


class CustomProcessors:
    def __init__(self, vllm_config, classes) -> None:
        import torch

        self.procs = [cls(vllm_config, torch.device("cpu"), False) for cls in classes]
        self.argmax_invariant = [p for p in self.procs if p.is_argmax_invariant()]
        self.edits = [p for p in self.procs if not p.is_argmax_invariant()]
        # req_id -> (params, prompt ids, output ids: the list handed to the processors)
        self.requests: dict[str, tuple] = {}
        self.index: dict[str, int] = {}  # req_id -> its row in the last step
        self.fresh: set[str] = set()  # (re)added since the last step: sent as added
        self.batch: list[str] = []  # this step's req_ids

    # ---- request lifetime -------------------------------------------------------
    def add(self, req_id: str, params, prompt_ids, output_ids, row: int = 0) -> None:
        self.requests[req_id] = (params, list(prompt_ids), list(output_ids))
        self.fresh.add(req_id)

    def remove(self, req_ids) -> None:
        for r in req_ids:
            self.requests.pop(r, None)

    # ---- one step -----------------------------------------------------------------
    def step(self, req_ids: list[str], rows=None, seq_lens=None) -> bool:
        """Sends the step's BatchUpdate (None when its rows are unchanged) to every
        processor; True when one of them has work on the step."""
        from vllm.v1.sample.logits_processor import BatchUpdate

        rows = {r: i for i, r in enumerate(req_ids)}
        added = [(i, *self.requests[r]) for r, i in rows.items()
                 if r in self.fresh or self.index.get(r) != i]
        taken = {a[0] for a in added}
        # rows of the last step left empty (every row below the batch size is taken)
        removed = sorted({i for i in self.index.values() if i >= len(req_ids)} - taken)
        update = (BatchUpdate(batch_size=len(req_ids), removed=removed, added=added, moved=[])
                  if added or removed or len(rows) != len(self.index) else None)
        for p in self.procs:
            p.update_state(update)
        self.index, self.batch = rows, list(req_ids)
        self.fresh -= set(req_ids)
        return any(_has_work(p) for p in self.procs)

    def sync_outputs(self, token_ids_of) -> None:
        """Extends each request's output list in place to its tokens so far;
        token_ids_of(req_id) -> prompt + output ids."""
        for r in self.batch:
            entry = self.requests.get(r)
            if entry is None:
                continue
            _, prompt, out = entry
            ids = token_ids_of(r)
            have = len(prompt) + len(out)
            if len(ids) > have:
                out.extend(int(t) for t in ids[have:])

    def apply_edits(self, x: mx.array) -> mx.array:
        """The processors that are not argmax-invariant, on float32 [B, V]."""
        return _run(self.edits, x)

    def apply_argmax_invariant(self, x: mx.array) -> mx.array:
        return _run(self.argmax_invariant, x)

    def apply_after_penalties(self, x: mx.array) -> mx.array:
        return x  # V2's place (custom_processors_v2.py)


def _has_work(p) -> bool:
    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

    return not isinstance(p, AdapterLogitsProcessor) or bool(p.req_info)


def _run(procs, x: mx.array) -> mx.array:
    if not procs:
        return x
    import torch

    t = torch.from_numpy(np.array(x.astype(mx.float32)))  # a host copy the processors own
    for p in procs:
        t = p.apply(t)
    return mx.array(t.to(torch.float32).numpy())
