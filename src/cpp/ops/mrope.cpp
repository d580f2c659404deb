#include "ops/mrope.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "cpu/mrope.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mrope_args.h"
#include "ops/dtype_names.h"
#include "ops/rope.h"
#include "ops/varlen.h"

namespace vllm_metal {

namespace {

constexpr const char* kOp = "mrope";

[[noreturn]] void fail(const std::string& msg) {
  throw std::invalid_argument(std::string("[") + kOp + "] " + msg);
}

mx::array dense(const mx::array& a, mx::StreamOrDevice s) {
  if (a.status() == mx::array::Status::available && a.flags().row_contiguous) return a;
  return mx::contiguous(a, false, s);
}

}  // namespace

mx::array mrope(const mx::array& x, const mx::array& positions, const MropeOptions& o,
                mx::StreamOrDevice s) {
  check_float_dtype(kOp, "x", x.dtype());
  if (x.ndim() != 3) {
    fail("x must be [num_tokens, num_heads, head_size], got shape " + shape_string(x.shape()));
  }
  if (positions.dtype() != mx::int32 && positions.dtype() != mx::int64) {
    fail("positions must be int32 or int64, got " + dtype_name(positions.dtype()));
  }
  const int t = x.shape(0);
  if (positions.shape() != mx::Shape{3, t}) {
    fail("positions must be [3, " + std::to_string(t) +
         "] (temporal, height, width per token), got " + shape_string(positions.shape()));
  }
  const int64_t head_size = x.shape(2);
  const int64_t rotary_dim = o.rotary_dim.value_or(head_size);
  if (rotary_dim < 2 || rotary_dim % 2 != 0 || rotary_dim > head_size) {
    fail("rotary_dim must be even and in [2, head_size=" + std::to_string(head_size) +
         "], got " + std::to_string(rotary_dim));
  }
  const auto& sec = o.sections;
  if (sec[0] < 0 || sec[1] < 0 || sec[2] < 0 || sec[0] + sec[1] + sec[2] != rotary_dim / 2) {
    fail("sections must be 3 non-negative counts summing to rotary_dim / 2 = " +
         std::to_string(rotary_dim / 2) + ", got [" + std::to_string(sec[0]) + ", " +
         std::to_string(sec[1]) + ", " + std::to_string(sec[2]) + "]");
  }
  if (!std::isfinite(o.base) || o.base <= 0) fail("base must be finite and > 0");
  RopeTable table = rope_table(rotary_dim, o.base, RopeScaling{});
  if (x.size() == 0) return mx::zeros(x.shape(), x.dtype(), s);
  return mx::array(x.shape(), x.dtype(),
                   std::make_shared<Mrope>(mx::to_stream(s), default_kernel_backend(),
                                           rotary_dim, sec, o.interleaved),
                   {dense(x, s), dense(positions, s), table.table});
}

std::string mrope_kernel_name(mx::Dtype dtype, mx::Dtype positions_dtype) {
  return "mrope_" + dtype_name(dtype) + "_" + (positions_dtype == mx::int64 ? "int64" : "int32");
}

KernelPlan plan_mrope(const MropeProblem& p) {
  KernelLaunch l;
  l.source = "mrope";
  l.kernel = mrope_kernel_name(p.dtype, p.positions_dtype);
  MropeArgs args{};
  args.num_tokens = static_cast<uint32_t>(p.tokens);
  args.num_heads = static_cast<uint32_t>(p.heads);
  args.head_size = static_cast<uint32_t>(p.head_size);
  args.rotary_half = static_cast<uint32_t>(p.rotary_dim / 2);
  args.section0 = static_cast<uint32_t>(p.sections[0]);
  args.section1 = static_cast<uint32_t>(p.sections[1]);
  args.section2 = static_cast<uint32_t>(p.sections[2]);
  args.interleaved = p.interleaved ? 1u : 0u;
  // as rope: x threads over pairs, y threads over heads, <= 256 per threadgroup
  const uint32_t tx = static_cast<uint32_t>(std::clamp<int64_t>(p.rotary_dim / 2, 1, 128));
  const uint32_t ty =
      static_cast<uint32_t>(std::clamp<int64_t>(256 / tx, 1, std::max<int64_t>(1, p.heads)));
  l.grid = {static_cast<uint32_t>(p.tokens), 1, 1};
  l.threadgroup = {tx, ty, 1};
  for (int i = 0; i < 4; ++i) l.bind(i, i);
  l.set_args(4, args);
  return {l};
}

MropeProblem Mrope::problem(const std::vector<mx::array>& inputs) const {
  MropeProblem p;
  p.dtype = inputs[0].dtype();
  p.positions_dtype = inputs[1].dtype();
  p.tokens = inputs[0].shape(0);
  p.heads = inputs[0].shape(1);
  p.head_size = inputs[0].shape(2);
  p.rotary_dim = rotary_dim_;
  p.sections = sections_;
  p.interleaved = interleaved_;
  return p;
}

void Mrope::allocate_outputs(const std::vector<mx::array>& inputs,
                             std::vector<mx::array>& outputs) {
  // each pair is read and written by one thread: rotating in place is safe
  if (inputs[0].flags().row_contiguous && inputs[0].is_donatable()) {
    outputs[0].copy_shared_buffer(inputs[0]);
  } else {
    outputs[0].set_data(mx::allocator::malloc(outputs[0].nbytes()));
  }
}

KernelPlan Mrope::plan(const std::vector<mx::array>& inputs,
                       const std::vector<mx::array>&) const {
  return plan_mrope(problem(inputs));
}

bool Mrope::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const Mrope&>(other);
  return rotary_dim_ == o.rotary_dim_ && sections_ == o.sections_ &&
      interleaved_ == o.interleaved_ && backend() == o.backend();
}

void Mrope::eval_native_cpu(const std::vector<mx::array>& inputs,
                            std::vector<mx::array>& outputs) {
  const MropeProblem p = problem(inputs);
  cpu::MropeRows rows;
  rows.elt = elt_of(p.dtype);
  rows.positions_int64 = p.positions_dtype == mx::int64;
  rows.tokens = p.tokens;
  rows.heads = p.heads;
  rows.head_size = p.head_size;
  rows.rotary_dim = p.rotary_dim;
  std::copy(p.sections.begin(), p.sections.end(), rows.sections);
  rows.interleaved = p.interleaved;
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  for (auto& a : outputs) encoder.set_output_array(a);
  encoder.dispatch([rows, inputs, outputs]() mutable {
    rows.x = inputs[0].data<void>();
    rows.positions = inputs[1].data<void>();
    rows.table = inputs[2].data<uint32_t>();
    rows.out = outputs[0].data<void>();
    cpu::mrope_rows(rows);
  });
}

}  // namespace vllm_metal
