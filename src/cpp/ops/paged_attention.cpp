#include "ops/paged_attention.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "cpu/batch_invariant.h"
#include "cpu/paged_attention.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "ops/dtype_names.h"
#include "paged_attention_args.h"

namespace vllm_metal {

namespace {

constexpr const char* kOp = "paged_attention";
constexpr int kDecodeThreads = 128;  // 4 simdgroups
// Below this many decode threadgroups a long context is split across partitions.
constexpr int64_t kSplitBelowThreadgroups = 128;

[[noreturn]] void fail(const std::string& msg) {
  throw std::invalid_argument(std::string("[") + kOp + "] " + msg);
}

std::string dims(const mx::array& a) {
  std::string out = "[";
  for (int i = 0; i < a.ndim(); ++i) out += (i ? ", " : "") + std::to_string(a.shape(i));
  return out + "]";
}

void check_int32(const char* what, const mx::array& a, int ndim) {
  if (a.dtype() != mx::int32) fail(std::string(what) + " must be int32, got " + dtype_name(a.dtype()));
  if (a.ndim() != ndim) {
    fail(std::string(what) + " must have " + std::to_string(ndim) + " dimension(s), got " + dims(a));
  }
}

void check_shapes(const mx::array& q, const mx::array& kc, const mx::array& vc,
                  const mx::array& bt, const mx::array& sl, const mx::array& cu,
                  const PagedAttentionOptions& o, const std::optional<mx::array>& sinks) {
  check_float_dtype(kOp, "q", q.dtype());
  if (q.ndim() != 3) fail("q must be [tokens, q_heads, head_size], got " + dims(q));
  if (kc.ndim() != 4 || vc.shape() != kc.shape()) {
    fail("key_cache and value_cache must both be [num_blocks, block_size, kv_heads, head_size], "
         "got " + dims(kc) + " and " + dims(vc));
  }
  if (kc.dtype() != q.dtype() || vc.dtype() != q.dtype()) {
    fail("caches must have q's dtype " + dtype_name(q.dtype()) + ", got " +
         dtype_name(kc.dtype()) + "/" + dtype_name(vc.dtype()));
  }
  const int64_t hq = q.shape(1), hkv = kc.shape(2), d = q.shape(2);
  if (kc.shape(3) != d) {
    fail("head size mismatch: q has " + std::to_string(d) + ", the cache " + std::to_string(kc.shape(3)));
  }
  if (hkv == 0 || hq % hkv != 0) {
    fail("q heads (" + std::to_string(hq) + ") must be a multiple of kv heads (" +
         std::to_string(hkv) + ")");
  }
  if (auto why = head_size_problem(d, false); !why.empty()) fail(why);
  check_int32("block_tables", bt, 2);
  check_int32("seq_lens", sl, 1);
  check_int32("cu_seqlens_q", cu, 1);
  const int64_t num_seqs = sl.shape(0);
  if (bt.shape(0) != num_seqs) {
    fail("block_tables must have one row per sequence (" + std::to_string(num_seqs) + "), got " + dims(bt));
  }
  if (cu.shape(0) != num_seqs + 1) {
    fail("cu_seqlens_q must be [num_seqs + 1] = [" + std::to_string(num_seqs + 1) + "], got " + dims(cu));
  }
  if (sinks) {
    if (sinks->dtype() != mx::float32 || sinks->ndim() != 1 || sinks->shape(0) != hq) {
      fail("sinks must be float32 [" + std::to_string(hq) + "], got " + dtype_name(sinks->dtype()) +
           " " + dims(*sinks));
    }
  }
  if (!std::isfinite(o.scale)) fail("scale must be finite");
  if (o.sliding_window < 0) fail("sliding_window must be >= 0 (0 = no window)");
  if (!(o.softcap >= 0.0f) || !std::isfinite(o.softcap)) fail("softcap must be finite and >= 0 (0 = off)");
}

// Host pointer of an evaluated, dense int32 array, else null (lazy metadata).
const int32_t* host_ints(const mx::array& a) {
  if (a.status() != mx::array::Status::available || !a.flags().row_contiguous) return nullptr;
  return a.data<int32_t>();
}

// Fills the hints from evaluated metadata, checks given ones against it, and
// validates the metadata itself.
void resolve_hints(PagedAttentionProblem& p, const PagedAttentionOptions& o, const mx::array& bt,
                   const mx::array& sl, const mx::array& cu) {
  const int32_t* bt_h = host_ints(bt);
  const int32_t* sl_h = host_ints(sl);
  const int32_t* cu_h = host_ints(cu);
  if (!(bt_h && sl_h && cu_h)) {
    if (!o.num_decode_seqs || !o.max_seq_len || !o.max_query_len) {
      fail("lazy metadata needs the planning hints num_decode_seqs, max_seq_len and "
           "max_query_len (or evaluate block_tables, seq_lens and cu_seqlens_q first)");
    }
    p.num_decode_seqs = *o.num_decode_seqs;
    p.max_seq_len = *o.max_seq_len;
    p.max_query_len = *o.max_query_len;
    if (p.num_decode_seqs < 0 || p.num_decode_seqs > p.num_seqs) {
      fail("num_decode_seqs must be in [0, " + std::to_string(p.num_seqs) + "]");
    }
    return;
  }
  std::string err = cpu::check_paged_metadata(bt_h, sl_h, cu_h, p.num_seqs, p.max_blocks,
                                              p.num_blocks, p.block_size, p.num_tokens);
  if (!err.empty()) fail(err);
  int64_t decode = 0, max_seq = 0, max_q = 0;
  bool decode_prefix = true;
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    const int64_t q_len = cu_h[s + 1] - cu_h[s];
    decode_prefix = decode_prefix && q_len == 1;
    if (decode_prefix) ++decode;
    max_seq = std::max<int64_t>(max_seq, sl_h[s]);
    max_q = std::max(max_q, q_len);
  }
  p.num_decode_seqs = o.num_decode_seqs.value_or(decode);
  p.max_seq_len = o.max_seq_len.value_or(max_seq);
  p.max_query_len = o.max_query_len.value_or(max_q);
  if (p.num_decode_seqs < 0 || p.num_decode_seqs > decode) {
    fail("num_decode_seqs = " + std::to_string(p.num_decode_seqs) + " but only the first " +
         std::to_string(decode) + " sequences have one new token (decode rows come first)");
  }
  if (p.max_seq_len < max_seq) {
    fail("max_seq_len = " + std::to_string(p.max_seq_len) + " is below the longest context " +
         std::to_string(max_seq));
  }
  if (p.max_query_len < max_q) {
    fail("max_query_len = " + std::to_string(p.max_query_len) + " is below the longest chunk " +
         std::to_string(max_q));
  }
}

}  // namespace

void resolve_paged_attention_hints(PagedAttentionProblem& p, const PagedAttentionOptions& o,
                                   const mx::array& block_tables, const mx::array& seq_lens,
                                   const mx::array& cu_seqlens_q) {
  resolve_hints(p, o, block_tables, seq_lens, cu_seqlens_q);
}

const std::vector<int64_t>& metal_head_sizes() {
  static const std::vector<int64_t> sizes = {48, 64, 80, 96, 120, 128, 256, 512};
  return sizes;
}

std::string metal_head_sizes_text() {
  std::string out;
  for (int64_t d : metal_head_sizes()) out += (out.empty() ? "" : ", ") + std::to_string(d);
  return out;
}

bool metal_supports_head_size(int64_t d) {
  const auto& sizes = metal_head_sizes();
  return std::find(sizes.begin(), sizes.end(), d) != sizes.end();
}

std::string head_size_problem(int64_t d, bool metal) {
  if (d % 8 != 0 || d > 512 || d <= 0) {
    return "head size must be a multiple of 8 up to 512, got " + std::to_string(d);
  }
  if (metal && !metal_supports_head_size(d)) {
    return "the Metal kernels support head sizes " + metal_head_sizes_text() + ", got " +
           std::to_string(d);
  }
  return "";
}

int64_t choose_decode_partitions(const PagedAttentionProblem& p) {
  if (p.batch_invariant) {
    // each row is split by its own keys (aligned partitions); the grid covers the longest
    return std::max<int64_t>(1, (p.max_seq_len + p.partition_size - 1) / p.partition_size);
  }
  if (p.num_decode_seqs == 0 || p.max_seq_len <= 2 * p.partition_size) return 1;
  const int64_t groups = p.num_q_heads / p.num_kv_heads;
  const int64_t head_slices = (groups + kDecodeMaxGroup - 1) / kDecodeMaxGroup;
  const int64_t threadgroups = p.num_decode_seqs * p.num_kv_heads * head_slices;
  if (threadgroups >= kSplitBelowThreadgroups) return 1;
  return (p.max_seq_len + p.partition_size - 1) / p.partition_size;
}

std::vector<mx::Shape> paged_attention_scratch_shapes(const PagedAttentionProblem& p) {
  const int64_t parts = p.uses_kernels ? choose_decode_partitions(p) : 1;
  if (parts == 1) return {{0}, {0}, {0}};
  const int rows = static_cast<int>(p.batch_invariant ? p.num_tokens : p.num_decode_seqs);
  const int hq = static_cast<int>(p.num_q_heads);
  const int np = static_cast<int>(parts), d = static_cast<int>(p.head_size);
  return {{rows, hq, np, d}, {rows, hq, np}, {rows, hq, np}};
}

KernelPlan plan_paged_attention(const PagedAttentionProblem& p) {
  if (auto why = head_size_problem(p.head_size, true); !why.empty()) {
    throw std::invalid_argument("[paged_attention] " + why);
  }
  const std::string suffix = dtype_name(p.dtype) + "_d" + std::to_string(p.head_size);
  PagedAttentionArgs base{};
  base.q_token_stride = p.q_token_stride;
  base.q_head_stride = p.q_head_stride;
  base.max_blocks = p.max_blocks;
  base.num_blocks = p.num_blocks;
  base.block_size = static_cast<uint32_t>(p.block_size);
  base.num_q_heads = static_cast<uint32_t>(p.num_q_heads);
  base.num_kv_heads = static_cast<uint32_t>(p.num_kv_heads);
  base.sliding_window = static_cast<int32_t>(p.sliding_window);
  base.scale = p.scale;
  base.softcap = p.softcap;
  base.has_sinks = p.has_sinks ? 1 : 0;
  base.partition_size = static_cast<uint32_t>(p.partition_size);

  auto bind_common = [](KernelLaunch& l) {
    for (int slot = 0; slot <= 7; ++slot) l.bind(slot, slot);  // q .. out
    // the caches: the next step's reshape_and_cache writes them in place
    l.buffers[1].read_before_in_place_write = l.buffers[2].read_before_in_place_write = true;
  };
  KernelPlan plan;
  const int64_t groups = p.num_q_heads / p.num_kv_heads;
  const int64_t head_slices = (groups + kDecodeMaxGroup - 1) / kDecodeMaxGroup;
  // The decode kernel over `rows` query rows (a.num_seqs sequences), then, when the keys
  // are split into partitions, the reduce that combines them.
  auto push_decode = [&](PagedAttentionArgs a, int64_t rows, int64_t parts) {
    a.num_partitions = static_cast<uint32_t>(parts);
    KernelLaunch decode;
    decode.source = "paged_attention";
    decode.kernel = "paged_attention_decode_" + suffix;
    bind_common(decode);
    for (int slot = 8; slot <= 10; ++slot) decode.bind(slot, slot);  // split-KV scratch
    decode.set_args(11, a);
    decode.grid = {static_cast<uint32_t>(p.num_kv_heads * head_slices),
                   static_cast<uint32_t>(rows), static_cast<uint32_t>(parts)};
    decode.threadgroup = {kDecodeThreads, 1, 1};
    plan.push_back(decode);
    if (parts > 1) {
      KernelLaunch reduce;
      reduce.source = "paged_attention";
      reduce.kernel = "paged_attention_reduce_" + suffix;
      bind_common(reduce);
      for (int slot = 8; slot <= 10; ++slot) reduce.bind(slot, slot);
      reduce.set_args(11, a);
      reduce.grid = {static_cast<uint32_t>(p.num_q_heads), static_cast<uint32_t>(rows), 1};
      reduce.threadgroup = {32, 1, 1};
      plan.push_back(reduce);
    }
  };
  if (p.batch_invariant) {
    // One kernel and one key order for every query token, decode row or prefill chunk,
    // split-KV partitions fixed by the token's own position: a token's output depends
    // on its position and the cache only.
    PagedAttentionArgs a = base;
    a.seq_offset = 0;
    a.num_seqs = static_cast<uint32_t>(p.num_seqs);
    a.token_rows = 1;
    push_decode(a, p.num_tokens, choose_decode_partitions(p));
    return plan;
  }
  if (p.num_decode_seqs > 0) {
    PagedAttentionArgs a = base;
    a.seq_offset = 0;
    a.num_seqs = static_cast<uint32_t>(p.num_decode_seqs);
    push_decode(a, p.num_decode_seqs, choose_decode_partitions(p));
  }
  const int64_t prefill_seqs = p.num_seqs - p.num_decode_seqs;
  if (prefill_seqs > 0 && p.max_query_len > 0) {
    PagedAttentionArgs a = base;
    a.seq_offset = static_cast<uint32_t>(p.num_decode_seqs);
    a.num_seqs = static_cast<uint32_t>(prefill_seqs);
    a.num_partitions = 1;
    KernelLaunch prefill;
    prefill.source = "paged_attention";
    prefill.kernel = "paged_attention_prefill_" + suffix;
    bind_common(prefill);
    prefill.set_args(8, a);
    prefill.grid = {ceil_div(p.max_query_len, kPrefillQueryTile),
                    static_cast<uint32_t>(p.num_q_heads), static_cast<uint32_t>(prefill_seqs)};
    prefill.threadgroup = {32, 1, 1};
    plan.push_back(prefill);
  }
  return plan;
}

mx::array paged_attention(const mx::array& q, const mx::array& key_cache,
                          const mx::array& value_cache, const mx::array& block_tables,
                          const mx::array& seq_lens, const mx::array& cu_seqlens_q,
                          const PagedAttentionOptions& options,
                          const std::optional<mx::array>& sinks, mx::StreamOrDevice s) {
  check_shapes(q, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, options, sinks);
  auto stream = mx::to_stream(s);
  const KernelBackend backend = default_kernel_backend();
  PagedAttentionProblem p;
  p.dtype = q.dtype();
  p.num_tokens = q.shape(0);
  p.num_seqs = seq_lens.shape(0);
  p.num_q_heads = q.shape(1);
  p.num_kv_heads = key_cache.shape(2);
  p.head_size = q.shape(2);
  p.num_blocks = key_cache.shape(0);
  p.block_size = key_cache.shape(1);
  p.max_blocks = block_tables.shape(1);
  p.sliding_window = options.sliding_window;
  p.scale = options.scale;
  p.softcap = options.softcap;
  p.has_sinks = sinks.has_value();
  p.batch_invariant = cpu::batch_invariant();  // fixed here: the plan and scratch agree
  if (p.batch_invariant) p.partition_size = kInvariantPartitionSize;
  p.uses_kernels = backend == KernelBackend::kEmulated || stream.device == mx::Device::gpu;
  resolve_hints(p, options, block_tables, seq_lens, cu_seqlens_q);
  if (auto why = head_size_problem(p.head_size, p.uses_kernels); !why.empty()) fail(why);
  if (p.num_tokens == 0) return mx::zeros(q.shape(), q.dtype(), s);

  auto scratch = paged_attention_scratch_shapes(p);
  auto outputs = mx::array::make_arrays(
      {q.shape(), scratch[0], scratch[1], scratch[2]},
      {q.dtype(), mx::float32, mx::float32, mx::float32},
      std::make_shared<PagedAttention>(stream, backend, p),
      {q, mx::contiguous(key_cache, false, s), mx::contiguous(value_cache, false, s),
       mx::contiguous(block_tables, false, s), mx::contiguous(seq_lens, false, s),
       mx::contiguous(cu_seqlens_q, false, s),
       // without sinks, q fills the slot: has_sinks is off, so it is never read (a fresh
       // dummy array would cost a fill kernel per call on the GPU)
       sinks ? *sinks : q});
  return outputs[0];
}

KernelPlan PagedAttention::plan(const std::vector<mx::array>& inputs,
                                const std::vector<mx::array>&) const {
  PagedAttentionProblem p = problem_;
  p.q_token_stride = inputs[0].strides()[0];
  p.q_head_stride = inputs[0].strides()[1];
  if (inputs[0].strides()[2] != 1) {
    throw std::invalid_argument("[paged_attention] q's head dimension must be contiguous");
  }
  return plan_paged_attention(p);
}

void PagedAttention::eval_native_cpu(const std::vector<mx::array>& inputs,
                                     std::vector<mx::array>& outputs) {
  cpu::PagedAttentionParams a;
  const auto& q = inputs[0];
  if (q.strides()[2] != 1) {
    throw std::invalid_argument("[paged_attention] q's head dimension must be contiguous");
  }
  a.elt = elt_of(problem_.dtype);
  a.q_token_stride = q.strides()[0];
  a.q_head_stride = q.strides()[1];
  a.num_tokens = problem_.num_tokens;
  a.num_seqs = problem_.num_seqs;
  a.max_blocks = problem_.max_blocks;
  a.num_blocks = problem_.num_blocks;
  a.block_size = problem_.block_size;
  a.num_q_heads = problem_.num_q_heads;
  a.num_kv_heads = problem_.num_kv_heads;
  a.head_size = problem_.head_size;
  a.scale = problem_.scale;
  a.sliding_window = problem_.sliding_window;
  a.softcap = problem_.softcap;
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& x : inputs) encoder.set_input_array(x);
  for (auto& x : outputs) encoder.set_output_array(x);
  encoder.dispatch([a, inputs, outputs, has_sinks = problem_.has_sinks]() mutable {
    a.q = inputs[0].data<void>();
    a.key_cache = inputs[1].data<void>();
    a.value_cache = inputs[2].data<void>();
    a.block_tables = inputs[3].data<int32_t>();
    a.seq_lens = inputs[4].data<int32_t>();
    a.cu_seqlens_q = inputs[5].data<int32_t>();
    a.sinks = has_sinks ? inputs[6].data<float>() : nullptr;
    a.out = outputs[0].data<void>();
    // lazy metadata is first seen here: refuse it before reading the cache
    std::string err = cpu::check_paged_metadata(a.block_tables, a.seq_lens, a.cu_seqlens_q,
                                                a.num_seqs, a.max_blocks, a.num_blocks,
                                                a.block_size, a.num_tokens);
    if (!err.empty()) throw std::invalid_argument("[paged_attention] " + err);
    cpu::paged_attention(a);
  });
}

bool PagedAttention::is_equivalent(const mx::Primitive& other) const {
  (void)other;
  return false;  // cheap to keep distinct; never worth merging two attention calls
}

}  // namespace vllm_metal
