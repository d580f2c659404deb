// gelu: y = x * Phi(x) (erf GELU, BERT's "gelu") or, with `approximate`, the tanh form
// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) ("gelu_new"), element by element on
// any float array; float32 arithmetic, one rounding per output. Phi comes from Abramowitz
// & Stegun 7.1.26 (|erf error| <= 1.5e-7), the same formula on the CPU and in Metal.
#pragma once

#include <vector>

#include "mlx/array.h"
#include "mlx/utils.h"
#include "ops/kernel_primitive.h"

namespace vllm_metal {

mx::array gelu(const mx::array& x, bool approximate = false, mx::StreamOrDevice s = {});

// Slots: 0 x, 1 out.
KernelPlan plan_gelu(mx::Dtype dtype, int64_t count, bool approximate);

class Gelu : public KernelPrimitive {
 public:
  Gelu(mx::Stream stream, KernelBackend backend, bool approximate)
      : KernelPrimitive(stream, backend), approximate_(approximate) {}

  KernelPlan plan(const std::vector<mx::array>& inputs,
                  const std::vector<mx::array>& outputs) const override;
  const char* name() const override { return "Gelu"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 protected:
  void eval_native_cpu(const std::vector<mx::array>& inputs,
                       std::vector<mx::array>& outputs) override;

 private:
  bool approximate_;
};

}  // namespace vllm_metal
