#include "ops/reshape_and_cache.h"

#include <atomic>
#include <cstring>
#include <stdexcept>

#include "cpu/reshape_and_cache.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "ops/dtype_names.h"
#include "reshape_and_cache_args.h"

namespace vllm_metal {

namespace {

constexpr const char* kOp = "reshape_and_cache";

std::atomic<uint64_t> copies{0};

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

void check_inputs(const mx::array& key, const mx::array& value, const mx::array& key_cache,
                  const mx::array& value_cache, const mx::array& slot_mapping) {
  if (key.ndim() != 3) fail("key must be [tokens, kv_heads, head_size], got " + shape_str(key.shape()));
  if (value.shape() != key.shape()) {
    fail("value must have key's shape " + shape_str(key.shape()) + ", got " +
         shape_str(value.shape()));
  }
  if (key_cache.ndim() != 4) {
    fail("key_cache must be [num_blocks, block_size, kv_heads, head_size], got " +
         shape_str(key_cache.shape()));
  }
  if (value_cache.shape() != key_cache.shape()) {
    fail("value_cache must have key_cache's shape " + shape_str(key_cache.shape()) + ", got " +
         shape_str(value_cache.shape()));
  }
  if (key_cache.shape(2) != key.shape(1) || key_cache.shape(3) != key.shape(2)) {
    fail("cache heads x head_size " + std::to_string(key_cache.shape(2)) + "x" +
         std::to_string(key_cache.shape(3)) + " do not match key's " +
         std::to_string(key.shape(1)) + "x" + std::to_string(key.shape(2)));
  }
  check_float_dtype(kOp, "key_cache", key_cache.dtype());
  for (const auto* a : {&key, &value, &value_cache}) {
    if (a->dtype() != key_cache.dtype()) {
      fail("key, value and both caches must share one dtype, got key " +
           dtype_name(key.dtype()) + ", value " + dtype_name(value.dtype()) + ", caches " +
           dtype_name(key_cache.dtype()) + "/" + dtype_name(value_cache.dtype()));
    }
  }
  if (slot_mapping.dtype() != mx::int64) {
    fail("slot_mapping must be int64, got " + dtype_name(slot_mapping.dtype()));
  }
  if (slot_mapping.ndim() != 1 || slot_mapping.shape(0) != key.shape(0)) {
    fail("slot_mapping must be [" + std::to_string(key.shape(0)) + "] (one slot per token), got " +
         shape_str(slot_mapping.shape()));
  }
}

int64_t num_slots_of(const mx::array& cache) {
  return static_cast<int64_t>(cache.shape(0)) * cache.shape(1);
}

[[noreturn]] void fail_slot(int64_t token, int64_t slot, int64_t num_slots) {
  throw std::out_of_range(std::string("[") + kOp + "] slot_mapping[" + std::to_string(token) +
                          "] = " + std::to_string(slot) + " is outside the cache's " +
                          std::to_string(num_slots) + " slots");
}

// A slot table that is already computed is checked now, so a bad step is
// refused before anything is scheduled; lazy tables are checked at eval.
void check_slots_if_ready(const mx::array& slot_mapping, int64_t num_slots) {
  if (slot_mapping.status() != mx::array::Status::available ||
      !slot_mapping.flags().row_contiguous) {
    return;
  }
  const int64_t* slots = slot_mapping.data<int64_t>();
  int64_t bad = cpu::find_out_of_range_slot(slots, slot_mapping.size(), num_slots);
  if (bad >= 0) fail_slot(bad, slots[bad], num_slots);
}

void copy_strides(const mx::array& a, int64_t* out) {
  for (int i = 0; i < 3; ++i) out[i] = a.strides()[i];
}

}  // namespace

std::vector<mx::array> reshape_and_cache(const mx::array& key, const mx::array& value,
                                         const mx::array& key_cache,
                                         const mx::array& value_cache,
                                         const mx::array& slot_mapping, bool inplace,
                                         mx::StreamOrDevice s) {
  check_inputs(key, value, key_cache, value_cache, slot_mapping);
  check_slots_if_ready(slot_mapping, num_slots_of(key_cache));
  if (key.shape(0) == 0) {
    return {key_cache, value_cache};
  }
  auto slots = mx::contiguous(slot_mapping, false, s);
  return {cache_write(key, key_cache, slots, inplace, s),
          cache_write(value, value_cache, slots, inplace, s)};
}

mx::array cache_write(const mx::array& src, const mx::array& cache,
                      const mx::array& slot_mapping, bool inplace, mx::StreamOrDevice s) {
  check_inputs(src, src, cache, cache, slot_mapping);
  check_slots_if_ready(slot_mapping, num_slots_of(cache));
  if (src.shape(0) == 0) return cache;
  return mx::array(cache.shape(), cache.dtype(),
                   std::make_shared<CacheWrite>(mx::to_stream(s), default_kernel_backend(),
                                                inplace),
                   {src, cache, mx::contiguous(slot_mapping, false, s)});
}

uint64_t cache_write_copies() { return copies.load(std::memory_order_relaxed); }

KernelPlan plan_cache_write(const CacheWriteProblem& p) {
  KernelPlan plan;
  const std::string suffix = dtype_name(p.dtype);
  if (p.copy_cache) {
    const uint64_t cache_elements = uint64_t(p.num_slots) * p.num_heads * p.head_size;
    KernelLaunch copy;
    copy.source = "reshape_and_cache";
    copy.kernel = "cache_copy_" + suffix;
    copy.bind(0, 1);  // old cache
    copy.bind(1, 3);  // new cache
    copy.set_args(2, CacheCopyArgs{cache_elements});
    copy.threadgroup = {256, 1, 1};
    copy.grid = {ceil_div(cache_elements, 256), 1, 1};
    plan.push_back(copy);
  }
  CacheWriteArgs args{};
  args.src_token_stride = p.src_strides[0];
  args.src_head_stride = p.src_strides[1];
  args.src_dim_stride = p.src_strides[2];
  args.num_slots = p.num_slots;
  args.num_heads = static_cast<uint32_t>(p.num_heads);
  args.head_size = static_cast<uint32_t>(p.head_size);
  KernelLaunch write;
  write.source = "reshape_and_cache";
  write.kernel = "cache_write_" + suffix;
  write.bind(0, 0);  // src
  write.bind(1, 2);  // slot_mapping
  write.bind(2, 3);  // cache_out
  write.set_args(3, args);
  const uint64_t row = uint64_t(p.num_heads) * p.head_size;
  uint32_t threads = 32;
  while (threads < 256 && threads < row) threads *= 2;
  write.threadgroup = {threads, 1, 1};
  write.grid = {static_cast<uint32_t>(p.num_tokens), 1, 1};
  plan.push_back(write);
  return plan;
}

void CacheWrite::allocate_outputs(const std::vector<mx::array>& inputs,
                                  std::vector<mx::array>& outputs) {
  const mx::array& cache = inputs[1];
  if (!cache.flags().row_contiguous) fail("the cache must be row-contiguous");
  if (inplace_ || cache.is_donatable()) {
    outputs[0].copy_shared_buffer(cache);  // update in place
  } else {
    outputs[0].set_data(mx::allocator::malloc(outputs[0].nbytes()));
    copies.fetch_add(1, std::memory_order_relaxed);  // plan / eval copy the old cache first
  }
}

KernelPlan CacheWrite::plan(const std::vector<mx::array>& inputs,
                            const std::vector<mx::array>& outputs) const {
  const auto& src = inputs[0];
  CacheWriteProblem p;
  p.dtype = src.dtype();
  p.num_tokens = src.shape(0);
  p.num_heads = src.shape(1);
  p.head_size = src.shape(2);
  p.num_slots = num_slots_of(inputs[1]);
  copy_strides(src, p.src_strides);
  p.copy_cache = outputs[0].data<char>() != inputs[1].data<char>();
  return plan_cache_write(p);
}

void CacheWrite::eval_native_cpu(const std::vector<mx::array>& inputs,
                                 std::vector<mx::array>& outputs) {
  const auto& src = inputs[0];
  cpu::CacheScatter a;
  a.num_tokens = src.shape(0);
  a.num_heads = src.shape(1);
  a.head_size = src.shape(2);
  a.num_slots = num_slots_of(inputs[1]);
  a.itemsize = src.itemsize();
  copy_strides(src, a.key_strides);
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& x : inputs) encoder.set_input_array(x);
  for (auto& x : outputs) encoder.set_output_array(x);
  encoder.dispatch([a, inputs, outputs]() mutable {
    a.slot_mapping = inputs[2].data<int64_t>();
    int64_t bad = cpu::find_out_of_range_slot(a.slot_mapping, a.num_tokens, a.num_slots);
    if (bad >= 0) fail_slot(bad, a.slot_mapping[bad], a.num_slots);
    if (outputs[0].data<char>() != inputs[1].data<char>()) {
      std::memcpy(outputs[0].data<char>(), inputs[1].data<char>(), outputs[0].nbytes());
    }
    a.key = inputs[0].data<void>();
    a.key_cache = outputs[0].data<void>();
    cpu::scatter_into_cache(a);  // value left null: one cache
  });
}

bool CacheWrite::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const CacheWrite&>(other);
  return backend() == o.backend() && inplace_ == o.inplace_;
}

}  // namespace vllm_metal
