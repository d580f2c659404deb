// KV pool geometry: from a memory budget (or a block count), the model's layers
// and vLLM's block size, the number of blocks and every layer's cache shapes
// (plain C++17, no MLX, no Python). The worker takes everything it reports to
// vLLM and allocates from here (python/vllm_metal/kv_plan.py): bytes per block
// (size_kv_pool, before vLLM has counted the blocks), the linear-attention state
// bytes that come off the budget, then (plan_kv_pool with vLLM's block count) the
// K/V shapes and the startup description.
//
// Accounting (the same as vLLM's for a model whose layers share one block table):
//   attention layer   K and V, each [num_blocks, block_size, num_kv_heads, head_dim];
//                     one block of one layer = 2 * block_size * heads * head_dim * dtype bytes
//   linear attention  per-sequence state tensors, [max_num_seqs, *shape] each, state_copies
//                     times (2 with speculative decoding: each slot's saved copy); no blocks
//   num_blocks        (budget - state bytes) / (bytes of one block over all attention layers),
//                     including the null block; or the explicit num_blocks
// Sliding-window layers are allocated like full attention (every token keeps
// its slot; the window only limits what attention reads), as vLLM does with
// its hybrid allocator disabled. All attention layers share the block ids.
//
// Kernel block size: the kernels read any block size. paged_attention and
// reshape_and_cache take it from the cache's shape [num_blocks, block_size, H, D]
// (the Metal kernel reads block table[j / block_size]); nothing requires 8, 16 or 32.
// The runner gives them vLLM's blocks as they are (hybrid models' 32, 48 or 528
// included), so kernel_block_size defaults to block_size (one kernel block per
// block). A smaller kernel_block_size that divides B is the same memory seen as
// k = B / kernel_block_size blocks: vLLM block b is kernel blocks b*k .. b*k+k-1,
// the view [num_blocks * k, B / k, H, D] is a reshape, slot numbers are unchanged
// (b * B + o == (b*k + o / kb) * kb + o % kb), and only block tables are expanded
// (split_block_ids, and the BatchPacker's KvGroupSpec.kernel_block_size).
//
// Errors: std::invalid_argument with "[kv_geometry] ...", saying what was
// expected, what came, and for a budget or block count that is too small, what
// would fit.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace vllm_metal::runtime {

enum class KvDtype : uint8_t { kFloat32, kFloat16, kBFloat16, kInt8, kUInt8 };

int64_t kv_dtype_size(KvDtype dtype);
const char* kv_dtype_name(KvDtype dtype);
// "float32", "float16", "bfloat16", "int8", "uint8" (uint8 also holds fp8 caches).
KvDtype parse_kv_dtype(const std::string& name);

enum class KvLayerKind : uint8_t { kFullAttention, kSlidingWindow, kLinearAttention };

const char* kv_layer_kind_name(KvLayerKind kind);
// "full_attention", "sliding_window", "linear_attention"
KvLayerKind parse_kv_layer_kind(const std::string& name);

// One per-sequence state tensor of a linear-attention layer, e.g. Gated
// DeltaNet's conv state [conv_dim, kernel - 1] and recurrent state
// [num_v_heads, head_v_dim, head_k_dim] (float32).
struct KvStateSpec {
  std::vector<int64_t> shape;  // per sequence (no leading slot dimension)
  KvDtype dtype = KvDtype::kFloat32;
};

struct KvLayerSpec {
  KvLayerKind kind = KvLayerKind::kFullAttention;
  int64_t num_kv_heads = 0;         // attention layers
  int64_t head_dim = 0;             // attention layers
  KvDtype dtype = KvDtype::kFloat16;  // attention layers: cache dtype
  int64_t sliding_window = 0;       // kSlidingWindow: window in tokens (> 0)
  std::vector<KvStateSpec> states;  // kLinearAttention: at least one
};

struct KvPoolConfig {
  std::vector<KvLayerSpec> layers;
  int64_t block_size = 16;           // vLLM's block size, in tokens
  int64_t kernel_block_size = 0;     // 0: block_size (the kernels read vLLM's blocks as they are)
  int64_t memory_budget_bytes = 0;   // > 0: every cache and state must fit in it
  int64_t num_blocks = 0;            // > 0: exactly this many blocks (vLLM's KVCacheConfig.num_blocks,
                                     //   or an override); 0: as many as the budget holds
  int64_t max_num_seqs = 1;          // linear-attention state slots
  int64_t state_copies = 1;          // pools of max_num_seqs slots per linear layer: 2 when
                                     //   speculative decoding saves each slot before a step
  int64_t max_model_len = 0;         // > 0: refuse a pool that cannot hold one sequence this long
  bool reserve_null_block = true;    // the pool's block 0 is the null block (as in vLLM)
};

struct KvLayerGeometry {
  KvLayerKind kind = KvLayerKind::kFullAttention;
  KvDtype dtype = KvDtype::kFloat16;       // attention layers
  int64_t sliding_window = 0;
  // Attention layers: the shape of K and of V (each), in vLLM blocks and in
  // kernel blocks (the same memory). Zeros for linear-attention layers.
  std::array<int64_t, 4> cache_shape{};         // [num_blocks, block_size, heads, head_dim]
  std::array<int64_t, 4> kernel_cache_shape{};  // [num_kernel_blocks, kernel_block_size, heads, head_dim]
  int64_t bytes_per_block = 0;                  // K + V of one vLLM block
  // Linear-attention layers: [max_num_seqs, *shape] per state tensor (one pool;
  // state_copies pools of it).
  std::vector<std::vector<int64_t>> state_shapes;
  std::vector<KvDtype> state_dtypes;
  int64_t bytes = 0;  // everything this layer allocates, every state copy
};

struct KvPoolGeometry {
  int64_t num_blocks = 0;               // vLLM blocks, the null block included
  int64_t block_size = 0;
  int64_t kernel_block_size = 0;
  int64_t kernel_blocks_per_block = 1;  // block_size / kernel_block_size
  int64_t num_kernel_blocks = 0;        // num_blocks * kernel_blocks_per_block
  int64_t bytes_per_block = 0;          // one block over all attention layers
  int64_t kv_bytes = 0;                 // num_blocks * bytes_per_block
  int64_t state_bytes = 0;              // all linear-attention states, every copy
  int64_t total_bytes = 0;              // kv_bytes + state_bytes
  int64_t max_num_seqs = 0;             // state slots per pool
  int64_t state_copies = 1;
  int64_t num_attention_layers = 0;
  int64_t num_linear_layers = 0;
  int64_t max_tokens = 0;               // tokens the usable blocks hold
  std::vector<KvLayerGeometry> layers;  // in the order given
};

KvPoolGeometry plan_kv_pool(const KvPoolConfig& config);

// The per-block and state sizing alone, before the block count is known (the
// worker's get_cache_block_size_bytes and the state it takes off the budget):
// num_blocks and memory_budget_bytes are ignored, the geometry has 0 blocks.
KvPoolGeometry size_kv_pool(const KvPoolConfig& config);

// One line for the startup summary: blocks, tokens and MiB; for hybrid models
// the attention layers' blocks and the linear-attention layers' state slots.
std::string describe_kv_pool(const KvPoolGeometry& geometry);

// Hybrid models: vLLM keeps one page size for all KV-cache groups, so the
// attention block size grows until one attention layer's block (its page) holds
// one sequence's state of a linear-attention layer, and that state page is padded
// to it. block_size is the smallest multiple of base_block_size that does.
struct KvPageAlignment {
  int64_t block_size = 0;        // tokens
  int64_t page_bytes = 0;        // one attention layer's K and V of one block = the padded state page
  int64_t state_page_bytes = 0;  // one sequence's state of the largest linear layer, unpadded
};

// Needs attention layers of one size per token (vLLM's single page size);
// without linear layers block_size is base_block_size.
KvPageAlignment align_kv_pages(const std::vector<KvLayerSpec>& layers, int64_t base_block_size);

// The kernel block size for vLLM's block_size: block_size itself with
// requested = 0 (the kernels read any block size), else `requested`, which
// must divide block_size.
int64_t choose_kernel_block_size(int64_t block_size, int64_t requested = 0);

// Expands vLLM block ids to kernel block ids: ids[i] -> out[i*k .. i*k+k-1] =
// ids[i]*k .. ids[i]*k+k-1 with k = kernel_blocks_per_block. Negative ids
// (padding) stay negative: k copies of the same value. out holds n * k entries.
void split_block_ids(const int32_t* ids, size_t n, int64_t kernel_blocks_per_block, int32_t* out);

}  // namespace vllm_metal::runtime
