"""Pipeline parallelism: one stage's layers of a loaded decoder, and what crosses stages.

Stage r of n keeps the layers vLLM's get_pp_indices gives it (VLLM_PP_LAYER_PARTITION
overrides, as for vLLM's own models) and drops the others; its KV cache holds its layers
only. The first stage embeds; each stage hands the next one its hidden state and the
residual stream not yet added to it, stacked [2, tokens, hidden], through mx.distributed
send/recv; the last stage adds them, applies the final norm and lm_head, and samples.
Hybrid models (Qwen3.5) split the same way: a stage's state pools and KV caches cover
its own layers (each stage needs one full-attention layer).

The sampled tokens reach the earlier stages two ways. Without async scheduling vLLM's
scheduler sends them back with the step that needs them. With it (vLLM's default) the
scheduler has sent the next steps before it reads a step's tokens, so the last stage
sends them itself, int32 [num_seqs], back along the ring (stage r hands them on to r - 1:
MLX's ring reaches neighbours only); each earlier stage keeps them as the deferred
samples of that step (placeholders in its packer, model_runner.py), as the last stage
keeps its own. The scheduler staggers a request's decodes by the number of stages, so a
stage reads step t's tokens when it packs step t + size, long after they were sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


class PipelineParallelError(ValueError):
    """A model this pipeline cannot split (the message says why)."""


@dataclass
class Stage:
    rank: int
    size: int
    start: int  # first layer (global index)
    stop: int
    group: object  # the mx.distributed group of the stages

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1


def keep_stage(loaded, rank: int, size: int, group) -> Stage:
    """Cuts a LoadedModel (llama family, or the hybrid Qwen3.5) down to stage `rank` of
    `size`, in place."""
    from vllm.distributed.utils import get_pp_indices

    model = loaded.model
    hybrid = loaded.hybrid
    if hybrid is None and (model.sandwich or model.llama4_beta is not None):
        raise PipelineParallelError(f"{model.arch.model_type} is not supported with pipeline "
                                    "parallelism yet (llama-family pre-norm decoders are)")
    n = len(model.layers)
    if n < size:
        raise PipelineParallelError(f"--pipeline-parallel-size {size} exceeds the model's {n} layers")
    start, stop = get_pp_indices(n, rank, size)
    model.lm.model.layers = model.layers[start:stop]
    if hybrid is not None:
        _keep_hybrid_layers(loaded, start, stop)
    else:
        for layer in model.layers:
            layer.self_attn.layer_idx -= start
        model.reset_fused_layers()
    object.__setattr__(model, "pipeline_stage", (start, stop))  # fused_layers.why_not_fused
    spec = loaded.spec
    spec.num_layers = stop - start
    spec.sliding_window_per_layer = spec.sliding_window_per_layer[start:stop]
    mx.eval(model.parameters())
    return Stage(rank, size, start, stop, group)


def _keep_hybrid_layers(loaded, start: int, stop: int) -> None:
    """Qwen3.5 (hybrid.py): the stage's attention layers index its KV caches, its linear
    layers its state pools, both from 0; the HybridSpec keeps the global indices (vLLM's
    layer names) of this stage's layers only, so its KV spec, state pools and checkpoints
    cover them alone."""
    model, hybrid = loaded.model, loaded.hybrid
    model.is_linear = model.is_linear[start:stop]
    for layer in model.layers:
        if not layer.is_linear:
            layer.self_attn.layer_idx -= start
    hybrid.attention_layers = [i for i in hybrid.attention_layers if start <= i < stop]
    hybrid.linear_layers = [i for i in hybrid.linear_layers if start <= i < stop]
    hybrid.first_layer = start
    if not hybrid.attention_layers:
        # the runner keeps one attention KV-cache group per worker (hybrid.HybridState)
        raise PipelineParallelError(
            f"pipeline stage of layers {start}-{stop - 1} holds no full-attention layer; "
            "choose the split with VLLM_PP_LAYER_PARTITION so that every stage holds one")


def send_to_next(stage: Stage, h: mx.array, residual: mx.array) -> mx.array:
    """The lazy send of (h, residual) to the next stage; evaluate it to send."""
    return mx.distributed.send(mx.stack([h, residual]), stage.rank + 1, group=stage.group)


def receive_from_previous(stage: Stage, num_tokens: int, hidden: int, dtype) -> tuple[mx.array, mx.array]:
    """(h, residual) from the previous stage, lazily."""
    both = mx.distributed.recv((2, num_tokens, hidden), dtype, stage.rank - 1, group=stage.group)
    return both[0], both[1]


@dataclass
class ReceivedTokens:
    """An earlier stage's copy of one step's sampled tokens (async scheduling), lazily
    received; `relay` (stages after the first) hands them on to the previous stage.
    Both must be evaluated in step order: each is the next message on its connection."""
    tokens: mx.array  # int32 [num_seqs]
    relay: mx.array | None


def send_sampled_tokens(stage: Stage, tokens: mx.array) -> mx.array:
    """The last stage: the lazy send of a step's sampled tokens [num_seqs] to the stage
    before it; evaluate it with the sampling."""
    return mx.distributed.send(tokens.astype(mx.int32), stage.rank - 1, group=stage.group)


def receive_sampled_tokens(stage: Stage, num_seqs: int) -> ReceivedTokens:
    """An earlier stage: the last stage's tokens of the step it has just run, from the
    stage after it (lazily), handed on to the one before unless it is the first."""
    tokens = mx.distributed.recv((num_seqs,), mx.int32, stage.rank + 1, group=stage.group)
    relay = None if stage.first else mx.distributed.send(tokens, stage.rank - 1, group=stage.group)
    return ReceivedTokens(tokens, relay)
