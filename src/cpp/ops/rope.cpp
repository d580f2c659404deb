#include "ops/rope.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>

#include "cpu/rope.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "ops/dtype_names.h"
#include "rope_args.h"

namespace vllm_metal {

namespace {

constexpr const char* kOp = "rope";

[[noreturn]] void fail(const std::string& msg) {
  throw std::invalid_argument(std::string("[") + kOp + "] " + msg);
}

std::string shape_str(const mx::Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) {
    out += (i ? ", " : "") + std::to_string(s[i]);
  }
  return out + "]";
}

// positions as a dense array; an evaluated dense one is used as is (no graph node).
mx::array dense(const mx::array& a, mx::StreamOrDevice s) {
  if (a.status() == mx::array::Status::available && a.flags().row_contiguous) return a;
  return mx::contiguous(a, false, s);
}

// Bytes of every field that changes the table, as a map key.
std::string table_key(int64_t rotary_dim, double base, const RopeScaling& s) {
  std::string k;
  auto put = [&k](const auto& v) { k.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
  auto put_opt = [&](const std::optional<double>& v) {
    put(v.has_value());
    put(v.value_or(0.0));
  };
  put(rotary_dim);
  put(base);
  put(static_cast<int>(s.type));
  put(s.factor);
  put(s.original_max_position_embeddings);
  put(s.low_freq_factor);
  put(s.high_freq_factor);
  put(s.beta_fast);
  put(s.beta_slow);
  put(s.extrapolation_factor);
  put(s.attn_factor);
  put_opt(s.mscale);
  put_opt(s.mscale_all_dim);
  put_opt(s.attention_factor);
  put(s.truncate);
  return k;
}

}  // namespace

RopeTable rope_table(int64_t rotary_dim, double base, const RopeScaling& scaling) {
  // Every layer of a model asks for the same table on every step: cache it.
  // Leaked on purpose: the arrays must not outlive MLX's allocator at exit.
  static std::mutex mutex;
  static auto* cache = new std::map<std::string, RopeTable>();
  const std::string key = table_key(rotary_dim, base, scaling);
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = cache->find(key);
    if (it != cache->end()) return it->second;
  }
  RopeFrequencies f = rope_frequencies(rotary_dim, base, scaling);  // validates
  const int64_t half = rotary_dim / 2;
  std::vector<uint32_t> words(2 * half);
  cpu::rope_turn_table(f.inv_freq.data(), half, words.data());
  RopeTable t{mx::array(words.begin(), {2, static_cast<int>(half)}, mx::uint32),
              static_cast<float>(f.mscale)};
  std::lock_guard<std::mutex> lock(mutex);
  if (cache->size() >= 256) cache->clear();  // bound it; models use a handful
  cache->emplace(key, t);
  return t;
}

mx::array rope(const mx::array& x, const mx::array& positions, const RopeOptions& o,
               mx::StreamOrDevice s) {
  check_float_dtype(kOp, "x", x.dtype());
  if (x.ndim() != 3) {
    fail("x must be [num_tokens, num_heads, head_size], got shape " + shape_str(x.shape()));
  }
  if (positions.dtype() != mx::int32 && positions.dtype() != mx::int64) {
    fail("positions must be int32 or int64, got " + dtype_name(positions.dtype()));
  }
  if (positions.ndim() != 1 || positions.shape(0) != x.shape(0)) {
    fail("positions must be [" + std::to_string(x.shape(0)) +
         "] (one position per token), got " + shape_str(positions.shape()));
  }
  const int64_t head_size = x.shape(2);
  const int64_t rotary_dim = o.rotary_dim.value_or(head_size);
  if (rotary_dim < 2 || rotary_dim % 2 != 0 || rotary_dim > head_size) {
    fail("rotary_dim must be even and in [2, head_size=" + std::to_string(head_size) +
         "], got " + std::to_string(rotary_dim));
  }
  RopeTable table = rope_table(rotary_dim, o.base, o.scaling);
  if (x.size() == 0) {
    return mx::zeros(x.shape(), x.dtype(), s);
  }
  auto stream = mx::to_stream(s);
  return mx::array(
      x.shape(), x.dtype(),
      std::make_shared<Rope>(stream, default_kernel_backend(), rotary_dim, o.is_neox,
                             table.mscale),
      {x, dense(positions, s), table.table});  // x: any strides
}

std::string rope_kernel_name(mx::Dtype dtype, mx::Dtype positions_dtype, bool neox) {
  return std::string("rope_") + (neox ? "neox_" : "gptj_") + dtype_name(dtype) + "_" +
      (positions_dtype == mx::int64 ? "int64" : "int32");
}

KernelPlan plan_rope(const RopeProblem& p) {
  KernelLaunch l;
  l.source = "rope";
  l.kernel = rope_kernel_name(p.dtype, p.positions_dtype, p.neox);
  RopeArgs args{};
  args.x_token_stride = p.x_token_stride;
  args.x_head_stride = p.x_head_stride;
  args.x_dim_stride = p.x_dim_stride;
  args.out_token_stride = p.heads * p.head_size;
  args.num_heads = static_cast<uint32_t>(p.heads);
  args.head_size = static_cast<uint32_t>(p.head_size);
  args.rotary_half = static_cast<uint32_t>(p.rotary_dim / 2);
  args.mscale = p.mscale;
  // x threads: one per pair (up to 128), each computing its cos/sin once;
  // y threads: heads, so a threadgroup has up to ~256 threads.
  const uint32_t tx = static_cast<uint32_t>(std::clamp<int64_t>(p.rotary_dim / 2, 1, 128));
  const uint32_t ty =
      static_cast<uint32_t>(std::clamp<int64_t>(256 / tx, 1, std::max<int64_t>(1, p.heads)));
  l.grid = {static_cast<uint32_t>(p.tokens), 1, 1};
  l.threadgroup = {tx, ty, 1};
  for (int i = 0; i < 4; ++i) l.bind(i, i);  // x, positions, table, out
  l.set_args(4, args);
  return {l};
}

RopeProblem Rope::problem(const std::vector<mx::array>& inputs) const {
  const auto& x = inputs[0];
  RopeProblem p;
  p.dtype = x.dtype();
  p.positions_dtype = inputs[1].dtype();
  p.tokens = x.shape(0);
  p.heads = x.shape(1);
  p.head_size = x.shape(2);
  p.rotary_dim = rotary_dim_;
  p.x_token_stride = x.strides()[0];
  p.x_head_stride = x.strides()[1];
  p.x_dim_stride = x.strides()[2];  // strides are known at eval, not when the op is built
  p.neox = neox_;
  p.mscale = mscale_;
  return p;
}

void Rope::allocate_outputs(const std::vector<mx::array>& inputs,
                            std::vector<mx::array>& outputs) {
  const auto& x = inputs[0];
  // Each pair is read and written by the same thread, so rotating in place is safe.
  if (x.flags().row_contiguous && x.is_donatable()) {
    outputs[0].copy_shared_buffer(x);
  } else {
    outputs[0].set_data(mx::allocator::malloc(outputs[0].nbytes()));
  }
}

KernelPlan Rope::plan(const std::vector<mx::array>& inputs,
                      const std::vector<mx::array>&) const {
  return plan_rope(problem(inputs));
}

bool Rope::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const Rope&>(other);
  return rotary_dim_ == o.rotary_dim_ && neox_ == o.neox_ && mscale_ == o.mscale_ &&
      backend() == o.backend();
}

void Rope::eval_native_cpu(const std::vector<mx::array>& inputs,
                           std::vector<mx::array>& outputs) {
  RopeProblem p = problem(inputs);
  cpu::RopeRows rows;
  rows.elt = elt_of(p.dtype);
  rows.positions_int64 = p.positions_dtype == mx::int64;
  rows.tokens = p.tokens;
  rows.heads = p.heads;
  rows.head_size = p.head_size;
  rows.rotary_dim = p.rotary_dim;
  rows.x_token_stride = p.x_token_stride;
  rows.x_head_stride = p.x_head_stride;
  rows.x_dim_stride = p.x_dim_stride;
  rows.neox = p.neox;
  rows.mscale = p.mscale;
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  for (auto& a : outputs) encoder.set_output_array(a);
  encoder.dispatch([rows, inputs, outputs]() mutable {
    rows.x = inputs[0].data<void>();
    rows.positions = inputs[1].data<void>();
    rows.table = inputs[2].data<uint32_t>();
    rows.out = outputs[0].data<void>();
    cpu::rope_rows(rows);
  });
}

}  // namespace vllm_metal
