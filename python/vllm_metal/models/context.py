"""The per-step attention metadata a model forward reads.

Built by the model runner once per step from the batch packer, shared by every
layer. Rows are packed: decode rows (one query token each) first, then prefill
chunks; T = positions.shape[0].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import mlx.core as mx


@dataclass
class AttentionContext:
    positions: "mx.array"       # int32 [T]: absolute position of each packed token
    slot_mapping: "mx.array"    # int64 [T]: block_table[pos // B] * B + pos % B; < 0 skips the write
    block_tables: "mx.array"    # int32 [num_seqs, max_blocks], padded
    seq_lens: "mx.array"        # int32 [num_seqs]: context length including this step's tokens
    cu_seqlens_q: "mx.array"    # int32 [num_seqs + 1]: row offsets of each sequence's queries
    num_decode_seqs: int        # leading sequences with one query row
    max_seq_len: int
    max_query_len: int
    logits_indices: "mx.array"  # int32 [N]: packed rows whose logits the forward returns
    # Per layer (key_cache, value_cache), each [num_blocks, block_size, kv_heads, head_dim].
    # Attention layer i replaces entry i with the caches ops.reshape_and_cache returns,
    # so after the forward this list holds the updated (lazy) caches to keep.
    kv_caches: list
    # an EAGLE3 head's inputs (eagle3.py): the residual stream after these many layers,
    # left by the forward in `aux` (pre-norm models: paged_model.py)
    aux_layers: tuple = ()
    aux: list = None


def prepare_gguf_dir(gguf_path: str, out_dir: str | None = None) -> str:
    """See vllm_metal.models.gguf_dir.prepare_gguf_dir."""
    from vllm_metal.models.gguf_dir import prepare_gguf_dir as prepare

    return prepare(gguf_path, out_dir)
