// lora_apply: per-row LoRA adapters added to a base linear's output
// (Punica's BGMV: each row picks its adapter slot).
//
//   y         [T, out]          the base projection's output
//   x         [T, in]           the projection's input
//   lora_a    [S, R, in]        A of each slot (ranks below R zero-padded)
//   lora_b    [S, out, R]       B of each slot
//   scale     float32 [S]       lora_alpha / r of each slot
//   row_slot  int32 [T]         slot of each row, -1 = no adapter
//
//   out[t] = y[t] + scale[s] * B[s] @ (A[s] @ x[t])   with s = row_slot[t] >= 0
//   out[t] = y[t]                                     with s = -1
//
// One fused op rather than a shrink/expand pair: the intermediate h = A x is
// only R floats per row, so each row keeps it in registers / threadgroup
// memory instead of a [T, R] round trip through memory and a second launch.
// y, x, A and B share one float dtype; h and the sum are float32, one
// rounding per output. row_slot is host metadata: it is evaluated and range-
// checked here (kernels assume valid input).
#pragma once

#include <vector>

#include "mlx/array.h"
#include "mlx/utils.h"
#include "ops/kernel_primitive.h"

namespace vllm_metal {

mx::array lora_apply(const mx::array& y, const mx::array& x, const mx::array& lora_a,
                     const mx::array& lora_b, const mx::array& scale, const mx::array& row_slot,
                     mx::StreamOrDevice s = {});

struct LoraApplyProblem {
  mx::Dtype dtype = mx::float32;
  int64_t rows = 0;
  int64_t in_dim = 0;
  int64_t out_dim = 0;
  int64_t rank = 0;
  int64_t num_slots = 0;
};

std::string lora_apply_kernel_name(mx::Dtype dtype);

// Slots: 0 y, 1 x, 2 lora_a, 3 lora_b, 4 scale, 5 row_slot, 6 out.
// One threadgroup per (row, block of output columns).
KernelPlan plan_lora_apply(const LoraApplyProblem& p);

class LoraApply : public KernelPrimitive {
 public:
  LoraApply(mx::Stream stream, KernelBackend backend) : KernelPrimitive(stream, backend) {}

  KernelPlan plan(const std::vector<mx::array>& inputs,
                  const std::vector<mx::array>& outputs) const override;
  const char* name() const override { return "LoraApply"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 protected:
  void eval_native_cpu(const std::vector<mx::array>& inputs,
                       std::vector<mx::array>& outputs) override;

 private:
  LoraApplyProblem problem(const std::vector<mx::array>& inputs) const;
};

}  // namespace vllm_metal
