#include "ops/layer_norm.h"

#include <cmath>
#include <stdexcept>

#include "cpu/layer_norm.h"
#include "layer_norm_args.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "ops/dtype_names.h"
#include "ops/rms_norm.h"

namespace vllm_metal {

namespace {

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("[layer_norm] " + what);
}

void check_vector(const char* name, const mx::array& v, const mx::array& x) {
  if (v.ndim() != 1 || v.shape(0) != x.shape(-1)) {
    fail(std::string(name) + " must have shape [" + std::to_string(x.shape(-1)) +
         "] (the last axis of x)");
  }
  if (v.dtype() != x.dtype()) {
    fail(std::string(name) + " must have x's dtype " + dtype_name(x.dtype()) + ", got " +
         dtype_name(v.dtype()));
  }
}

}  // namespace

mx::array layer_norm(const mx::array& x, const mx::array& weight, const mx::array& bias,
                     float eps, const std::optional<mx::array>& residual, mx::StreamOrDevice s) {
  check_float_dtype("layer_norm", "x", x.dtype());
  if (x.ndim() < 1) fail("x must have at least 1 dimension");
  check_vector("weight", weight, x);
  check_vector("bias", bias, x);
  if (residual) {
    if (residual->shape() != x.shape()) fail("residual must have the shape of x");
    if (residual->dtype() != x.dtype()) {
      fail("residual must have x's dtype " + dtype_name(x.dtype()) + ", got " +
           dtype_name(residual->dtype()));
    }
  }
  if (!(eps >= 0.0f) || !std::isfinite(eps)) fail("eps must be finite and >= 0");
  if (x.size() == 0) return mx::zeros(x.shape(), x.dtype(), s);
  std::vector<mx::array> inputs = {mx::contiguous(x, false, s)};
  if (residual) inputs.push_back(mx::contiguous(*residual, false, s));
  inputs.push_back(mx::contiguous(weight, false, s));
  inputs.push_back(mx::contiguous(bias, false, s));
  return mx::array(x.shape(), x.dtype(),
                   std::make_shared<LayerNorm>(mx::to_stream(s), default_kernel_backend(), eps,
                                               residual.has_value()),
                   std::move(inputs));
}

KernelPlan plan_layer_norm(mx::Dtype dtype, int64_t rows, int64_t hidden, float eps,
                           bool residual) {
  KernelLaunch l;
  l.source = "layer_norm";
  l.kernel = "layer_norm_" + dtype_name(dtype);
  l.set_args(5, LayerNormArgs{static_cast<uint32_t>(hidden), residual ? 1u : 0u, eps, 0u});
  l.grid = {static_cast<uint32_t>(rows), 1, 1};
  l.threadgroup = {rms_norm_threads(hidden), 1, 1};
  if (residual) {
    for (int i = 0; i < 5; ++i) l.bind(i, i);
  } else {
    // no residual: buffer 1 is never read, bound to x so that every buffer is bound
    const int slots[5] = {0, 0, 1, 2, 3};
    for (int i = 0; i < 5; ++i) l.bind(i, slots[i]);
  }
  return {l};
}

KernelPlan LayerNorm::plan(const std::vector<mx::array>& inputs,
                           const std::vector<mx::array>&) const {
  const auto& x = inputs[0];
  const int64_t hidden = x.shape(-1);
  return plan_layer_norm(x.dtype(), static_cast<int64_t>(x.size()) / hidden, hidden, eps_,
                         residual_);
}

bool LayerNorm::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const LayerNorm&>(other);
  return eps_ == o.eps_ && residual_ == o.residual_ && backend() == o.backend();
}

void LayerNorm::eval_native_cpu(const std::vector<mx::array>& inputs,
                                std::vector<mx::array>& outputs) {
  cpu::LayerNormRows a;
  const auto& x = inputs[0];
  a.elt = elt_of(x.dtype());
  a.hidden = x.shape(-1);
  a.rows = static_cast<int64_t>(x.size()) / a.hidden;
  a.eps = eps_;
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  encoder.set_output_array(outputs[0]);
  encoder.dispatch([a, inputs, out = outputs[0], res = residual_]() mutable {
    a.x = inputs[0].data<void>();
    a.residual = res ? inputs[1].data<void>() : nullptr;
    a.weight = inputs[res ? 2 : 1].data<void>();
    a.bias = inputs[res ? 3 : 2].data<void>();
    a.out = out.data<void>();
    cpu::layer_norm_rows(a);
  });
}

}  // namespace vllm_metal
