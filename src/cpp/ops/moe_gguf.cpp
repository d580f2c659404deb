#include "ops/moe_gguf.h"

#include <cstring>
#include <stdexcept>

#include "cpu/moe_gguf.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "moe_args.h"
#include "ops/dtype_names.h"
#include "ops/gguf_ops.h"
#include "ops/moe.h"
#include "ops/varlen.h"

namespace vllm_metal {

namespace {

constexpr const char* kOp = "fused_moe_gguf";

[[noreturn]] void fail(const std::string& msg) {
  throw std::invalid_argument(std::string("[") + kOp + "] " + msg);
}

// Checks one expert tensor [E, rows, cols] of `type`.
void check_experts(const char* what, const mx::array& blocks, gguf::GGMLType type, int64_t e,
                   int64_t rows, int64_t cols) {
  check_gguf_type(kOp, type);
  if (blocks.dtype() != mx::uint8) {
    fail(std::string(what) + " must be uint8 (the tensor's bytes), got " +
         dtype_name(blocks.dtype()));
  }
  const gguf::TypeInfo ti = gguf::type_info(type);
  if (cols % ti.block_size != 0) {
    fail(std::string(what) + ": rows of " + std::to_string(cols) + " weights are not a multiple of the " +
         ti.name + " block size " + std::to_string(ti.block_size));
  }
  const int64_t want = e * rows * gguf::row_bytes(type, cols);
  if (static_cast<int64_t>(blocks.size()) != want) {
    fail(std::string(what) + " must hold " + std::to_string(want) + " bytes for " + ti.name + " [" +
         std::to_string(e) + ", " + std::to_string(rows) + ", " + std::to_string(cols) +
         "], got " + std::to_string(blocks.size()));
  }
}

}  // namespace

mx::array fused_moe_gguf(const mx::array& hidden, const mx::array& router_logits,
                         const MoeGgufWeights& w, int top_k, bool renormalize,
                         const std::string& scoring, bool exact, const MoeOptions& options,
                         mx::StreamOrDevice s) {
  check_float_dtype(kOp, "hidden", hidden.dtype());
  check_float_dtype(kOp, "router_logits", router_logits.dtype());
  check_moe_scoring(kOp, scoring);
  if (hidden.ndim() != 2) fail("hidden must be [num_tokens, hidden], got " + shape_string(hidden.shape()));
  const int t = hidden.shape(0), h = hidden.shape(1);
  if (router_logits.ndim() != 2 || router_logits.shape(0) != t || router_logits.shape(1) < 1) {
    fail("router_logits must be [" + std::to_string(t) + ", num_experts], got " +
         shape_string(router_logits.shape()));
  }
  const int e = router_logits.shape(1);
  if (w.inter < 1) fail("inter (the expert width I) must be positive, got " + std::to_string(w.inter));
  check_experts("gate", w.gate, w.gate_type, e, w.inter, h);
  check_experts("up", w.up, w.up_type, e, w.inter, h);
  check_experts("down", w.down, w.down_type, e, h, w.inter);
  if (top_k < 1 || top_k > e) {
    fail("top_k must be in [1, num_experts = " + std::to_string(e) + "], got " +
         std::to_string(top_k));
  }
  std::vector<mx::array> biases = moe_bias_inputs(kOp, options, e, w.inter, h, s);
  if (t == 0) return mx::zeros({0, h}, hidden.dtype(), s);

  const mx::Stream stream = mx::to_stream(s);
  const KernelBackend backend = default_kernel_backend();
  const bool native_cpu = stream.device.type == mx::Device::cpu && backend == KernelBackend::kNative;
  const int slots = t * top_k;
  MoeGgufProblem shape;
  shape.gate_type = w.gate_type;
  shape.up_type = w.up_type;
  shape.down_type = w.down_type;
  shape.num_experts = e;
  shape.inter = w.inter;
  shape.top_k = top_k;
  shape.renormalize = renormalize;
  shape.sigmoid = scoring == "sigmoid";
  shape.topk_softmax = scoring == "softmax_topk";
  shape.oai_act = options.activation == "swiglu_oai";
  shape.bias = !biases.empty();
  auto prim = std::make_shared<FusedMoeGguf>(stream, backend, shape, exact);
  auto flat = [&](const mx::array& b) { return mx::contiguous(mx::flatten(b, s), false, s); };
  std::vector<mx::array> inputs = {
      mx::contiguous(hidden, false, s),
      mx::contiguous(mx::astype(router_logits, mx::float32, s), false, s), flat(w.gate),
      flat(w.up), flat(w.down)};
  inputs.insert(inputs.end(), biases.begin(), biases.end());
  auto outs = mx::array::make_arrays(
      {hidden.shape(), {t, top_k}, {t, top_k},
       native_cpu ? mx::Shape{0} : mx::Shape{slots, w.inter},
       native_cpu ? mx::Shape{0} : mx::Shape{slots, h}},
      {hidden.dtype(), mx::int32, mx::float32, mx::float32, mx::float32}, prim, inputs);
  return outs[0];
}

KernelPlan plan_fused_moe_gguf(const MoeGgufProblem& p) {
  // routing and combine are the dense op's launches; gate/up and down bind the same
  // slots and take the GGUF kernels
  MoeProblem dense;
  dense.dtype = p.dtype;
  dense.w_dtype = mx::float32;
  dense.num_tokens = p.num_tokens;
  dense.hidden = p.hidden;
  dense.num_experts = p.num_experts;
  dense.inter = p.inter;
  dense.top_k = p.top_k;
  dense.renormalize = p.renormalize;
  dense.sigmoid = p.sigmoid;
  dense.topk_softmax = p.topk_softmax;
  dense.oai_act = p.oai_act;
  dense.bias = p.bias;
  KernelPlan plan = plan_fused_moe(dense);
  MoeGgufArgs args{};
  std::memcpy(&args.moe, plan[0].args.data(), sizeof(MoeArgs));
  args.gate_type = static_cast<uint32_t>(p.gate_type);
  args.up_type = static_cast<uint32_t>(p.up_type);
  args.down_type = static_cast<uint32_t>(p.down_type);
  args.piece = 16;
  args.gate_row_bytes = static_cast<uint64_t>(gguf::row_bytes(p.gate_type, p.hidden));
  args.up_row_bytes = static_cast<uint64_t>(gguf::row_bytes(p.up_type, p.hidden));
  args.down_row_bytes = static_cast<uint64_t>(gguf::row_bytes(p.down_type, p.inter));
  plan[1].source = "moe_gguf";
  plan[1].kernel = "moe_gguf_gate_up_" + dtype_name(p.dtype);
  plan[1].set_args(5, args);
  plan[2].source = "moe_gguf";
  plan[2].kernel = "moe_gguf_down";
  plan[2].set_args(4, args);
  return plan;
}

MoeGgufProblem FusedMoeGguf::problem(const std::vector<mx::array>& inputs) const {
  MoeGgufProblem p = shape_;
  p.dtype = inputs[0].dtype();
  p.num_tokens = inputs[0].shape(0);
  p.hidden = inputs[0].shape(1);
  return p;
}

KernelPlan FusedMoeGguf::plan(const std::vector<mx::array>& inputs,
                              const std::vector<mx::array>& outputs) const {
  return plan_fused_moe_gguf(problem(inputs));
}

bool FusedMoeGguf::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const FusedMoeGguf&>(other);
  const MoeGgufProblem &a = shape_, &b = o.shape_;
  return a.gate_type == b.gate_type && a.up_type == b.up_type && a.down_type == b.down_type &&
      a.num_experts == b.num_experts && a.inter == b.inter && a.top_k == b.top_k &&
      a.renormalize == b.renormalize && a.sigmoid == b.sigmoid &&
      a.topk_softmax == b.topk_softmax && a.oai_act == b.oai_act && a.bias == b.bias &&
      exact_ == o.exact_ &&
      backend() == o.backend();
}

void FusedMoeGguf::eval_native_cpu(const std::vector<mx::array>& inputs,
                                   std::vector<mx::array>& outputs) {
  const MoeGgufProblem p = problem(inputs);
  cpu::MoeGgufRows rows;
  rows.elt = elt_of(p.dtype);
  rows.gate_type = p.gate_type;
  rows.up_type = p.up_type;
  rows.down_type = p.down_type;
  rows.num_tokens = p.num_tokens;
  rows.hidden = p.hidden;
  rows.num_experts = p.num_experts;
  rows.inter = p.inter;
  rows.top_k = p.top_k;
  rows.renormalize = p.renormalize;
  rows.sigmoid = p.sigmoid;
  rows.exact = exact_;
  rows.extras.topk_softmax = p.topk_softmax;
  rows.extras.oai_act = p.oai_act;
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& x : inputs) encoder.set_input_array(x);
  for (auto& x : outputs) encoder.set_output_array(x);
  encoder.dispatch([rows, inputs, outputs]() mutable {
    rows.x = inputs[0].data<void>();
    rows.logits = inputs[1].data<float>();
    rows.w_gate = inputs[2].data<uint8_t>();
    rows.w_up = inputs[3].data<uint8_t>();
    rows.w_down = inputs[4].data<uint8_t>();
    rows.out = outputs[0].data<void>();
    rows.ids = outputs[1].data<int32_t>();
    rows.weights = outputs[2].data<float>();
    if (inputs.size() > 5) {
      rows.extras.b_gate = inputs[5].data<float>();
      rows.extras.b_up = inputs[6].data<float>();
      rows.extras.b_down = inputs[7].data<float>();
    }
    cpu::fused_moe_gguf_rows(rows);
  });
}

}  // namespace vllm_metal
