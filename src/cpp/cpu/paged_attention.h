// CPU kernel of paged attention over a packed batch (no MLX).
//
// Sequence s owns query rows [cu_seqlens_q[s], cu_seqlens_q[s+1]) and a
// context of seq_lens[s] tokens whose last q_len are the new ones; query i of
// the chunk sits at position seq_len - q_len + i and sees keys at positions
// <= its own (and > position - sliding_window when a window is set).
#pragma once

#include <cstdint>
#include <string>

#include "cpu/vec.h"

namespace vllm_metal::cpu {

struct PagedAttentionParams {
  Elt elt = Elt::kF16;
  const void* q = nullptr;  // [T, Hq, D], rows may be strided
  int64_t q_token_stride = 0;
  int64_t q_head_stride = 0;
  const void* key_cache = nullptr;    // [num_blocks, block_size, Hkv, D] row-major
  const void* value_cache = nullptr;  // same
  const int32_t* block_tables = nullptr;  // [num_seqs, max_blocks]
  const int32_t* seq_lens = nullptr;      // [num_seqs]
  const int32_t* cu_seqlens_q = nullptr;  // [num_seqs + 1]
  const float* sinks = nullptr;           // [Hq] or null
  void* out = nullptr;                    // [T, Hq, D] row-major
  int64_t num_tokens = 0;
  int64_t num_seqs = 0;
  int64_t max_blocks = 0;
  int64_t num_blocks = 0;
  int64_t block_size = 0;
  int64_t num_q_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_size = 0;
  float scale = 1.0f;
  int64_t sliding_window = 0;  // 0: none
  float softcap = 0.0f;        // 0: none
};

// Element offset in key_cache / value_cache of position j's row for kv_head; table is the
// sequence's row of block_tables.
inline int64_t cache_row_offset(const PagedAttentionParams& p, const int32_t* table,
                                int64_t kv_head, int64_t j) {
  const int64_t slot = int64_t(table[j / p.block_size]) * p.block_size + j % p.block_size;
  return (slot * p.num_kv_heads + kv_head) * p.head_size;
}

// "" when the metadata is consistent, else what is wrong (first problem found):
// cu_seqlens_q not rising from 0 to num_tokens, a chunk longer than its
// context, a context beyond the block table, a block id outside the cache.
std::string check_paged_metadata(const int32_t* block_tables, const int32_t* seq_lens,
                                 const int32_t* cu_seqlens_q, int64_t num_seqs,
                                 int64_t max_blocks, int64_t num_blocks, int64_t block_size,
                                 int64_t num_tokens);

// Flash-style (online softmax, no score matrix), threaded over sequences,
// kv heads and query tiles. Expects metadata accepted by check_paged_metadata.
void paged_attention(const PagedAttentionParams& p);

}  // namespace vllm_metal::cpu
