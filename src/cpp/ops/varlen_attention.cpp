#include "ops/varlen_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <stdexcept>

#include "cpu/varlen_attention.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/transforms.h"
#include "ops/dtype_names.h"
#include "ops/varlen.h"
#include "varlen_attention_args.h"

namespace vllm_metal {

namespace {

constexpr const char* kOp = "varlen_attention";
constexpr int64_t kMaxHeadSize = 256;  // the Metal kernel keeps 8 dims per lane

[[noreturn]] void fail(const std::string& msg) {
  throw std::invalid_argument(std::string("[") + kOp + "] " + msg);
}

mx::array dense(const mx::array& a, mx::StreamOrDevice s) {
  if (a.status() == mx::array::Status::available && a.flags().row_contiguous) return a;
  return mx::contiguous(a, false, s);
}

// The metadata is tiny and host-made: checked here so the kernels can trust it. Also
// returns the longest sequence (the tiled Metal kernel's grid).
mx::array checked_cu_seqlens(const mx::array& cu, int64_t num_tokens, mx::StreamOrDevice s,
                             int64_t& max_seq_len) {
  if (cu.dtype() != mx::int32) fail("cu_seqlens must be int32, got " + dtype_name(cu.dtype()));
  if (cu.ndim() != 1 || cu.shape(0) < 2) {
    fail("cu_seqlens must be [num_seqs + 1] with at least one sequence, got " +
         shape_string(cu.shape()));
  }
  mx::array d = dense(cu, s);
  mx::eval({d});
  const int32_t* c = d.data<int32_t>();
  const int64_t n = cu.shape(0) - 1;
  if (c[0] != 0) fail("cu_seqlens[0] must be 0, got " + std::to_string(c[0]));
  max_seq_len = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (c[i + 1] < c[i]) {
      fail("cu_seqlens must be non-decreasing, got cu_seqlens[" + std::to_string(i + 1) +
           "] = " + std::to_string(c[i + 1]) + " < " + std::to_string(c[i]));
    }
    max_seq_len = std::max<int64_t>(max_seq_len, c[i + 1] - c[i]);
  }
  if (c[n] != num_tokens) {
    fail("cu_seqlens[-1] must be the number of rows " + std::to_string(num_tokens) + ", got " +
         std::to_string(c[n]));
  }
  return d;
}

}  // namespace

mx::array varlen_attention(const mx::array& q, const mx::array& k, const mx::array& v,
                           const mx::array& cu_seqlens, float scale, bool causal,
                           int64_t window, mx::StreamOrDevice s) {
  check_float_dtype(kOp, "q", q.dtype());
  if (q.ndim() != 3) fail("q must be [num_tokens, num_q_heads, head_size], got " + shape_string(q.shape()));
  const int t = q.shape(0), hq = q.shape(1), d = q.shape(2);
  if (d < 1 || d > kMaxHeadSize) {
    fail("head_size must be in [1, " + std::to_string(kMaxHeadSize) + "], got " + std::to_string(d));
  }
  for (const auto* a : {&k, &v}) {
    const char* what = a == &k ? "k" : "v";
    if (a->dtype() != q.dtype()) {
      fail(std::string(what) + " must have q's dtype " + dtype_name(q.dtype()) + ", got " +
           dtype_name(a->dtype()));
    }
    if (a->ndim() != 3 || a->shape(0) != t || a->shape(2) != d || a->shape(1) != k.shape(1)) {
      fail(std::string(what) + " must be [" + std::to_string(t) + ", num_kv_heads, " +
           std::to_string(d) + "] (k and v alike), got " + shape_string(a->shape()));
    }
  }
  const int hkv = k.shape(1);
  if (hkv < 1 || hq < 1 || hq % hkv != 0) {
    fail("num_q_heads " + std::to_string(hq) + " must be a positive multiple of num_kv_heads " +
         std::to_string(hkv));
  }
  if (!std::isfinite(scale)) fail("scale must be finite");
  if (window < 0 || window > int64_t{UINT32_MAX}) {
    fail("window must be 0 (none) or a positive key distance, got " + std::to_string(window));
  }
  int64_t max_seq_len = 0;
  mx::array cu = checked_cu_seqlens(cu_seqlens, t, s, max_seq_len);
  if (t == 0) return mx::zeros({0, hq, d}, q.dtype(), s);
  const mx::Stream stream = mx::to_stream(s);
  const KernelBackend backend = default_kernel_backend();
  auto prim = std::make_shared<VarlenAttention>(stream, backend, scale, causal, window, max_seq_len);
  // Our CPU kernel reads strided token rows (q, k and v sliced from one fused projection):
  // no copy of each. The Metal kernels (and the emulator) take dense arrays.
  if (backend == KernelBackend::kNative && stream.device == mx::Device::cpu) {
    return mx::array(q.shape(), q.dtype(), prim, {q, k, v, cu});
  }
  return mx::array(q.shape(), q.dtype(), prim, {dense(q, s), dense(k, s), dense(v, s), cu});
}

std::vector<int64_t> tiled_head_sizes() { return {32, 64, 128, 256}; }

KernelPlan plan_varlen_attention(const VarlenAttentionProblem& p) {
  VarlenAttentionArgs args{};
  args.num_tokens = static_cast<uint32_t>(p.num_tokens);
  args.num_seqs = static_cast<uint32_t>(p.num_seqs);
  args.num_q_heads = static_cast<uint32_t>(p.num_q_heads);
  args.num_kv_heads = static_cast<uint32_t>(p.num_kv_heads);
  args.head_size = static_cast<uint32_t>(p.head_size);
  args.causal = p.causal ? 1u : 0u;
  args.scale = p.scale;
  args.window = static_cast<uint32_t>(p.window);
  KernelLaunch l;
  l.source = "varlen_attention";
  for (int i = 0; i < 5; ++i) l.bind(i, i);
  l.set_args(5, args);
  l.threadgroup = {32, 1, 1};
  const auto tiled = tiled_head_sizes();
  if (std::find(tiled.begin(), tiled.end(), p.head_size) != tiled.end()) {
    // one simdgroup per 8 query rows of a (sequence, q head); the grid covers the longest
    // sequence (without it known, every row could be one sequence's)
    const int64_t longest = p.max_seq_len > 0 ? p.max_seq_len : p.num_tokens;
    l.kernel = "varlen_attention_tiled_" + dtype_name(p.dtype) + "_d" + std::to_string(p.head_size);
    l.grid = {static_cast<uint32_t>((longest + 7) / 8), static_cast<uint32_t>(p.num_q_heads),
              static_cast<uint32_t>(p.num_seqs)};
    return {l};
  }
  // one simdgroup per (query row, q head)
  l.kernel = "varlen_attention_" + dtype_name(p.dtype);
  l.grid = {static_cast<uint32_t>(p.num_tokens), static_cast<uint32_t>(p.num_q_heads), 1};
  return {l};
}

VarlenAttentionProblem VarlenAttention::problem(const std::vector<mx::array>& inputs) const {
  VarlenAttentionProblem p;
  p.dtype = inputs[0].dtype();
  p.num_tokens = inputs[0].shape(0);
  p.num_q_heads = inputs[0].shape(1);
  p.head_size = inputs[0].shape(2);
  p.num_kv_heads = inputs[1].shape(1);
  p.num_seqs = inputs[3].shape(0) - 1;
  p.scale = scale_;
  p.causal = causal_;
  p.window = window_;
  p.max_seq_len = max_seq_len_;
  return p;
}

KernelPlan VarlenAttention::plan(const std::vector<mx::array>& inputs,
                                 const std::vector<mx::array>&) const {
  return plan_varlen_attention(problem(inputs));
}

bool VarlenAttention::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const VarlenAttention&>(other);
  return scale_ == o.scale_ && causal_ == o.causal_ && window_ == o.window_ &&
         max_seq_len_ == o.max_seq_len_ && backend() == o.backend();
}

namespace {

// Elements from one token's row to the next when each token's [heads, D] is dense (what the
// CPU kernel reads); 0 when the array is laid out otherwise.
int64_t token_row_stride(const mx::array& a) {
  const auto& st = a.strides();
  const bool dense_row = st[2] == 1 && (a.shape(1) == 1 || st[1] == a.shape(2));
  if (!dense_row) return 0;
  return a.shape(0) == 1 ? a.shape(1) * a.shape(2) : static_cast<int64_t>(st[0]);
}

// `a` [T, H, D] gathered into dense rows (a layout the kernel does not read).
std::vector<char> dense_copy(const mx::array& a) {
  const size_t elt = a.itemsize();
  const auto& st = a.strides();
  std::vector<char> out(a.nbytes());
  const char* src = static_cast<const char*>(a.data<void>());
  size_t at = 0;
  for (int64_t t = 0; t < a.shape(0); ++t) {
    for (int64_t h = 0; h < a.shape(1); ++h) {
      for (int64_t i = 0; i < a.shape(2); ++i, at += elt) {
        std::memcpy(out.data() + at, src + (t * st[0] + h * st[1] + i * st[2]) * elt, elt);
      }
    }
  }
  return out;
}

}  // namespace

void VarlenAttention::eval_native_cpu(const std::vector<mx::array>& inputs,
                                      std::vector<mx::array>& outputs) {
  const VarlenAttentionProblem p = problem(inputs);
  cpu::VarlenAttentionParams params;
  params.elt = elt_of(p.dtype);
  params.num_seqs = p.num_seqs;
  params.num_q_heads = p.num_q_heads;
  params.num_kv_heads = p.num_kv_heads;
  params.head_size = p.head_size;
  params.scale = p.scale;
  params.causal = p.causal;
  params.window = p.window;
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& x : inputs) encoder.set_input_array(x);
  encoder.set_output_array(outputs[0]);
  encoder.dispatch([params, inputs, out = outputs[0]]() mutable {
    std::vector<char> copies[3];
    const void* data[3];
    int64_t* strides[3] = {&params.q_stride, &params.k_stride, &params.v_stride};
    for (int i = 0; i < 3; ++i) {
      *strides[i] = token_row_stride(inputs[i]);
      if (*strides[i] == 0 && inputs[i].size() > 0) {
        copies[i] = dense_copy(inputs[i]);
        *strides[i] = inputs[i].shape(1) * inputs[i].shape(2);
        data[i] = copies[i].data();
      } else {
        data[i] = inputs[i].data<void>();
      }
    }
    params.q = data[0];
    params.k = data[1];
    params.v = data[2];
    params.cu_seqlens = inputs[3].data<int32_t>();
    params.out = out.data<void>();
    cpu::varlen_attention(params);
  });
}

}  // namespace vllm_metal
