#include "ops/gelu.h"

#include "cpu/gelu.h"
#include "gelu_args.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "ops/dtype_names.h"

namespace vllm_metal {

mx::array gelu(const mx::array& x, bool approximate, mx::StreamOrDevice s) {
  check_float_dtype("gelu", "x", x.dtype());
  if (x.size() == 0) return mx::zeros(x.shape(), x.dtype(), s);
  // flags are known once evaluated; mx::contiguous is free at eval time for dense input
  const bool dense = x.status() == mx::array::Status::available && x.flags().row_contiguous;
  const mx::array xd = dense ? x : mx::contiguous(x, false, s);
  auto prim = std::make_shared<Gelu>(mx::to_stream(s), default_kernel_backend(), approximate);
  return mx::array(x.shape(), x.dtype(), prim, {xd});
}

KernelPlan plan_gelu(mx::Dtype dtype, int64_t count, bool approximate) {
  KernelLaunch l;
  l.source = "gelu";
  l.kernel = "gelu_" + dtype_name(dtype);
  l.bind(0, 0);
  l.bind(1, 1);
  l.set_args(2, GeluArgs{static_cast<uint64_t>(count), approximate ? 1u : 0u, 0u});
  l.threadgroup = {256, 1, 1};
  l.grid = {ceil_div(count, 256), 1, 1};
  return {l};
}

KernelPlan Gelu::plan(const std::vector<mx::array>& inputs, const std::vector<mx::array>&) const {
  return plan_gelu(inputs[0].dtype(), inputs[0].size(), approximate_);
}

bool Gelu::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const Gelu&>(other);
  return approximate_ == o.approximate_ && backend() == o.backend();
}

void Gelu::eval_native_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(inputs[0]);
  encoder.set_output_array(outputs[0]);
  encoder.dispatch([x = inputs[0], out = outputs[0], approximate = approximate_]() mutable {
    cpu::gelu(elt_of(x.dtype()), x.data<void>(), out.data<void>(), x.size(), approximate);
  });
}

}  // namespace vllm_metal
