#include "ops/rms_norm.h"

#include <cmath>
#include <stdexcept>

#include "cpu/rms_norm.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "ops/dtype_names.h"
#include "rms_norm_args.h"

namespace vllm_metal {

namespace {

void check_inputs(const char* op, const mx::array& x, const mx::array* residual,
                  const mx::array& weight, float eps) {
  check_float_dtype(op, "x", x.dtype());
  if (x.ndim() < 1) {
    throw std::invalid_argument(std::string("[") + op + "] x must have at least 1 dimension");
  }
  int hidden = x.shape(-1);
  if (weight.ndim() != 1 || weight.shape(0) != hidden) {
    throw std::invalid_argument(std::string("[") + op + "] weight must have shape [" +
                                std::to_string(hidden) + "] (the last axis of x)");
  }
  if (weight.dtype() != x.dtype()) {
    throw std::invalid_argument(std::string("[") + op + "] weight must have x's dtype " +
                                dtype_name(x.dtype()) + ", got " + dtype_name(weight.dtype()));
  }
  if (residual) {
    if (residual->shape() != x.shape()) {
      throw std::invalid_argument(std::string("[") + op +
                                  "] residual must have the shape of x");
    }
    if (residual->dtype() != x.dtype()) {
      throw std::invalid_argument(std::string("[") + op + "] residual must have x's dtype " +
                                  dtype_name(x.dtype()) + ", got " +
                                  dtype_name(residual->dtype()));
    }
  }
  if (!std::isfinite(eps) || eps < 0) {
    throw std::invalid_argument(std::string("[") + op + "] eps must be finite and >= 0");
  }
}

// Rows must be dense along the last axis; `contiguous` is free when they are.
mx::array row_major(const mx::array& a, mx::StreamOrDevice s) {
  return mx::contiguous(a, false, s);
}

}  // namespace

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps,
                   mx::StreamOrDevice s) {
  check_inputs("rms_norm", x, nullptr, weight, eps);
  auto stream = mx::to_stream(s);
  if (x.size() == 0) {
    return mx::zeros(x.shape(), x.dtype(), s);
  }
  return mx::array(
      x.shape(), x.dtype(),
      std::make_shared<RmsNorm>(stream, default_kernel_backend(), eps, /*fused_add=*/false),
      {row_major(x, s), row_major(weight, s)});
}

std::vector<mx::array> add_rms_norm(const mx::array& x, const mx::array& residual,
                                    const mx::array& weight, float eps,
                                    mx::StreamOrDevice s) {
  check_inputs("add_rms_norm", x, &residual, weight, eps);
  auto stream = mx::to_stream(s);
  if (x.size() == 0) {
    return {mx::zeros(x.shape(), x.dtype(), s), mx::zeros(x.shape(), x.dtype(), s)};
  }
  return mx::array::make_arrays(
      {x.shape(), x.shape()}, {x.dtype(), x.dtype()},
      std::make_shared<RmsNorm>(stream, default_kernel_backend(), eps, /*fused_add=*/true),
      {row_major(x, s), row_major(residual, s), row_major(weight, s)});
}

std::string rms_norm_kernel_name(mx::Dtype dtype, bool fused_add) {
  return std::string(fused_add ? "add_rms_norm_" : "rms_norm_") + dtype_name(dtype);
}

uint32_t rms_norm_threads(int64_t hidden) {
  // Enough threads to cover the row in a few passes; a whole simdgroup at least.
  uint32_t threads = 32;
  while (threads < 1024 && threads * 4 < hidden) {
    threads *= 2;
  }
  return threads;
}

KernelPlan plan_rms_norm(const RmsNormProblem& p) {
  KernelLaunch l;
  l.source = "rms_norm";
  l.kernel = rms_norm_kernel_name(p.dtype, p.fused_add);
  RmsNormArgs args{};
  args.x_row_stride = p.x_row_stride;
  args.residual_row_stride = p.residual_row_stride;
  args.out_row_stride = p.hidden;
  args.hidden = static_cast<uint32_t>(p.hidden);
  args.eps = p.eps;
  l.grid = {static_cast<uint32_t>(p.rows), 1, 1};
  l.threadgroup = {rms_norm_threads(p.hidden), 1, 1};
  if (p.fused_add) {
    // slots: 0 x, 1 residual, 2 weight, 3 out, 4 residual_out
    for (int i = 0; i < 5; ++i) l.bind(i, i);
    l.set_args(5, args);
  } else {
    // slots: 0 x, 1 weight, 2 out
    for (int i = 0; i < 3; ++i) l.bind(i, i);
    l.set_args(3, args);
  }
  return {l};
}

RmsNormProblem RmsNorm::problem(const std::vector<mx::array>& inputs) const {
  RmsNormProblem p;
  const auto& x = inputs[0];
  p.dtype = x.dtype();
  p.hidden = x.shape(-1);
  p.rows = static_cast<int64_t>(x.size()) / p.hidden;
  p.x_row_stride = p.hidden;  // inputs are row-contiguous (see row_major)
  p.residual_row_stride = p.hidden;
  p.fused_add = fused_add_;
  p.eps = eps_;
  return p;
}

KernelPlan RmsNorm::plan(const std::vector<mx::array>& inputs,
                         const std::vector<mx::array>&) const {
  return plan_rms_norm(problem(inputs));
}

bool RmsNorm::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const RmsNorm&>(other);
  return eps_ == o.eps_ && fused_add_ == o.fused_add_ && backend() == o.backend();
}

// ---- native CPU path --------------------------------------------------------

void RmsNorm::eval_native_cpu(const std::vector<mx::array>& inputs,
                              std::vector<mx::array>& outputs) {
  RmsNormProblem p = problem(inputs);
  cpu::RmsNormRows rows;
  rows.elt = elt_of(p.dtype);
  rows.rows = p.rows;
  rows.hidden = p.hidden;
  rows.x_row_stride = p.x_row_stride;
  rows.residual_row_stride = p.residual_row_stride;
  rows.eps = p.eps;
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  for (auto& a : outputs) encoder.set_output_array(a);
  encoder.dispatch([rows, inputs, outputs, fused = fused_add_]() mutable {
    rows.x = inputs[0].data<void>();
    rows.residual = fused ? inputs[1].data<void>() : nullptr;
    rows.weight = inputs[fused ? 2 : 1].data<void>();
    rows.out = outputs[0].data<void>();
    rows.residual_out = fused ? outputs[1].data<void>() : nullptr;
    cpu::rms_norm_rows(rows);
  });
}

}  // namespace vllm_metal
