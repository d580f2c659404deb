#include "ops/varlen.h"

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "mlx/ops.h"
#include "mlx/transforms.h"
#include "ops/dtype_names.h"

namespace vllm_metal {

namespace {

[[noreturn]] void fail(const char* op, const std::string& msg) {
  throw std::invalid_argument(std::string("[") + op + "] " + msg);
}

void check_int_vector(const char* op, const char* what, const mx::array& a, int64_t n) {
  if (a.dtype() != mx::int32) {
    fail(op, std::string(what) + " must be int32, got " + dtype_name(a.dtype()));
  }
  if (a.ndim() != 1 || a.shape(0) != n) {
    fail(op, std::string(what) + " must be [" + std::to_string(n) + "], got " +
                 shape_string(a.shape()));
  }
}

}  // namespace

std::string shape_string(const mx::Shape& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

VarlenBatch check_varlen(const char* op, const mx::array& cu_seqlens, const mx::array& slots,
                         const std::optional<mx::array>& has_initial_state, int64_t num_tokens,
                         int64_t num_slots, mx::StreamOrDevice s) {
  if (cu_seqlens.ndim() != 1 || cu_seqlens.shape(0) < 1) {
    fail(op, "cu_seqlens must be [num_seqs + 1], got " + shape_string(cu_seqlens.shape()));
  }
  const int64_t n = cu_seqlens.shape(0) - 1;
  check_int_vector(op, "cu_seqlens", cu_seqlens, n + 1);
  check_int_vector(op, "slots", slots, n);
  // Host-made arrays (the usual case) are used as they are: no graph nodes, no eval.
  auto dense = [&](const mx::array& a) {
    if (a.status() == mx::array::Status::available && a.flags().row_contiguous) return a;
    return mx::contiguous(a, false, s);
  };
  const std::vector<int32_t> ones(static_cast<size_t>(n), 1);
  VarlenBatch b{dense(cu_seqlens), dense(slots),
                mx::array(ones.begin(), {static_cast<int>(n)}, mx::int32), n, 0};
  if (has_initial_state) {
    const auto& h = *has_initial_state;
    if (h.dtype() != mx::bool_ && h.dtype() != mx::int32) {
      fail(op, "has_initial_state must be bool or int32, got " + dtype_name(h.dtype()));
    }
    if (h.ndim() != 1 || h.shape(0) != n) {
      fail(op, "has_initial_state must be [" + std::to_string(n) + "], got " +
                   shape_string(h.shape()));
    }
    b.has_initial_state = h.dtype() == mx::int32 ? dense(h) : mx::astype(h, mx::int32, s);
  }
  mx::eval({b.cu_seqlens, b.slots, b.has_initial_state});
  const int32_t* cu = b.cu_seqlens.data<int32_t>();
  const int32_t* sl = b.slots.data<int32_t>();
  if (cu[0] != 0) fail(op, "cu_seqlens[0] must be 0, got " + std::to_string(cu[0]));
  for (int64_t i = 0; i < n; ++i) {
    if (cu[i + 1] < cu[i]) {
      fail(op, "cu_seqlens must be non-decreasing, got cu_seqlens[" + std::to_string(i + 1) +
                   "] = " + std::to_string(cu[i + 1]) + " < " + std::to_string(cu[i]));
    }
    b.max_len = std::max<int64_t>(b.max_len, cu[i + 1] - cu[i]);
  }
  if (cu[n] != num_tokens) {
    fail(op, "cu_seqlens[-1] must be the number of rows " + std::to_string(num_tokens) +
                 ", got " + std::to_string(cu[n]));
  }
  std::vector<bool> used(static_cast<size_t>(std::max<int64_t>(num_slots, 0)), false);
  for (int64_t i = 0; i < n; ++i) {
    if (sl[i] < 0 || sl[i] >= num_slots) {
      fail(op, "slots[" + std::to_string(i) + "] = " + std::to_string(sl[i]) +
                   " is out of range for a state of " + std::to_string(num_slots) + " slots");
    }
    if (used[sl[i]]) {
      fail(op, "slot " + std::to_string(sl[i]) + " is used by two sequences");
    }
    used[sl[i]] = true;
  }
  return b;
}

}  // namespace vllm_metal
