// rms_norm and the fused add_rms_norm.
//
//   rms_norm(x, w, eps)          = x * rsqrt(mean(x^2, -1) + eps) * w
//   add_rms_norm(x, r, w, eps)   = (rms_norm(h, w, eps), h) with h = x + r
//                                  rounded to x.dtype
// All arithmetic in float32; x, residual and weight share one float dtype.
#pragma once

#include <vector>

#include "mlx/array.h"
#include "mlx/utils.h"
#include "ops/kernel_primitive.h"

namespace vllm_metal {

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps,
                   mx::StreamOrDevice s = {});

// Returns {normed, new_residual}.
std::vector<mx::array> add_rms_norm(const mx::array& x, const mx::array& residual,
                                    const mx::array& weight, float eps,
                                    mx::StreamOrDevice s = {});

// Plain-data view of one rms_norm problem (planner and CPU kernel input).
struct RmsNormProblem {
  mx::Dtype dtype = mx::float32;
  int64_t rows = 0;
  int64_t hidden = 0;
  int64_t x_row_stride = 0;
  int64_t residual_row_stride = 0;
  bool fused_add = false;
  float eps = 1e-6f;
};

std::string rms_norm_kernel_name(mx::Dtype dtype, bool fused_add);

// Launches for `p`: one threadgroup per row. Slots: x, [residual,] weight,
// out, [residual_out].
KernelPlan plan_rms_norm(const RmsNormProblem& p);

// Threads of a row's threadgroup; they fix the order a row's squares are summed in,
// which the fused decoder-layer kernels repeat (decoder_layer.metal).
uint32_t rms_norm_threads(int64_t hidden);

class RmsNorm : public KernelPrimitive {
 public:
  RmsNorm(mx::Stream stream, KernelBackend backend, float eps, bool fused_add)
      : KernelPrimitive(stream, backend), eps_(eps), fused_add_(fused_add) {}

  KernelPlan plan(const std::vector<mx::array>& inputs,
                  const std::vector<mx::array>& outputs) const override;
  const char* name() const override { return fused_add_ ? "AddRmsNorm" : "RmsNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 protected:
  void eval_native_cpu(const std::vector<mx::array>& inputs,
                       std::vector<mx::array>& outputs) override;

 private:
  RmsNormProblem problem(const std::vector<mx::array>& inputs) const;
  float eps_;
  bool fused_add_;
};

}  // namespace vllm_metal
