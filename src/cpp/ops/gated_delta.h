// gated_delta_rule: the linear-attention recurrence of Qwen3-Next / Qwen3.5
// (gated delta net) over packed variable-length rows with per-request state
// slots. Semantics of mlx-lm's gated_delta_update after normalize_qk:
//
//   q, k        [T, hk, dk] float32/float16/bfloat16 (one dtype with v)
//   v           [T, hv, dv], hv a multiple of hk; value head h reads key head
//               h / (hv / hk) (mlx-lm's mx.repeat of q and k along heads)
//   a, b        [T, hv] any float dtype (computed in float32)
//   A_log, dt_bias  [hv] any float dtype (float32 inside)
//   state       float32 [num_slots, hv, dv, dk]
//   cu_seqlens, slots, has_initial_state: see ops/varlen.h
//
// Per sequence, head and token (all float32):
//   q <- q / sqrt(|q|^2 + eps) / sqrt(dk),  k <- k / sqrt(|k|^2 + eps)
//   g    = exp(-exp(A_log) * softplus(a + dt_bias)),  beta = sigmoid(b)
//   S    = g S + beta (v - g S k) k^T,  y = S q
// Returns {y [T, hv, dv] in q's dtype, the new state}: the sequences' slots
// updated, every other slot unchanged (copied first unless options.inplace).
//
// method: "recurrent" (token by token), "chunked" (WY form over chunk_size
// tokens, CPU only; same result up to float32 rounding) or "auto" (currently
// recurrent, the faster of the two on the CPU). The Metal kernel is the
// recurrent one for every method.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/utils.h"
#include "ops/kernel_primitive.h"

namespace vllm_metal {

struct GatedDeltaOptions {
  std::string method = "auto";
  int64_t chunk_size = 64;
  float eps = 1e-6f;
  // Write the new state into the old state's buffer even when the old array is
  // still held (it then shows the new contents: the caller must rebind it).
  // MLX never donates an input of a two-output primitive (each output keeps
  // its own reference to the inputs), so this is how a serving loop avoids
  // copying every slot on every step.
  bool inplace = false;
};

std::vector<mx::array> gated_delta_rule(const mx::array& q, const mx::array& k,
                                        const mx::array& v, const mx::array& a,
                                        const mx::array& b, const mx::array& A_log,
                                        const mx::array& dt_bias, const mx::array& state,
                                        const mx::array& cu_seqlens, const mx::array& slots,
                                        const std::optional<mx::array>& has_initial_state,
                                        const GatedDeltaOptions& options,
                                        mx::StreamOrDevice s = {});

struct GatedDeltaProblem {
  mx::Dtype dtype = mx::float32;
  int64_t num_seqs = 0;
  int64_t num_slots = 0;
  int64_t hk = 0, hv = 0, dk = 0, dv = 0;
  float eps = 1e-6f;
  bool copy_state = false;  // the new state's buffer is fresh: copy the old one first
};

std::string gated_delta_kernel_name(mx::Dtype dtype);

// Slots: 0 q, 1 k, 2 v, 3 a, 4 b, 5 A_log, 6 dt_bias, 7 cu_seqlens, 8 slots,
// 9 has_initial_state, 10 state, 11 y, 12 new state.
KernelPlan plan_gated_delta(const GatedDeltaProblem& p);

class GatedDelta : public KernelPrimitive {
 public:
  GatedDelta(mx::Stream stream, KernelBackend backend, float eps, int64_t chunk_size,
             bool inplace)
      : KernelPrimitive(stream, backend), eps_(eps), chunk_size_(chunk_size), inplace_(inplace) {}

  KernelPlan plan(const std::vector<mx::array>& inputs,
                  const std::vector<mx::array>& outputs) const override;
  const char* name() const override { return "GatedDelta"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 protected:
  void allocate_outputs(const std::vector<mx::array>& inputs,
                        std::vector<mx::array>& outputs) override;
  void eval_native_cpu(const std::vector<mx::array>& inputs,
                       std::vector<mx::array>& outputs) override;

 private:
  GatedDeltaProblem problem(const std::vector<mx::array>& inputs,
                            const std::vector<mx::array>& outputs) const;
  float eps_;
  int64_t chunk_size_;  // 0: recurrent
  bool inplace_;
};

}  // namespace vllm_metal
