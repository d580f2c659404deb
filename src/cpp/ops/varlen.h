// Shared checks of packed variable-length batches with per-sequence state
// slots (causal_conv1d, gated_delta_rule).
//
//   cu_seqlens         int32 [N + 1]: sequence n owns rows [cu[n], cu[n + 1]);
//                      cu[0] == 0, non-decreasing, cu[N] == T
//   slots              int32 [N]: state slot of each sequence, in
//                      [0, num_slots), no two sequences share one
//   has_initial_state  optional int32/bool [N]: 0 = start from a zero state
//                      (a new request whose slot holds stale data)
//
// The metadata is tiny and comes from the host, so it is evaluated here and
// checked before any kernel runs (kernels assume valid input).
#pragma once

#include <optional>
#include <string>

#include "mlx/array.h"
#include "mlx/utils.h"

namespace vllm_metal {

namespace mx = mlx::core;

struct VarlenBatch {
  mx::array cu_seqlens;         // int32 [N + 1], row-contiguous, evaluated
  mx::array slots;              // int32 [N]
  mx::array has_initial_state;  // int32 [N] (ones when not given)
  int64_t num_seqs = 0;
  int64_t max_len = 0;
};

// Throws std::invalid_argument "[op] ..." (IndexError-like messages for slots).
VarlenBatch check_varlen(const char* op, const mx::array& cu_seqlens, const mx::array& slots,
                         const std::optional<mx::array>& has_initial_state, int64_t num_tokens,
                         int64_t num_slots, mx::StreamOrDevice s);

std::string shape_string(const mx::Shape& shape);

}  // namespace vllm_metal
