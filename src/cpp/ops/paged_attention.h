// paged_attention: attention of a packed batch against the paged KV cache.
//
//   q              [T, Hq, D]     decode rows first (q_len 1), then prefill chunks
//   key/value_cache [num_blocks, block_size, Hkv, D]
//   block_tables   int32 [num_seqs, max_blocks]
//   seq_lens       int32 [num_seqs]   context length including the new tokens
//   cu_seqlens_q   int32 [num_seqs + 1]
//   sinks          float32 [Hq] (optional): one extra logit per head, value 0
// Returns out [T, Hq, D] in q's dtype.
//
// Planning hints (num_decode_seqs, max_seq_len, max_query_len) choose the
// kernels and size their grids; when omitted they are computed from the
// metadata, which must then already be evaluated. Metadata that is evaluated
// is validated when the op is built; lazy metadata is validated by the CPU
// kernel at eval, while the Metal kernels skip block ids outside the cache.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/utils.h"
#include "ops/kernel_primitive.h"

namespace vllm_metal {

struct PagedAttentionOptions {
  float scale = 1.0f;
  int64_t sliding_window = 0;  // attend to the last `sliding_window` positions; 0 = all
  float softcap = 0.0f;        // scores -> softcap * tanh(scores / softcap); 0 = off
  std::optional<int64_t> num_decode_seqs;
  std::optional<int64_t> max_seq_len;
  std::optional<int64_t> max_query_len;
};

mx::array paged_attention(const mx::array& q, const mx::array& key_cache,
                          const mx::array& value_cache, const mx::array& block_tables,
                          const mx::array& seq_lens, const mx::array& cu_seqlens_q,
                          const PagedAttentionOptions& options,
                          const std::optional<mx::array>& sinks = std::nullopt,
                          mx::StreamOrDevice s = {});

// Everything a planner needs; no array data.
struct PagedAttentionProblem {
  mx::Dtype dtype = mx::float16;
  int64_t num_tokens = 0;
  int64_t num_seqs = 0;
  int64_t num_q_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_size = 0;
  int64_t block_size = 16;
  int64_t num_blocks = 0;
  int64_t max_blocks = 0;
  int64_t q_token_stride = 0;
  int64_t q_head_stride = 0;
  int64_t num_decode_seqs = 0;
  int64_t max_seq_len = 0;
  int64_t max_query_len = 0;
  int64_t sliding_window = 0;
  float scale = 1.0f;
  float softcap = 0.0f;
  bool has_sinks = false;
  int64_t partition_size = 512;  // split-KV decode: keys per partition
  bool uses_kernels = true;      // false: the native CPU path (no scratch needed)
  // Batch-invariant mode: every query token through the decode kernel, each split by
  // its own keys into partition_size blocks aligned to absolute positions.
  bool batch_invariant = false;
};

// Batch-invariant mode's split-KV partition size: a row splits only past 1024 keys, as
// the default plan's does; scratch is tokens x q heads x partitions x (head_size + 2) floats.
constexpr int64_t kInvariantPartitionSize = 1024;
// Query heads one decode threadgroup serves (a kv head's group, or a slice of it).
constexpr int64_t kDecodeMaxGroup = 8;
// Query rows per prefill threadgroup (one simdgroup of 8x8 matrices).
constexpr int64_t kPrefillQueryTile = 8;

// Split-KV decision: 1 (the decode kernel writes the output) unless contexts
// are long and too few threadgroups would fill the GPU. Batch-invariant mode: the
// partitions of the longest context (each row uses those its own keys span).
int64_t choose_decode_partitions(const PagedAttentionProblem& p);

// Head sizes with Metal kernels (the CPU kernel takes any multiple of 8 up to 512):
// those the supported architectures' models use (docs/kernels.md), each instantiated in
// src/metal/paged_attention.metal.
bool metal_supports_head_size(int64_t head_size);
const std::vector<int64_t>& metal_head_sizes();
std::string metal_head_sizes_text();  // "48, 64, ..., 512"

// Why paged_attention cannot take `head_size` ("" when it can); `metal`: on the Metal
// kernels (a GPU stream or the emulated backend). The model runner asks at load.
std::string head_size_problem(int64_t head_size, bool metal);

// Fills p's planning hints (num_decode_seqs, max_seq_len, max_query_len) from `o`, or
// from the metadata when it is evaluated (then also validated against p's counts and
// the given hints). Throws std::invalid_argument "[paged_attention] ...".
void resolve_paged_attention_hints(PagedAttentionProblem& p, const PagedAttentionOptions& o,
                                   const mx::array& block_tables, const mx::array& seq_lens,
                                   const mx::array& cu_seqlens_q);

// Slots: 0 q, 1 key_cache, 2 value_cache, 3 block_tables, 4 seq_lens,
// 5 cu_seqlens_q, 6 sinks (when absent any buffer: has_sinks off, never read), 7 out,
// 8 partial_out [rows, Hq, P, D] f32, 9 partial_max [rows, Hq, P], 10 partial_sum.
KernelPlan plan_paged_attention(const PagedAttentionProblem& p);

// Shapes of the split-KV scratch outputs (slots 8-10) for `p`.
std::vector<mx::Shape> paged_attention_scratch_shapes(const PagedAttentionProblem& p);

class PagedAttention : public KernelPrimitive {
 public:
  PagedAttention(mx::Stream stream, KernelBackend backend, PagedAttentionProblem problem)
      : KernelPrimitive(stream, backend), problem_(problem) {}

  KernelPlan plan(const std::vector<mx::array>& inputs,
                  const std::vector<mx::array>& outputs) const override;
  const char* name() const override { return "PagedAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 protected:
  void eval_native_cpu(const std::vector<mx::array>& inputs,
                       std::vector<mx::array>& outputs) override;

 private:
  PagedAttentionProblem problem_;  // strides of q are refreshed at eval
};

}  // namespace vllm_metal
