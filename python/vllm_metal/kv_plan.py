"""The runner's KV pool from the loaded model, sized and shaped by the C++ runtime
(src/cpp/runtime/kv_geometry.h); nothing here computes bytes by hand.

One geometry answers everything the worker reports to vLLM and allocates: the bytes of
one block over the attention layers (get_cache_block_size_bytes), the hybrid models'
state slots that come off the budget (determine_available_memory), then, with the block
count vLLM chose, every layer's K/V shape and the startup summary's line.

Layers: attention (a sliding-window layer keeps its window; it is allocated like full
attention, as get_kv_cache_spec declares it), and for hybrid models (Qwen3.5) the
linear-attention layers' per-request state, conv in the model dtype and recurrent in
float32, in max_num_seqs slots (hybrid.py), a second set when speculative decoding saves
each slot before a drafting step; with prefix caching, the checkpoints of cached prefixes
(checkpoint_bytes).
"""

from __future__ import annotations

from vllm_metal import _core


def layer_specs(loaded) -> list:
    """One _core.KvLayerSpec per model layer, in layer order."""
    spec, hybrid = loaded.spec, loaded.hybrid

    def attention(window: int):
        if window:
            return _core.KvLayerSpec.sliding_window_attention(spec.num_kv_heads, spec.head_dim, window,
                                                              dtype=spec.dtype)
        return _core.KvLayerSpec.full_attention(spec.num_kv_heads, spec.head_dim, dtype=spec.dtype)

    if hybrid is None:
        return [attention(w) for w in spec.sliding_window_per_layer]
    state = linear_attention(hybrid.state_shapes, hybrid.conv_dtype)
    linear = {i - hybrid.first_layer for i in hybrid.linear_layers}  # this stage's indices
    return [state if i in linear else attention(0) for i in range(spec.num_layers)]


def linear_attention(shapes, conv_dtype: str):
    """A Gated DeltaNet layer's state (models/qwen3_5_paged.StateShapes): conv
    [conv_dim, kernel - 1] in conv_dtype, recurrent [Hv, Dv, Dk] in float32."""
    return _core.KvLayerSpec.linear_attention(
        states=[(list(shapes.conv), conv_dtype), (list(shapes.ssm), "float32")])


def state_copies(speculative: bool) -> int:
    """State pools per linear layer: the slots, and under speculative decoding their
    saved copies (hybrid.HybridState.save_before_drafts)."""
    return 2 if speculative else 1


def size(loaded, *, block_size: int, max_num_seqs: int, speculative: bool):
    """Bytes per block and state bytes, before vLLM has counted the blocks."""
    return _core.size_kv_pool(layer_specs(loaded), block_size=block_size, max_num_seqs=max_num_seqs,
                              state_copies=state_copies(speculative))


def checkpoint_bytes(loaded, *, block_size: int, slots: int) -> int:
    """Bytes of a hybrid model's prefix-caching state checkpoints (hybrid.checkpoint_slots
    of them; each as large as one request's state)."""
    if not slots or loaded.hybrid is None:
        return 0
    return _core.size_kv_pool(layer_specs(loaded), block_size=block_size, max_num_seqs=slots,
                              state_copies=1).state_bytes


def plan(loaded, *, block_size: int, num_blocks: int, max_num_seqs: int, speculative: bool):
    """The pool for vLLM's block count (KVCacheConfig.num_blocks): shapes and description.
    No budget and no max_model_len check: vLLM has already sized and checked the count
    (an override included)."""
    return _core.plan_kv_pool(layer_specs(loaded), block_size=block_size, num_blocks=num_blocks,
                              max_num_seqs=max_num_seqs, state_copies=state_copies(speculative))
