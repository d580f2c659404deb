#include "ops/moe.h"

#include <stdexcept>

#include "cpu/moe.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "moe_args.h"
#include "ops/dtype_names.h"
#include "ops/varlen.h"

namespace vllm_metal {

namespace {

constexpr const char* kOp = "fused_moe";
constexpr uint32_t kRowsPerGroup = 4;  // simdgroups per threadgroup in moe.metal

[[noreturn]] void fail(const std::string& msg) {
  throw std::invalid_argument(std::string("[") + kOp + "] " + msg);
}

mx::array dense(const mx::array& a, mx::StreamOrDevice s) {
  if (a.status() == mx::array::Status::available && a.flags().row_contiguous) return a;
  return mx::contiguous(a, false, s);
}

void check_weight(const char* what, const mx::array& w, int e, int rows, int cols,
                  const std::string& dims) {
  if (w.ndim() != 3 || w.shape(0) != e || w.shape(1) != rows || w.shape(2) != cols) {
    fail(std::string(what) + " must be " + dims + " = [" + std::to_string(e) + ", " +
         std::to_string(rows) + ", " + std::to_string(cols) + "], got " +
         shape_string(w.shape()));
  }
}

}  // namespace

void check_moe_scoring(const char* op, const std::string& scoring) {
  if (scoring != "softmax" && scoring != "sigmoid" && scoring != "softmax_topk") {
    throw std::invalid_argument(std::string("[") + op +
                                "] scoring must be 'softmax', 'sigmoid' or 'softmax_topk', got '" +
                                scoring + "'");
  }
}

std::vector<mx::array> moe_bias_inputs(const char* op, const MoeOptions& o, int e, int i, int h,
                                       mx::StreamOrDevice s) {
  auto bad = [op](const std::string& msg) {
    throw std::invalid_argument(std::string("[") + op + "] " + msg);
  };
  if (o.activation != "silu" && o.activation != "swiglu_oai") {
    bad("activation must be 'silu' or 'swiglu_oai', got '" + o.activation + "'");
  }
  const int given = int(o.b_gate.has_value()) + int(o.b_up.has_value()) + int(o.b_down.has_value());
  if (given == 0) return {};
  if (given != 3) bad("b_gate, b_up and b_down are given all together or not at all");
  std::vector<mx::array> out;
  const std::pair<const mx::array*, std::pair<const char*, mx::Shape>> want[] = {
      {&*o.b_gate, {"b_gate", {e, i}}}, {&*o.b_up, {"b_up", {e, i}}}, {&*o.b_down, {"b_down", {e, h}}}};
  for (const auto& [b, spec] : want) {
    check_float_dtype(op, spec.first, b->dtype());
    if (b->shape() != spec.second) {
      bad(std::string(spec.first) + " must be " + shape_string(spec.second) + ", got " +
          shape_string(b->shape()));
    }
    out.push_back(mx::contiguous(mx::astype(*b, mx::float32, s), false, s));
  }
  return out;
}

mx::array fused_moe(const mx::array& hidden, const mx::array& router_logits,
                    const mx::array& w_gate, const mx::array& w_up, const mx::array& w_down,
                    int top_k, bool renormalize, const std::string& scoring,
                    const MoeOptions& options, mx::StreamOrDevice s) {
  check_float_dtype(kOp, "hidden", hidden.dtype());
  check_float_dtype(kOp, "router_logits", router_logits.dtype());
  check_float_dtype(kOp, "w_gate", w_gate.dtype());
  check_moe_scoring(kOp, scoring);
  if (hidden.ndim() != 2) fail("hidden must be [num_tokens, hidden], got " + shape_string(hidden.shape()));
  const int t = hidden.shape(0), h = hidden.shape(1);
  if (router_logits.ndim() != 2 || router_logits.shape(0) != t || router_logits.shape(1) < 1) {
    fail("router_logits must be [" + std::to_string(t) + ", num_experts], got " +
         shape_string(router_logits.shape()));
  }
  const int e = router_logits.shape(1);
  if (w_gate.ndim() != 3) fail("w_gate must be [E, I, H], got " + shape_string(w_gate.shape()));
  const int i = w_gate.shape(1);
  check_weight("w_gate", w_gate, e, i, h, "[E, I, H]");
  check_weight("w_up", w_up, e, i, h, "[E, I, H]");
  check_weight("w_down", w_down, e, h, i, "[E, H, I]");
  if (w_up.dtype() != w_gate.dtype() || w_down.dtype() != w_gate.dtype()) {
    fail("w_gate, w_up and w_down must share one dtype, got " + dtype_name(w_gate.dtype()) +
         ", " + dtype_name(w_up.dtype()) + ", " + dtype_name(w_down.dtype()));
  }
  if (top_k < 1 || top_k > e) {
    fail("top_k must be in [1, num_experts = " + std::to_string(e) + "], got " +
         std::to_string(top_k));
  }
  if (i < 1) fail("the expert width I must be positive");
  std::vector<mx::array> biases = moe_bias_inputs(kOp, options, e, i, h, s);
  if (t == 0) return mx::zeros({0, h}, hidden.dtype(), s);

  const mx::Stream stream = mx::to_stream(s);
  const KernelBackend backend = default_kernel_backend();
  // the Metal path's float32 scratch; the native CPU kernel keeps its own
  const bool native_cpu = stream.device.type == mx::Device::cpu && backend == KernelBackend::kNative;
  const int slots = t * top_k;
  const mx::Shape act_shape = native_cpu ? mx::Shape{0} : mx::Shape{slots, i};
  const mx::Shape y_shape = native_cpu ? mx::Shape{0} : mx::Shape{slots, h};
  auto prim = std::make_shared<FusedMoe>(stream, backend, top_k, renormalize,
                                         scoring == "sigmoid", scoring == "softmax_topk",
                                         options.activation == "swiglu_oai");
  std::vector<mx::array> inputs = {dense(hidden, s),
                                   dense(mx::astype(router_logits, mx::float32, s), s),
                                   dense(w_gate, s), dense(w_up, s), dense(w_down, s)};
  inputs.insert(inputs.end(), biases.begin(), biases.end());
  auto outs = mx::array::make_arrays(
      {hidden.shape(), {t, top_k}, {t, top_k}, act_shape, y_shape},
      {hidden.dtype(), mx::int32, mx::float32, mx::float32, mx::float32}, prim, inputs);
  return outs[0];
}

KernelPlan plan_fused_moe(const MoeProblem& p) {
  MoeArgs args{};
  args.num_tokens = static_cast<uint32_t>(p.num_tokens);
  args.hidden = static_cast<uint32_t>(p.hidden);
  args.num_experts = static_cast<uint32_t>(p.num_experts);
  args.inter = static_cast<uint32_t>(p.inter);
  args.top_k = static_cast<uint32_t>(p.top_k);
  args.renormalize = p.renormalize ? 1u : 0u;
  args.sigmoid = p.sigmoid ? 1u : 0u;
  args.flags = (p.topk_softmax ? kMoeTopkSoftmax : 0u) | (p.oai_act ? kMoeOaiAct : 0u) |
               (p.bias ? kMoeBias : 0u);
  // outputs follow the inputs; without biases the bias slots are bound to the weights
  // (never read: args.flags has no kMoeBias)
  const int o = p.bias ? 8 : 5;
  const int b_gate = p.bias ? 5 : 2, b_up = p.bias ? 6 : 3, b_down = p.bias ? 7 : 4;
  const std::string x_name = dtype_name(p.dtype), w_name = dtype_name(p.w_dtype);
  KernelPlan plan;

  KernelLaunch route;
  route.source = "moe";
  route.kernel = "moe_route";
  route.bind(0, 1);
  route.bind(1, o + 1);
  route.bind(2, o + 2);
  route.set_args(3, args);
  route.threadgroup = {64, 1, 1};
  route.grid = {ceil_div(p.num_tokens, 64), 1, 1};
  plan.push_back(route);

  KernelLaunch gate_up;
  gate_up.source = "moe";
  gate_up.kernel = "moe_gate_up_" + x_name + "_" + w_name;
  gate_up.bind(0, 0);
  gate_up.bind(1, 2);
  gate_up.bind(2, 3);
  gate_up.bind(3, o + 1);
  gate_up.bind(4, o + 3);
  gate_up.set_args(5, args);
  gate_up.bind(6, b_gate);
  gate_up.bind(7, b_up);
  gate_up.threadgroup = {32 * kRowsPerGroup, 1, 1};
  gate_up.grid = {ceil_div(p.inter, kRowsPerGroup), static_cast<uint32_t>(p.num_experts), 1};
  plan.push_back(gate_up);

  KernelLaunch down;
  down.source = "moe";
  down.kernel = "moe_down_" + w_name;
  down.bind(0, o + 3);
  down.bind(1, 4);
  down.bind(2, o + 1);
  down.bind(3, o + 4);
  down.set_args(4, args);
  down.bind(5, b_down);
  down.threadgroup = {32 * kRowsPerGroup, 1, 1};
  down.grid = {ceil_div(p.hidden, kRowsPerGroup), static_cast<uint32_t>(p.num_experts), 1};
  plan.push_back(down);

  KernelLaunch combine;
  combine.source = "moe";
  combine.kernel = "moe_combine_" + x_name;
  combine.bind(0, o + 4);
  combine.bind(1, o + 2);
  combine.bind(2, o);
  combine.set_args(3, args);
  combine.threadgroup = {64, 1, 1};
  combine.grid = {ceil_div(p.hidden, 64), static_cast<uint32_t>(p.num_tokens), 1};
  plan.push_back(combine);
  return plan;
}

MoeProblem FusedMoe::problem(const std::vector<mx::array>& inputs) const {
  MoeProblem p;
  p.dtype = inputs[0].dtype();
  p.w_dtype = inputs[2].dtype();
  p.num_tokens = inputs[0].shape(0);
  p.hidden = inputs[0].shape(1);
  p.num_experts = inputs[1].shape(1);
  p.inter = inputs[2].shape(1);
  p.top_k = top_k_;
  p.renormalize = renormalize_;
  p.sigmoid = sigmoid_;
  p.topk_softmax = topk_softmax_;
  p.oai_act = oai_act_;
  p.bias = inputs.size() > 5;
  return p;
}

KernelPlan FusedMoe::plan(const std::vector<mx::array>& inputs,
                          const std::vector<mx::array>& outputs) const {
  return plan_fused_moe(problem(inputs));
}

bool FusedMoe::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const FusedMoe&>(other);
  return top_k_ == o.top_k_ && renormalize_ == o.renormalize_ && sigmoid_ == o.sigmoid_ &&
      topk_softmax_ == o.topk_softmax_ && oai_act_ == o.oai_act_ && backend() == o.backend();
}

void FusedMoe::eval_native_cpu(const std::vector<mx::array>& inputs,
                               std::vector<mx::array>& outputs) {
  const MoeProblem p = problem(inputs);
  cpu::MoeRows rows;
  rows.elt = elt_of(p.dtype);
  rows.w_elt = elt_of(p.w_dtype);
  rows.num_tokens = p.num_tokens;
  rows.hidden = p.hidden;
  rows.num_experts = p.num_experts;
  rows.inter = p.inter;
  rows.top_k = p.top_k;
  rows.renormalize = p.renormalize;
  rows.sigmoid = p.sigmoid;
  rows.extras.topk_softmax = p.topk_softmax;
  rows.extras.oai_act = p.oai_act;
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& x : inputs) encoder.set_input_array(x);
  for (auto& x : outputs) encoder.set_output_array(x);
  encoder.dispatch([rows, inputs, outputs]() mutable {
    rows.x = inputs[0].data<void>();
    rows.logits = inputs[1].data<float>();
    rows.w_gate = inputs[2].data<void>();
    rows.w_up = inputs[3].data<void>();
    rows.w_down = inputs[4].data<void>();
    rows.out = outputs[0].data<void>();
    rows.ids = outputs[1].data<int32_t>();
    rows.weights = outputs[2].data<float>();
    if (inputs.size() > 5) {
      rows.extras.b_gate = inputs[5].data<float>();
      rows.extras.b_up = inputs[6].data<float>();
      rows.extras.b_down = inputs[7].data<float>();
    }
    cpu::fused_moe_rows(rows);
  });
}

}  // namespace vllm_metal
