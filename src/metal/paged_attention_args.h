// Arguments of the paged attention kernels, shared by the host and the shaders.
#pragma once

#ifdef __METAL_VERSION__
#include <metal_stdlib>
#else
#include <cstddef>
#include <cstdint>
#endif

struct PagedAttentionArgs {
  int64_t q_token_stride;  // elements between query rows
  int64_t q_head_stride;   // elements between query heads
  int64_t max_blocks;      // row length of block_tables
  int64_t num_blocks;      // blocks in the cache: ids outside [0, num_blocks) are skipped
  uint32_t block_size;
  uint32_t num_q_heads;
  uint32_t num_kv_heads;
  uint32_t seq_offset;       // first sequence this launch handles
  uint32_t num_seqs;         // sequences this launch handles
  uint32_t partition_size;   // keys per split-KV partition (decode)
  uint32_t num_partitions;   // 1: write the output directly; token_rows: grid z, a row
                             // uses the aligned partitions its own keys span
  int32_t sliding_window;    // 0: none
  float scale;
  float softcap;             // 0: none
  uint32_t has_sinks;
  uint32_t token_rows;       // decode kernel: 1 = grid y walks query tokens, not sequences
};

#ifndef __METAL_VERSION__
static_assert(sizeof(PagedAttentionArgs) == 80, "layout must match the shaders");
static_assert(offsetof(PagedAttentionArgs, block_size) == 32, "layout must match the shaders");
static_assert(offsetof(PagedAttentionArgs, scale) == 64, "layout must match the shaders");
#endif
