#include "ops/lora.h"

#include <stdexcept>

#include "cpu/lora.h"
#include "lora_args.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/transforms.h"
#include "ops/dtype_names.h"
#include "ops/varlen.h"

namespace vllm_metal {

namespace {

constexpr const char* kOp = "lora_apply";
constexpr uint32_t kThreads = 128;  // output columns per threadgroup

[[noreturn]] void fail(const std::string& msg) {
  throw std::invalid_argument(std::string("[") + kOp + "] " + msg);
}

mx::array dense(const mx::array& a, mx::StreamOrDevice s) {
  if (a.status() == mx::array::Status::available && a.flags().row_contiguous) return a;
  return mx::contiguous(a, false, s);
}

void check_same_dtype(const char* what, const mx::array& a, const mx::array& y) {
  if (a.dtype() != y.dtype()) {
    fail(std::string(what) + " must have y's dtype " + dtype_name(y.dtype()) + ", got " +
         dtype_name(a.dtype()));
  }
}

}  // namespace

mx::array lora_apply(const mx::array& y, const mx::array& x, const mx::array& lora_a,
                     const mx::array& lora_b, const mx::array& scale, const mx::array& row_slot,
                     mx::StreamOrDevice s) {
  check_float_dtype(kOp, "y", y.dtype());
  if (y.ndim() != 2) fail("y must be [num_tokens, out], got " + shape_string(y.shape()));
  if (x.ndim() != 2 || x.shape(0) != y.shape(0)) {
    fail("x must be [" + std::to_string(y.shape(0)) + ", in], got " + shape_string(x.shape()));
  }
  const int t = y.shape(0), out = y.shape(1), in = x.shape(1);
  check_same_dtype("x", x, y);
  check_same_dtype("lora_a", lora_a, y);
  check_same_dtype("lora_b", lora_b, y);
  if (lora_a.ndim() != 3 || lora_a.shape(2) != in) {
    fail("lora_a must be [num_slots, rank, " + std::to_string(in) + "], got " +
         shape_string(lora_a.shape()));
  }
  const int slots = lora_a.shape(0), rank = lora_a.shape(1);
  if (rank < 1 || rank > LORA_MAX_RANK) {
    fail("rank must be in [1, " + std::to_string(LORA_MAX_RANK) + "], got " +
         std::to_string(rank));
  }
  if (lora_b.shape() != mx::Shape{slots, out, rank}) {
    fail("lora_b must be [" + std::to_string(slots) + ", " + std::to_string(out) + ", " +
         std::to_string(rank) + "], got " + shape_string(lora_b.shape()));
  }
  if (scale.dtype() != mx::float32 || scale.shape() != mx::Shape{slots}) {
    fail("scale must be float32 [" + std::to_string(slots) + "], got " +
         dtype_name(scale.dtype()) + " " + shape_string(scale.shape()));
  }
  if (row_slot.dtype() != mx::int32 || row_slot.shape() != mx::Shape{t}) {
    fail("row_slot must be int32 [" + std::to_string(t) + "], got " +
         dtype_name(row_slot.dtype()) + " " + shape_string(row_slot.shape()));
  }
  // Host metadata (the usual case: no graph node, no eval of anything else).
  mx::array rs = dense(row_slot, s);
  mx::eval({rs});
  const int32_t* sl = rs.data<int32_t>();
  bool any = false;
  for (int i = 0; i < t; ++i) {
    if (sl[i] < -1 || sl[i] >= slots) {
      fail("row_slot[" + std::to_string(i) + "] = " + std::to_string(sl[i]) +
           " is out of range for " + std::to_string(slots) + " slots (-1 = no adapter)");
    }
    any = any || sl[i] >= 0;
  }
  if (!any) return y;  // no row has an adapter: the base output as it is
  return mx::array(y.shape(), y.dtype(),
                   std::make_shared<LoraApply>(mx::to_stream(s), default_kernel_backend()),
                   {dense(y, s), dense(x, s), dense(lora_a, s), dense(lora_b, s),
                    dense(scale, s), rs});
}

std::string lora_apply_kernel_name(mx::Dtype dtype) { return "lora_apply_" + dtype_name(dtype); }

KernelPlan plan_lora_apply(const LoraApplyProblem& p) {
  LoraApplyArgs args{};
  args.num_rows = static_cast<uint32_t>(p.rows);
  args.in_dim = static_cast<uint32_t>(p.in_dim);
  args.out_dim = static_cast<uint32_t>(p.out_dim);
  args.rank = static_cast<uint32_t>(p.rank);
  args.num_slots = static_cast<uint32_t>(p.num_slots);
  KernelLaunch l;
  l.source = "lora";
  l.kernel = lora_apply_kernel_name(p.dtype);
  for (int i = 0; i < 7; ++i) l.bind(i, i);
  l.set_args(7, args);
  l.threadgroup = {kThreads, 1, 1};
  l.grid = {ceil_div(p.out_dim, kThreads), static_cast<uint32_t>(p.rows), 1};
  return {l};
}

LoraApplyProblem LoraApply::problem(const std::vector<mx::array>& inputs) const {
  LoraApplyProblem p;
  p.dtype = inputs[0].dtype();
  p.rows = inputs[0].shape(0);
  p.out_dim = inputs[0].shape(1);
  p.in_dim = inputs[1].shape(1);
  p.num_slots = inputs[2].shape(0);
  p.rank = inputs[2].shape(1);
  return p;
}

KernelPlan LoraApply::plan(const std::vector<mx::array>& inputs,
                           const std::vector<mx::array>&) const {
  return plan_lora_apply(problem(inputs));
}

bool LoraApply::is_equivalent(const mx::Primitive& other) const {
  return backend() == static_cast<const LoraApply&>(other).backend();
}

void LoraApply::eval_native_cpu(const std::vector<mx::array>& inputs,
                                std::vector<mx::array>& outputs) {
  const LoraApplyProblem p = problem(inputs);
  cpu::LoraApplyRows rows;
  rows.elt = elt_of(p.dtype);
  rows.rows = p.rows;
  rows.in_dim = p.in_dim;
  rows.out_dim = p.out_dim;
  rows.rank = p.rank;
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  for (auto& a : outputs) encoder.set_output_array(a);
  encoder.dispatch([rows, inputs, outputs]() mutable {
    rows.y = inputs[0].data<void>();
    rows.x = inputs[1].data<void>();
    rows.a = inputs[2].data<void>();
    rows.b = inputs[3].data<void>();
    rows.scale = inputs[4].data<float>();
    rows.row_slot = inputs[5].data<int32_t>();
    rows.out = outputs[0].data<void>();
    cpu::lora_apply_rows(rows);
  });
}

}  // namespace vllm_metal
