// KV pool geometry (src/cpp/runtime/kv_geometry.h).
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/kv_geometry.h"

namespace rt = vllm_metal::runtime;

namespace {

constexpr int64_t kGiB = int64_t{1} << 30;
constexpr int64_t kMiB = int64_t{1} << 20;

rt::KvLayerSpec full(int64_t heads, int64_t dim, rt::KvDtype dtype = rt::KvDtype::kFloat16) {
  rt::KvLayerSpec l;
  l.kind = rt::KvLayerKind::kFullAttention;
  l.num_kv_heads = heads;
  l.head_dim = dim;
  l.dtype = dtype;
  return l;
}

rt::KvLayerSpec sliding(int64_t heads, int64_t dim, int64_t window) {
  rt::KvLayerSpec l = full(heads, dim);
  l.kind = rt::KvLayerKind::kSlidingWindow;
  l.sliding_window = window;
  return l;
}

rt::KvLayerSpec gdn() {
  // Gated DeltaNet state: conv in the model dtype (8192 x (kernel - 1) elements; the
  // order of the dimensions does not change the bytes), recurrent
  // [num_v_heads, head_v_dim, head_k_dim] in float32.
  rt::KvLayerSpec l;
  l.kind = rt::KvLayerKind::kLinearAttention;
  l.states = {{{3, 8192}, rt::KvDtype::kBFloat16}, {{32, 128, 128}, rt::KvDtype::kFloat32}};
  return l;
}

// SmolLM2-135M: 30 layers, 3 KV heads of 64, float16.
rt::KvPoolConfig smollm2(int64_t budget, int64_t block_size = 16) {
  rt::KvPoolConfig c;
  c.layers.assign(30, full(3, 64));
  c.block_size = block_size;
  c.memory_budget_bytes = budget;
  return c;
}

void expect_error(const rt::KvPoolConfig& c, const std::vector<std::string>& fragments) {
  try {
    rt::plan_kv_pool(c);
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("[kv_geometry]", 0), 0u) << msg;
    for (const auto& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "'" << f << "' not in: " << msg;
  }
}

}  // namespace

TEST(KvGeometry, BudgetGivesBlocksAndShapes) {
  const auto g = rt::plan_kv_pool(smollm2(kGiB));
  const int64_t per_block = 30 * 2 * 16 * 3 * 64 * 2;  // K and V of every layer
  EXPECT_EQ(g.bytes_per_block, per_block);
  EXPECT_EQ(g.num_blocks, kGiB / per_block);
  EXPECT_EQ(g.kernel_block_size, 16);
  EXPECT_EQ(g.kernel_blocks_per_block, 1);
  EXPECT_EQ(g.kv_bytes, g.num_blocks * per_block);
  EXPECT_LE(g.total_bytes, kGiB);
  EXPECT_EQ(g.max_tokens, (g.num_blocks - 1) * 16);  // the null block holds nothing
  ASSERT_EQ(g.layers.size(), 30u);
  EXPECT_EQ(g.layers[7].cache_shape, (std::array<int64_t, 4>{g.num_blocks, 16, 3, 64}));
  EXPECT_EQ(g.layers[7].kernel_cache_shape, g.layers[7].cache_shape);
  EXPECT_EQ(g.layers[7].bytes, g.num_blocks * per_block / 30);
}

TEST(KvGeometry, KernelsReadVllmBlocksAsTheyAre) {
  // The kernels take the block size from the cache's shape: any size, no split.
  auto c = smollm2(kGiB, 64);
  auto g = rt::plan_kv_pool(c);
  EXPECT_EQ(g.kernel_block_size, 64);
  EXPECT_EQ(g.kernel_blocks_per_block, 1);
  EXPECT_EQ(g.num_kernel_blocks, g.num_blocks);
  EXPECT_EQ(g.layers[0].kernel_cache_shape, g.layers[0].cache_shape);
  // Hybrid models' block sizes (multiples of 16 sized to hold a state page) and odd ones.
  for (int64_t b : {1, 20, 48, 528}) EXPECT_EQ(rt::choose_kernel_block_size(b), b);
  c.block_size = 20;
  EXPECT_EQ(rt::plan_kv_pool(c).layers[0].cache_shape[1], 20);
}

TEST(KvGeometry, SmallerKernelBlocksAreTheSameMemory) {
  auto c = smollm2(kGiB, 64);
  c.kernel_block_size = 32;
  const auto g = rt::plan_kv_pool(c);
  EXPECT_EQ(g.kernel_blocks_per_block, 2);
  EXPECT_EQ(g.num_kernel_blocks, 2 * g.num_blocks);
  const auto& s = g.layers[0].cache_shape;
  const auto& k = g.layers[0].kernel_cache_shape;
  EXPECT_EQ(k, (std::array<int64_t, 4>{2 * g.num_blocks, 32, 3, 64}));
  EXPECT_EQ(s[0] * s[1] * s[2] * s[3], k[0] * k[1] * k[2] * k[3]);  // a reshape
  c.kernel_block_size = 8;
  EXPECT_EQ(rt::plan_kv_pool(c).kernel_blocks_per_block, 8);
  EXPECT_EQ(rt::choose_kernel_block_size(96, 32), 32);
  EXPECT_EQ(rt::choose_kernel_block_size(48, 3), 3);
}

TEST(KvGeometry, KernelBlockSizeMustDivideTheBlockSize) {
  auto c = smollm2(kGiB, 48);
  c.kernel_block_size = 32;
  expect_error(c, {"kernel_block_size must divide block_size 48", "got 32"});
  c.kernel_block_size = -16;
  expect_error(c, {"kernel_block_size must divide block_size 48", "got -16"});
  c.kernel_block_size = 0;
  c.block_size = 0;
  expect_error(c, {"block_size must be > 0, got 0"});
}

TEST(KvGeometry, BlockCountOverrideIsHonouredAndChecked) {
  auto c = smollm2(0);
  c.num_blocks = 100;
  const auto g = rt::plan_kv_pool(c);
  EXPECT_EQ(g.num_blocks, 100);
  EXPECT_EQ(g.layers[0].cache_shape[0], 100);
  // With a budget too: the override must fit, else say how many do.
  const int64_t per_block = 30 * 2 * 16 * 3 * 64 * 2;
  c.memory_budget_bytes = 50 * per_block + 7;
  expect_error(c, {"num_blocks = 100 needs", "at most 50 blocks fit"});
  c.memory_budget_bytes = 100 * per_block;
  EXPECT_EQ(rt::plan_kv_pool(c).num_blocks, 100);
  // And hold one sequence of max_model_len.
  c.max_model_len = 4096;  // 256 blocks + the null block
  expect_error(c, {"num_blocks = 100 holds 1584 tokens", "257 blocks", "max_model_len <= 1584"});
}

TEST(KvGeometry, TooSmallBudgetSaysWhatWouldFit) {
  auto c = smollm2(64 * kMiB);
  c.max_model_len = 8192;  // 512 blocks + null
  const int64_t per_block = 30 * 2 * 16 * 3 * 64 * 2;
  const int64_t fit = 64 * kMiB / per_block;
  expect_error(c, {"holds " + std::to_string(fit) + " blocks", "max_model_len = 8192 tokens needs 512 blocks",
                   "a budget of at least " + std::to_string(513 * per_block) + " B",
                   "max_model_len <= " + std::to_string((fit - 1) * 16)});
  c.max_model_len = static_cast<int64_t>((fit - 1) * 16);
  EXPECT_EQ(rt::plan_kv_pool(c).num_blocks, fit);
  c.memory_budget_bytes = 0;
  expect_error(c, {"need memory_budget_bytes > 0 or num_blocks > 0"});
}

TEST(KvGeometry, LinearAttentionStateComesOffTheBudgetFirst) {
  rt::KvPoolConfig c;
  for (int i = 0; i < 12; ++i) c.layers.push_back(i % 4 == 3 ? full(2, 256) : gdn());
  c.block_size = 64;
  c.max_num_seqs = 16;
  c.memory_budget_bytes = 2 * kGiB;
  const auto g = rt::plan_kv_pool(c);
  const int64_t per_seq = 3 * 8192 * 2 + 32 * 128 * 128 * 4;
  EXPECT_EQ(g.state_bytes, 9 * 16 * per_seq);
  EXPECT_EQ(g.bytes_per_block, 3 * 2 * 64 * 2 * 256 * 2);
  EXPECT_EQ(g.num_blocks, (2 * kGiB - g.state_bytes) / g.bytes_per_block);
  EXPECT_EQ(g.layers[0].state_shapes, (std::vector<std::vector<int64_t>>{{16, 3, 8192}, {16, 32, 128, 128}}));
  EXPECT_EQ(g.layers[0].bytes, 16 * per_seq);
  EXPECT_EQ(g.layers[0].cache_shape, (std::array<int64_t, 4>{}));
  EXPECT_EQ(g.layers[3].cache_shape[0], g.num_blocks);
  EXPECT_EQ(g.total_bytes, g.state_bytes + g.kv_bytes);
  c.max_num_seqs = 1000;
  expect_error(c, {"linear-attention state for max_num_seqs = 1000", "at most " + std::to_string(2 * kGiB / (9 * per_seq)) + " sequences fit"});
}

TEST(KvGeometry, SlidingWindowLayersAreAllocatedLikeFullAttention) {
  rt::KvPoolConfig c;
  for (int i = 0; i < 18; ++i) c.layers.push_back(i % 6 == 5 ? full(1, 256) : sliding(1, 256, 512));
  c.memory_budget_bytes = 256 * kMiB;
  const auto g = rt::plan_kv_pool(c);
  EXPECT_EQ(g.bytes_per_block, 18 * 2 * 16 * 256 * 2);
  EXPECT_EQ(g.layers[0].sliding_window, 512);
  EXPECT_EQ(g.layers[5].sliding_window, 0);
  EXPECT_EQ(g.layers[0].cache_shape, g.layers[5].cache_shape);
}

TEST(KvGeometry, AttentionFreeModelsHaveNoBlocks) {
  rt::KvPoolConfig c;
  c.layers = {gdn(), gdn()};
  c.max_num_seqs = 4;
  const auto g = rt::plan_kv_pool(c);  // no budget needed: only states
  EXPECT_EQ(g.num_blocks, 0);
  EXPECT_EQ(g.state_bytes, 2 * 4 * (3 * 8192 * 2 + 32 * 128 * 128 * 4));
  c.num_blocks = 10;
  expect_error(c, {"no layer uses KV blocks"});
}

TEST(KvGeometry, RejectsMalformedLayers) {
  auto c = smollm2(kGiB);
  c.layers[3].num_kv_heads = 0;
  expect_error(c, {"layer 3 (full_attention): num_kv_heads must be > 0, got 0"});
  c = smollm2(kGiB);
  c.layers[1].head_dim = -4;
  expect_error(c, {"layer 1", "head_dim must be > 0"});
  c = smollm2(kGiB);
  c.layers[2] = sliding(3, 64, 0);
  expect_error(c, {"layer 2 (sliding_window): sliding_window must be > 0"});
  c = smollm2(kGiB);
  c.layers[0].sliding_window = 64;
  expect_error(c, {"only for sliding_window layers"});
  c = smollm2(kGiB);
  c.layers.push_back(gdn());
  c.layers.back().states[1].shape[2] = 0;
  expect_error(c, {"state dimensions must be > 0"});
  c.layers.back().states.clear();
  expect_error(c, {"needs at least one state tensor"});
  c = smollm2(kGiB);
  c.layers.clear();
  expect_error(c, {"layers must not be empty"});
  c = smollm2(-1);
  expect_error(c, {"memory_budget_bytes must be >= 0"});
  c = smollm2(kGiB);
  c.layers[0].num_kv_heads = int64_t{1} << 40;
  c.layers[0].head_dim = int64_t{1} << 30;
  expect_error(c, {"overflows"});
  EXPECT_THROW(rt::parse_kv_dtype("float64"), std::invalid_argument);
  EXPECT_EQ(rt::parse_kv_dtype("bfloat16"), rt::KvDtype::kBFloat16);
  EXPECT_EQ(rt::parse_kv_layer_kind("linear_attention"), rt::KvLayerKind::kLinearAttention);
  EXPECT_THROW(rt::parse_kv_layer_kind("mamba"), std::invalid_argument);
}

TEST(KvGeometry, NullBlockCanBeLeftOut) {
  auto c = smollm2(0);
  c.num_blocks = 256;
  c.max_model_len = 4096;
  expect_error(c, {"256 blocks + the null block"});
  c.reserve_null_block = false;
  const auto g = rt::plan_kv_pool(c);
  EXPECT_EQ(g.max_tokens, 4096);
}

TEST(KvGeometry, SplitBlockIdsExpandsBlockTables) {
  const int32_t ids[] = {3, 0, -1, 7};
  int32_t out[8];
  rt::split_block_ids(ids, 4, 2, out);
  EXPECT_EQ(std::vector<int32_t>(out, out + 8), (std::vector<int32_t>{6, 7, 0, 1, -1, -1, 14, 15}));
  rt::split_block_ids(ids, 4, 1, out);
  EXPECT_EQ(std::vector<int32_t>(out, out + 4), (std::vector<int32_t>{3, 0, -1, 7}));
  // Slot numbers are unchanged by the split: b*B + o == (b*k + o/kb)*kb + o%kb.
  const int64_t B = 64, kb = 16, k = B / kb;
  for (int32_t b : {0, 5, 1000}) {
    int32_t sub[4];
    rt::split_block_ids(&b, 1, k, sub);
    for (int64_t o = 0; o < B; ++o) EXPECT_EQ(b * B + o, sub[o / kb] * kb + o % kb);
  }
  const int32_t big[] = {1 << 30};
  EXPECT_THROW(rt::split_block_ids(big, 1, 2, out), std::invalid_argument);
  EXPECT_THROW(rt::split_block_ids(ids, 1, 0, out), std::invalid_argument);
}

TEST(KvGeometry, SpeculativeDecodingDoublesTheState) {
  // Each linear layer keeps state_copies pools of max_num_seqs slots (the runner's
  // saved copies); the bytes come off the budget before the blocks.
  rt::KvPoolConfig c;
  for (int i = 0; i < 8; ++i) c.layers.push_back(i % 4 == 3 ? full(2, 256) : gdn());
  c.block_size = 64;
  c.max_num_seqs = 16;
  c.memory_budget_bytes = 2 * kGiB;
  const int64_t per_seq = 3 * 8192 * 2 + 32 * 128 * 128 * 4;
  const auto one = rt::plan_kv_pool(c);
  c.state_copies = 2;
  const auto two = rt::plan_kv_pool(c);
  EXPECT_EQ(one.state_bytes, 6 * 16 * per_seq);
  EXPECT_EQ(two.state_bytes, 2 * 6 * 16 * per_seq);
  EXPECT_EQ(two.state_copies, 2);
  EXPECT_EQ(two.num_blocks, (2 * kGiB - two.state_bytes) / two.bytes_per_block);
  EXPECT_EQ(two.layers[0].state_shapes, one.layers[0].state_shapes);  // one pool's shape
  EXPECT_EQ(two.layers[0].bytes, 2 * one.layers[0].bytes);
  c.max_num_seqs = 300;  // 300 * 2 copies do not fit in 2 GiB
  expect_error(c, {"max_num_seqs = 300 (2 copies)", "at most " + std::to_string(2 * kGiB / (2 * 6 * per_seq)) + " sequences fit"});
  c.state_copies = 0;
  expect_error(c, {"state_copies must be >= 1, got 0"});
}

TEST(KvGeometry, SizingNeedsNoBlockCount) {
  // What the worker reports before vLLM counts the blocks: the same bytes as a plan.
  rt::KvPoolConfig c;
  for (int i = 0; i < 8; ++i) c.layers.push_back(i % 4 == 3 ? full(2, 256, rt::KvDtype::kBFloat16) : gdn());
  c.block_size = 528;
  c.max_num_seqs = 4;
  c.state_copies = 2;
  const auto s = rt::size_kv_pool(c);
  EXPECT_EQ(s.num_blocks, 0);
  EXPECT_EQ(s.bytes_per_block, 2 * 2 * 528 * 2 * 256 * 2);
  EXPECT_EQ(s.state_bytes, 2 * 4 * 6 * (3 * 8192 * 2 + 32 * 128 * 128 * 4));
  EXPECT_EQ(s.layers[3].bytes_per_block, 2 * 528 * 2 * 256 * 2);
  EXPECT_EQ(s.layers[3].cache_shape, (std::array<int64_t, 4>{0, 528, 2, 256}));
  EXPECT_EQ(s.total_bytes, s.state_bytes);
  c.num_blocks = 10;
  const auto g = rt::plan_kv_pool(c);
  EXPECT_EQ(g.bytes_per_block, s.bytes_per_block);
  EXPECT_EQ(g.state_bytes, s.state_bytes);
  c.layers[3].head_dim = 0;  // still validated
  EXPECT_THROW(rt::size_kv_pool(c), std::invalid_argument);
}

TEST(KvGeometry, DescriptionNamesBlocksTokensAndMiB) {
  auto c = smollm2(0);
  c.num_blocks = 32;
  // 32 blocks * 368640 B = 11.25 MiB: a tie, rounded to even as Python's format does
  EXPECT_EQ(rt::describe_kv_pool(rt::plan_kv_pool(c)), "32 blocks of 16 tokens (512 tokens, 11.2 MiB)");
  rt::KvPoolConfig h;
  for (int i = 0; i < 4; ++i) h.layers.push_back(i == 3 ? full(2, 256) : gdn());
  h.block_size = 528;
  h.num_blocks = 10;
  h.max_num_seqs = 2;
  // KV: 10 * 2 * 528 * 2 * 256 * 2 = 10.3125 MiB; state: 3 layers * 2 slots * 2146304 B = 12.28125 MiB
  EXPECT_EQ(rt::describe_kv_pool(rt::plan_kv_pool(h)),
            "10 blocks of 528 tokens for 1 attention layers (10.3 MiB), 2 state slots for 3 linear-attention "
            "layers (12.3 MiB)");
}

TEST(KvGeometry, HybridPagesAlignToTheState) {
  // One attention layer's page (2 * B * 2 heads * 256 * 2 bytes = 2048 B per token) must
  // hold one sequence's GDN state (2146304 B): B = 16 * ceil(2146304 / (16 * 2048)) = 1056.
  const std::vector<rt::KvLayerSpec> layers = {gdn(), gdn(), gdn(), full(2, 256)};
  const auto a = rt::align_kv_pages(layers, 16);
  const int64_t state = 3 * 8192 * 2 + 32 * 128 * 128 * 4;
  EXPECT_EQ(a.state_page_bytes, state);
  EXPECT_EQ(a.block_size, 16 * ((state + 16 * 2048 - 1) / (16 * 2048)));
  EXPECT_EQ(a.block_size, 1056);
  EXPECT_EQ(a.page_bytes, 1056 * 2048);
  EXPECT_GE(a.page_bytes, state);
  EXPECT_LT(a.page_bytes - 16 * 2048, state);  // the smallest multiple of 16 that holds it
  // A state that fits in the base block leaves it as it is.
  rt::KvLayerSpec small;
  small.kind = rt::KvLayerKind::kLinearAttention;
  small.states = {{{4, 4}, rt::KvDtype::kFloat32}};
  EXPECT_EQ(rt::align_kv_pages({small, full(2, 256)}, 16).block_size, 16);
  EXPECT_EQ(rt::align_kv_pages({full(2, 256)}, 32).block_size, 32);  // no state: no change
  // Refusals.
  EXPECT_THROW(rt::align_kv_pages({gdn()}, 16), std::invalid_argument);  // no attention layer
  EXPECT_THROW(rt::align_kv_pages({full(2, 256), full(4, 256)}, 16), std::invalid_argument);
  EXPECT_THROW(rt::align_kv_pages(layers, 0), std::invalid_argument);
}
