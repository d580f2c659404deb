// Blocked flash-attention tile of the CPU paged attention (internal to src/cpp/cpu).
//
// The per-key kernel in paged_attention.cpp updates the softmax and the accumulator
// once per key (two scalar exps and a rescale of every accumulator row per key). This
// one takes keys in blocks of kAttentionKeyBlock: the block's keys and values are
// converted to float once for all the tile's query rows, the scores come from a
// register-blocked q . K^T, the softmax is updated once per block with a vectorized
// exp, and P . V accumulates in registers. Same math, same masks (causal, window,
// softcap, sinks); float32 sums in another order.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu/paged_attention.h"

namespace vllm_metal::cpu {

constexpr int64_t kAttentionKeyBlock = 32;
constexpr int64_t kBlockedQueryTile = 32;  // query rows sharing one pass over the keys

// True when this CPU runs the blocked tile for head_size (AVX2 and d % 8 == 0).
bool blocked_attention_available(int64_t head_size);

// Query rows [row_begin, row_end) of sequence `seq`, every q head of `kv_head`'s group.
template <Elt E>
void attend_tile_blocked(const PagedAttentionParams& p, int64_t seq, int64_t kv_head,
                         int64_t row_begin, int64_t row_end, std::vector<float>& work);

}  // namespace vllm_metal::cpu
