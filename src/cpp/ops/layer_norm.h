// layer_norm: LayerNorm over the last axis, optionally of a residual sum (post-LN blocks):
//   h = x (+ residual, rounded to x's dtype)
//   y = (h - mean(h)) / sqrt(var(h) + eps) * weight + bias
// float32 arithmetic, one rounding per output. x, residual, weight and bias share one float
// dtype. On the CPU threaded over rows (MLX's CPU LayerNorm and add run on one thread).
#pragma once

#include <optional>
#include <vector>

#include "mlx/array.h"
#include "mlx/utils.h"
#include "ops/kernel_primitive.h"

namespace vllm_metal {

mx::array layer_norm(const mx::array& x, const mx::array& weight, const mx::array& bias,
                     float eps, const std::optional<mx::array>& residual = std::nullopt,
                     mx::StreamOrDevice s = {});

// Slots: 0 x, 1 weight, 2 bias, 3 out; with residual: 0 x, 1 residual, 2 weight, 3 bias, 4 out.
KernelPlan plan_layer_norm(mx::Dtype dtype, int64_t rows, int64_t hidden, float eps,
                           bool residual);

class LayerNorm : public KernelPrimitive {
 public:
  LayerNorm(mx::Stream stream, KernelBackend backend, float eps, bool residual)
      : KernelPrimitive(stream, backend), eps_(eps), residual_(residual) {}

  KernelPlan plan(const std::vector<mx::array>& inputs,
                  const std::vector<mx::array>& outputs) const override;
  const char* name() const override { return residual_ ? "AddLayerNorm" : "LayerNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 protected:
  void eval_native_cpu(const std::vector<mx::array>& inputs,
                       std::vector<mx::array>& outputs) override;

 private:
  float eps_;
  bool residual_;
};

}  // namespace vllm_metal
