// Split-KV decode, shared by paged_attention.metal (the decode kernel and its reduce) and
// decoder_layer.metal (layer_matvec combines the partitions while staging the o
// projection's input): which query a decode-kernel row is, which partitions it wrote, and
// the combine in the reduce's order and rounding. MSL only.
#pragma once

#include <metal_stdlib>
#include "paged_attention_args.h"

using namespace metal;

// exp(a - b) with both possibly -inf (nothing accumulated yet): 0 then.
inline float rescale_factor(float a, float b) {
  return b == -INFINITY ? 0.0f : exp(a - b);
}

// The sequence holding query token t: the last s with cu_seqlens_q[s] <= t
// (empty chunks skipped), for 0 <= t < cu_seqlens_q[num_seqs].
inline uint sequence_of_token(device const int* cu_seqlens_q, uint num_seqs, int t) {
  uint lo = 0;
  uint hi = num_seqs;
  while (hi - lo > 1) {
    const uint mid = (lo + hi) / 2;
    if (cu_seqlens_q[mid] <= t) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// The query token of grid row y, its sequence and its context (the query
// sits at ctx - 1): a sequence's one new token, or with token_rows any token
// of the batch. False for a padding token past the last sequence.
inline bool locate_query(device const int* seq_lens, device const int* cu_seqlens_q,
                         constant PagedAttentionArgs& args, uint y, thread int& row,
                         thread uint& seq, thread int& ctx) {
  if (args.token_rows != 0) {
    row = int(y);
    if (row >= cu_seqlens_q[args.num_seqs]) {
      return false;
    }
    seq = sequence_of_token(cu_seqlens_q, args.num_seqs, row);
  } else {
    seq = args.seq_offset + y;
    row = cu_seqlens_q[seq];
  }
  ctx = seq_lens[seq] - (cu_seqlens_q[seq + 1] - row) + 1;
  return true;
}

// The first key a query at ctx - 1 sees.
inline int first_key(int ctx, constant PagedAttentionArgs& args) {
  return args.sliding_window > 0 ? max(0, ctx - args.sliding_window) : 0;
}

// With token_rows, a row's split-KV partitions are fixed by its own keys
// [first_key, ctx): partition_size blocks aligned to absolute positions, first..last.
inline int2 row_partitions(int ctx, constant PagedAttentionArgs& args) {
  const int lo = first_key(ctx, args);
  return int2(lo / int(args.partition_size), max(ctx - 1, lo) / int(args.partition_size));
}

// Partials of a decode row whose query sits at ctx - 1: with token_rows its own aligned
// partitions (1: it wrote its output directly), else every partition of the grid.
inline uint paged_row_parts(int ctx, constant PagedAttentionArgs& args) {
  if (args.token_rows != 0) {
    const int2 own = row_partitions(ctx, args);  // first, last
    return uint(own.y - own.x + 1);
  }
  return args.num_partitions;
}

// The partials grid row y of a split decode launch left for the reduce: 0 when the
// decode kernel wrote its output directly (a row of one partition, a row past the
// launch's sequences: a prefill token, a padding token).
inline uint paged_split_parts(device const int* seq_lens, device const int* cu_seqlens_q,
                              constant PagedAttentionArgs& args, uint y) {
  if (args.num_partitions <= 1 || (args.token_rows == 0 && y >= args.num_seqs)) {
    return 0;
  }
  int row;
  uint seq;
  int ctx;
  if (!locate_query(seq_lens, cu_seqlens_q, args, y, row, seq, ctx)) {
    return 0;
  }
  const uint parts = paged_row_parts(ctx, args);
  return parts > 1 ? parts : 0;
}

// First partial cell of (grid row y, q head): [rows, Hq, num_partitions] cells.
inline int64_t paged_split_cell(uint y, uint head, constant PagedAttentionArgs& args) {
  return (int64_t(y) * args.num_q_heads + head) * args.num_partitions;
}

// (m, 1 / sum) of the partitions cell0 .. cell0 + parts: the largest max, the sums
// rescaled to it in partition order.
inline float2 paged_split_scale(device const float* partial_max, device const float* partial_sum,
                                int64_t cell0, uint parts) {
  float m = -INFINITY;
  for (uint p = 0; p < parts; ++p) {
    m = max(m, partial_max[cell0 + p]);
  }
  float total = 0.0f;
  for (uint p = 0; p < parts; ++p) {
    total += partial_sum[cell0 + p] * rescale_factor(partial_max[cell0 + p], m);
  }
  return float2(m, total > 0.0f ? 1.0f / total : 0.0f);
}

// Dim d of the partitions' outputs rescaled to m and summed in partition order; the
// combined output is T(this * (1 / sum)).
inline float paged_split_value(device const float* partial_out, device const float* partial_max,
                               int64_t cell0, uint parts, uint head_size, uint d, float m) {
  float o = 0.0f;
  for (uint p = 0; p < parts; ++p) {
    o += partial_out[(cell0 + p) * head_size + d] * rescale_factor(partial_max[cell0 + p], m);
  }
  return o;
}
