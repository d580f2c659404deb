#include "ops/gated_delta.h"

#include <cmath>
#include <cstring>
#include <stdexcept>

#include "cpu/gated_delta.h"
#include "gated_delta_args.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "ops/dtype_names.h"
#include "ops/varlen.h"

namespace vllm_metal {

namespace {

constexpr const char* kOp = "gated_delta_rule";
constexpr int64_t kMaxDk = 256;  // the Metal kernel keeps dk / 32 floats per lane

[[noreturn]] void fail(const std::string& msg) {
  throw std::invalid_argument(std::string("[") + kOp + "] " + msg);
}

void check_shape(const char* what, const mx::array& x, const mx::Shape& want) {
  if (x.shape() != want) {
    fail(std::string(what) + " must be " + shape_string(want) + ", got " +
         shape_string(x.shape()));
  }
}

// Row-contiguous without a graph node when it already is (keeps donation).
mx::array dense(const mx::array& a, mx::StreamOrDevice s) {
  if (a.status() == mx::array::Status::available && a.flags().row_contiguous) return a;
  return mx::contiguous(a, false, s);
}

mx::array f32(const mx::array& a, mx::StreamOrDevice s) {
  return dense(a.dtype() == mx::float32 ? a : mx::astype(a, mx::float32, s), s);
}

}  // namespace

std::vector<mx::array> gated_delta_rule(const mx::array& q, const mx::array& k,
                                        const mx::array& v, const mx::array& a,
                                        const mx::array& b, const mx::array& A_log,
                                        const mx::array& dt_bias, const mx::array& state,
                                        const mx::array& cu_seqlens, const mx::array& slots,
                                        const std::optional<mx::array>& has_initial_state,
                                        const GatedDeltaOptions& o, mx::StreamOrDevice s) {
  check_float_dtype(kOp, "q", q.dtype());
  if (q.ndim() != 3) fail("q must be [num_tokens, num_k_heads, k_head_dim], got " +
                          shape_string(q.shape()));
  if (v.ndim() != 3) fail("v must be [num_tokens, num_v_heads, v_head_dim], got " +
                          shape_string(v.shape()));
  const int t = q.shape(0), hk = q.shape(1), dk = q.shape(2), hv = v.shape(1), dv = v.shape(2);
  check_shape("k", k, q.shape());
  check_shape("v", v, {t, hv, dv});
  for (const auto* x : {&k, &v}) {
    if (x->dtype() != q.dtype()) {
      fail(std::string(x == &k ? "k" : "v") + " must have q's dtype " + dtype_name(q.dtype()) +
           ", got " + dtype_name(x->dtype()));
    }
  }
  if (hk < 1 || hv % hk != 0) {
    fail("num_v_heads (" + std::to_string(hv) + ") must be a multiple of num_k_heads (" +
         std::to_string(hk) + ")");
  }
  if (dk < 1 || dk > kMaxDk) fail("k_head_dim must be in [1, 256], got " + std::to_string(dk));
  check_float_dtype(kOp, "a", a.dtype());
  check_float_dtype(kOp, "b", b.dtype());
  check_float_dtype(kOp, "A_log", A_log.dtype());
  check_float_dtype(kOp, "dt_bias", dt_bias.dtype());
  check_shape("a", a, {t, hv});
  check_shape("b", b, {t, hv});
  check_shape("A_log", A_log, {hv});
  check_shape("dt_bias", dt_bias, {hv});
  if (state.dtype() != mx::float32) fail("state must be float32, got " + dtype_name(state.dtype()));
  if (state.ndim() != 4 || state.shape(1) != hv || state.shape(2) != dv || state.shape(3) != dk) {
    fail("state must be [num_slots, " + std::to_string(hv) + ", " + std::to_string(dv) + ", " +
         std::to_string(dk) + "], got " + shape_string(state.shape()));
  }
  if (o.method != "auto" && o.method != "recurrent" && o.method != "chunked") {
    fail("method must be 'auto', 'recurrent' or 'chunked', got '" + o.method + "'");
  }
  if (o.chunk_size < 1) fail("chunk_size must be >= 1, got " + std::to_string(o.chunk_size));
  if (!std::isfinite(o.eps) || o.eps < 0) fail("eps must be finite and >= 0");
  VarlenBatch batch =
      check_varlen(kOp, cu_seqlens, slots, has_initial_state, t, state.shape(0), s);
  if (t == 0) return {mx::zeros({0, hv, dv}, q.dtype(), s), state};
  // auto = recurrent: on the CPU the tiled recurrence is as fast as the chunked
  // form built from dot products (docs/benchmarks.md); chunked pays off once its
  // products run as GEMM tiles.
  const bool chunked = o.method == "chunked";
  auto prim = std::make_shared<GatedDelta>(mx::to_stream(s), default_kernel_backend(), o.eps,
                                           chunked ? o.chunk_size : 0, o.inplace);
  return mx::array::make_arrays(
      {{t, hv, dv}, state.shape()}, {q.dtype(), mx::float32}, prim,
      {dense(q, s), dense(k, s), dense(v, s), f32(a, s), f32(b, s), f32(A_log, s),
       f32(dt_bias, s), batch.cu_seqlens, batch.slots, batch.has_initial_state, dense(state, s)});
}

std::string gated_delta_kernel_name(mx::Dtype dtype) {
  return "gated_delta_recurrent_" + dtype_name(dtype);
}

KernelPlan plan_gated_delta(const GatedDeltaProblem& p) {
  KernelPlan plan;
  if (p.copy_state) {
    const uint64_t count = uint64_t(p.num_slots) * p.hv * p.dv * p.dk;
    KernelLaunch copy;
    copy.source = "gated_delta";
    copy.kernel = "gated_delta_copy_state";
    copy.bind(0, 10);
    copy.bind(1, 12);
    copy.set_args(2, StateCopyArgs{count});
    copy.threadgroup = {256, 1, 1};
    copy.grid = {ceil_div(count, 256), 1, 1};
    plan.push_back(copy);
  }
  GatedDeltaArgs args{};
  args.num_seqs = static_cast<uint32_t>(p.num_seqs);
  args.hk = static_cast<uint32_t>(p.hk);
  args.hv = static_cast<uint32_t>(p.hv);
  args.dk = static_cast<uint32_t>(p.dk);
  args.dv = static_cast<uint32_t>(p.dv);
  args.eps = p.eps;
  args.q_scale = 1.0f / std::sqrt(static_cast<float>(p.dk));
  KernelLaunch l;
  l.source = "gated_delta";
  l.kernel = gated_delta_kernel_name(p.dtype);
  for (int i = 0; i < 10; ++i) l.bind(i, i);  // q .. has_initial_state
  l.bind(10, 12);                             // the new state, updated in place
  l.bind(11, 11);                             // y
  l.set_args(12, args);
  // one simdgroup per state row, 4 rows per threadgroup
  l.threadgroup = {32, 4, 1};
  l.grid = {static_cast<uint32_t>(p.num_seqs * p.hv), ceil_div(p.dv, 4), 1};
  plan.push_back(l);
  return plan;
}

GatedDeltaProblem GatedDelta::problem(const std::vector<mx::array>& inputs,
                                      const std::vector<mx::array>& outputs) const {
  GatedDeltaProblem p;
  p.dtype = inputs[0].dtype();
  p.num_seqs = inputs[8].shape(0);
  p.num_slots = inputs[10].shape(0);
  p.hk = inputs[0].shape(1);
  p.dk = inputs[0].shape(2);
  p.hv = inputs[2].shape(1);
  p.dv = inputs[2].shape(2);
  p.eps = eps_;
  p.copy_state = outputs[1].data<char>() != inputs[10].data<char>();
  return p;
}

void GatedDelta::allocate_outputs(const std::vector<mx::array>& inputs,
                                  std::vector<mx::array>& outputs) {
  outputs[0].set_data(mx::allocator::malloc(outputs[0].nbytes()));
  const auto& state = inputs[10];
  if (state.flags().row_contiguous && (inplace_ || state.is_donatable())) {
    outputs[1].copy_shared_buffer(state);  // update the slots in place
  } else {
    outputs[1].set_data(mx::allocator::malloc(outputs[1].nbytes()));
  }
}

KernelPlan GatedDelta::plan(const std::vector<mx::array>& inputs,
                            const std::vector<mx::array>& outputs) const {
  return plan_gated_delta(problem(inputs, outputs));
}

bool GatedDelta::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const GatedDelta&>(other);
  return eps_ == o.eps_ && chunk_size_ == o.chunk_size_ && inplace_ == o.inplace_ &&
      backend() == o.backend();
}

void GatedDelta::eval_native_cpu(const std::vector<mx::array>& inputs,
                                 std::vector<mx::array>& outputs) {
  const GatedDeltaProblem p = problem(inputs, outputs);
  cpu::GatedDeltaRows rows;
  rows.elt = elt_of(p.dtype);
  rows.num_seqs = p.num_seqs;
  rows.tokens = inputs[0].shape(0);
  rows.hk = p.hk;
  rows.hv = p.hv;
  rows.dk = p.dk;
  rows.dv = p.dv;
  rows.eps = p.eps;
  rows.chunk_size = chunk_size_;
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& x : inputs) encoder.set_input_array(x);
  for (auto& x : outputs) encoder.set_output_array(x);
  encoder.dispatch([rows, inputs, outputs, copy = p.copy_state]() mutable {
    if (copy) {
      std::memcpy(outputs[1].data<char>(), inputs[10].data<char>(), outputs[1].nbytes());
    }
    rows.q = inputs[0].data<void>();
    rows.k = inputs[1].data<void>();
    rows.v = inputs[2].data<void>();
    rows.a = inputs[3].data<float>();
    rows.b = inputs[4].data<float>();
    rows.a_log = inputs[5].data<float>();
    rows.dt_bias = inputs[6].data<float>();
    rows.cu_seqlens = inputs[7].data<int32_t>();
    rows.slots = inputs[8].data<int32_t>();
    rows.has_initial_state = inputs[9].data<int32_t>();
    rows.state = outputs[1].data<float>();
    rows.y = outputs[0].data<void>();
    cpu::gated_delta_rows(rows);
  });
}

}  // namespace vllm_metal
