// reshape_and_cache: writes a step's keys and values into the paged KV cache.
//
//   key, value        [T, num_kv_heads, head_size]  (any strides)
//   key/value_cache   [num_blocks, block_size, num_kv_heads, head_size]
//   slot_mapping      int64 [T]; slot = block * block_size + offset, < 0 skips
//
// Returns the updated caches. MLX arrays are immutable, so by default each
// update is a new array that reuses the cache's buffer when nothing else holds
// the old contents, and copies the whole cache otherwise. MLX's tasks and
// command buffers hold their inputs until they complete, so a serving loop that
// builds step N+1 while step N runs (async scheduling) would copy every cache
// every step. `inplace` writes the cache's buffer whatever holds it: the
// caller must rebind its cache to the result, and the old array shows the new
// contents. Work scheduled earlier on the stream still reads the old contents:
// CPU tasks run in stream order, and on Metal the readers (paged_attention)
// mark the cache read_before_in_place_write, which makes MLX's encoder put a
// barrier (same command encoder) or a fence wait (a later one) before the write.
// Later reads must use the returned caches, which orders the write before them
// in the lazy graph.
//
// Slots >= num_blocks * block_size: a slot table that is already evaluated is
// checked when the op is built (IndexError). A lazy one is checked by the CPU
// kernel before it writes anything (the eval raises); the Metal kernel cannot
// raise, so it skips such slots and never writes outside the cache.
#pragma once

#include <vector>

#include "mlx/array.h"
#include "mlx/utils.h"
#include "ops/kernel_primitive.h"

namespace vllm_metal {

// Returns {key_cache, value_cache}: one cache_write per cache.
std::vector<mx::array> reshape_and_cache(const mx::array& key, const mx::array& value,
                                         const mx::array& key_cache,
                                         const mx::array& value_cache,
                                         const mx::array& slot_mapping,
                                         bool inplace = false, mx::StreamOrDevice s = {});

// Writes src [T, H, D] into one paged cache; returns the updated cache. One
// output per primitive, so the old cache's only holder is this op and its
// buffer is reused in place (MLX's donation rule) unless someone else holds it;
// with `inplace` it is reused always.
mx::array cache_write(const mx::array& src, const mx::array& cache,
                      const mx::array& slot_mapping, bool inplace = false,
                      mx::StreamOrDevice s = {});

// Whole-cache copies made so far in this process (a cache not updated in
// place); tests read it to check that serving copies nothing per step.
uint64_t cache_write_copies();

struct CacheWriteProblem {
  mx::Dtype dtype = mx::float16;
  int64_t num_tokens = 0;
  int64_t num_heads = 0;
  int64_t head_size = 0;
  int64_t num_slots = 0;  // num_blocks * block_size
  int64_t src_strides[3] = {0, 0, 0};
  bool copy_cache = false;  // the output buffer is fresh: copy the old cache first
};

// Slots: 0 src, 1 cache, 2 slot_mapping, 3 cache_out.
KernelPlan plan_cache_write(const CacheWriteProblem& p);

class CacheWrite : public KernelPrimitive {
 public:
  CacheWrite(mx::Stream stream, KernelBackend backend, bool inplace)
      : KernelPrimitive(stream, backend), inplace_(inplace) {}

  KernelPlan plan(const std::vector<mx::array>& inputs,
                  const std::vector<mx::array>& outputs) const override;
  const char* name() const override { return "CacheWrite"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 protected:
  void allocate_outputs(const std::vector<mx::array>& inputs,
                        std::vector<mx::array>& outputs) override;
  void eval_native_cpu(const std::vector<mx::array>& inputs,
                       std::vector<mx::array>& outputs) override;

 private:
  bool inplace_;
};

}  // namespace vllm_metal
