#include "ops/causal_conv1d.h"

#include <cstring>
#include <stdexcept>

#include "causal_conv1d_args.h"
#include "cpu/causal_conv1d.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "ops/dtype_names.h"
#include "ops/varlen.h"

namespace vllm_metal {

namespace {

constexpr const char* kOp = "causal_conv1d";

[[noreturn]] void fail(const std::string& msg) {
  throw std::invalid_argument(std::string("[") + kOp + "] " + msg);
}

mx::array dense(const mx::array& a, mx::StreamOrDevice s) {
  if (a.status() == mx::array::Status::available && a.flags().row_contiguous) return a;
  return mx::contiguous(a, false, s);
}

void check_same_dtype(const char* what, const mx::array& a, const mx::array& x) {
  if (a.dtype() != x.dtype()) {
    fail(std::string(what) + " must have x's dtype " + dtype_name(x.dtype()) + ", got " +
         dtype_name(a.dtype()));
  }
}

}  // namespace

std::vector<mx::array> causal_conv1d(const mx::array& x, const mx::array& weight,
                                     const std::optional<mx::array>& bias,
                                     const mx::array& conv_state, const mx::array& cu_seqlens,
                                     const mx::array& slots,
                                     const std::optional<mx::array>& has_initial_state,
                                     bool silu, bool inplace, mx::StreamOrDevice s) {
  check_float_dtype(kOp, "x", x.dtype());
  if (x.ndim() != 2) fail("x must be [num_tokens, channels], got " + shape_string(x.shape()));
  const int t = x.shape(0), c = x.shape(1);
  if (weight.ndim() != 2 || weight.shape(0) != c || weight.shape(1) < 2 || weight.shape(1) > 8) {
    fail("weight must be [" + std::to_string(c) + ", width] with width in [2, 8], got " +
         shape_string(weight.shape()));
  }
  const int k = weight.shape(1);
  check_same_dtype("weight", weight, x);
  if (bias) {
    check_same_dtype("bias", *bias, x);
    if (bias->shape() != mx::Shape{c}) {
      fail("bias must be [" + std::to_string(c) + "], got " + shape_string(bias->shape()));
    }
  }
  check_same_dtype("conv_state", conv_state, x);
  if (conv_state.ndim() != 3 || conv_state.shape(1) != c || conv_state.shape(2) != k - 1) {
    fail("conv_state must be [num_slots, " + std::to_string(c) + ", " + std::to_string(k - 1) +
         "], got " + shape_string(conv_state.shape()));
  }
  VarlenBatch batch =
      check_varlen(kOp, cu_seqlens, slots, has_initial_state, t, conv_state.shape(0), s);
  if (t == 0) return {mx::zeros({0, c}, x.dtype(), s), conv_state};
  auto prim = std::make_shared<CausalConv1d>(mx::to_stream(s), default_kernel_backend(),
                                             bias.has_value(), silu, inplace);
  const mx::array xd = dense(x, s);
  return mx::array::make_arrays(
      {x.shape(), conv_state.shape()}, {x.dtype(), x.dtype()}, prim,
      {xd, bias ? dense(*bias, s) : xd, dense(weight, s), batch.cu_seqlens, batch.slots,
       batch.has_initial_state, dense(conv_state, s)});
}

std::string causal_conv1d_kernel_name(mx::Dtype dtype) {
  return "causal_conv1d_" + dtype_name(dtype);
}

KernelPlan plan_causal_conv1d(const CausalConv1dProblem& p) {
  KernelPlan plan;
  if (p.copy_state) {
    const uint64_t count = uint64_t(p.num_slots) * p.channels * (p.width - 1);
    KernelLaunch copy;
    copy.source = "causal_conv1d";
    copy.kernel = "causal_conv1d_copy_state_" + dtype_name(p.dtype);
    copy.bind(0, 6);
    copy.bind(1, 8);
    copy.set_args(2, ConvStateCopyArgs{count});
    copy.threadgroup = {256, 1, 1};
    copy.grid = {ceil_div(count, 256), 1, 1};
    plan.push_back(copy);
  }
  CausalConv1dArgs args{};
  args.num_seqs = static_cast<uint32_t>(p.num_seqs);
  args.channels = static_cast<uint32_t>(p.channels);
  args.width = static_cast<uint32_t>(p.width);
  args.has_bias = p.has_bias ? 1u : 0u;
  args.silu = p.silu ? 1u : 0u;
  KernelLaunch l;
  l.source = "causal_conv1d";
  l.kernel = causal_conv1d_kernel_name(p.dtype);
  for (int i = 0; i < 6; ++i) l.bind(i, i);
  l.bind(6, 8);  // the new state, updated in place
  l.bind(7, 7);  // out
  l.set_args(8, args);
  // one thread per channel, up to 128 channels per threadgroup
  const uint32_t threads = static_cast<uint32_t>(std::min<int64_t>(128, p.channels));
  l.threadgroup = {threads, 1, 1};
  l.grid = {ceil_div(p.channels, threads), static_cast<uint32_t>(p.num_seqs), 1};
  plan.push_back(l);
  return plan;
}

CausalConv1dProblem CausalConv1d::problem(const std::vector<mx::array>& inputs,
                                          const std::vector<mx::array>& outputs) const {
  CausalConv1dProblem p;
  p.dtype = inputs[0].dtype();
  p.num_seqs = inputs[4].shape(0);
  p.num_slots = inputs[6].shape(0);
  p.channels = inputs[0].shape(1);
  p.width = inputs[2].shape(1);
  p.has_bias = has_bias_;
  p.silu = silu_;
  p.copy_state = outputs[1].data<char>() != inputs[6].data<char>();
  return p;
}

void CausalConv1d::allocate_outputs(const std::vector<mx::array>& inputs,
                                    std::vector<mx::array>& outputs) {
  outputs[0].set_data(mx::allocator::malloc(outputs[0].nbytes()));
  const auto& state = inputs[6];
  if (state.flags().row_contiguous && (inplace_ || state.is_donatable())) {
    outputs[1].copy_shared_buffer(state);
  } else {
    outputs[1].set_data(mx::allocator::malloc(outputs[1].nbytes()));
  }
}

KernelPlan CausalConv1d::plan(const std::vector<mx::array>& inputs,
                              const std::vector<mx::array>& outputs) const {
  return plan_causal_conv1d(problem(inputs, outputs));
}

bool CausalConv1d::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const CausalConv1d&>(other);
  return has_bias_ == o.has_bias_ && silu_ == o.silu_ && inplace_ == o.inplace_ &&
      backend() == o.backend();
}

void CausalConv1d::eval_native_cpu(const std::vector<mx::array>& inputs,
                                   std::vector<mx::array>& outputs) {
  const CausalConv1dProblem p = problem(inputs, outputs);
  cpu::CausalConv1dRows rows;
  rows.elt = elt_of(p.dtype);
  rows.num_seqs = p.num_seqs;
  rows.channels = p.channels;
  rows.width = p.width;
  rows.silu = p.silu;
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& x : inputs) encoder.set_input_array(x);
  for (auto& x : outputs) encoder.set_output_array(x);
  encoder.dispatch([rows, inputs, outputs, copy = p.copy_state, bias = p.has_bias]() mutable {
    if (copy) {
      std::memcpy(outputs[1].data<char>(), inputs[6].data<char>(), outputs[1].nbytes());
    }
    rows.x = inputs[0].data<void>();
    rows.bias = bias ? inputs[1].data<void>() : nullptr;
    rows.weight = inputs[2].data<void>();
    rows.cu_seqlens = inputs[3].data<int32_t>();
    rows.slots = inputs[4].data<int32_t>();
    rows.has_initial_state = inputs[5].data<int32_t>();
    rows.state = outputs[1].data<void>();
    rows.out = outputs[0].data<void>();
    cpu::causal_conv1d_rows(rows);
  });
}

}  // namespace vllm_metal
