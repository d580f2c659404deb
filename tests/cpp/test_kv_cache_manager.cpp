// KvCacheManager (src/cpp/runtime/kv_cache_manager.h): per-request blocks over
// one BlockPool. The expected values follow vLLM 0.33's KVCacheManager rules,
// worked out by hand here; tests/py/test_core_kv_cache_manager.py compares the
// served path with vLLM's own manager step by step.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/kv_cache_manager.h"

namespace rt = vllm_metal::runtime;
using rt::BlockId;
using Ids = std::vector<BlockId>;

namespace {

rt::KvCacheManager make(int32_t num_blocks, std::vector<int32_t> sizes = {4}, bool caching = true) {
  rt::KvCacheManagerConfig c;
  c.num_blocks = num_blocks;
  c.group_block_sizes = std::move(sizes);
  c.enable_caching = caching;
  return rt::KvCacheManager(c);
}

std::vector<rt::BlockHash> hashes(uint64_t tag, size_t n) {
  std::vector<rt::BlockHash> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = rt::BlockHash{tag * 1000 + i, 7};
  return out;
}

Ids alloc(rt::KvCacheManager& m, const std::string& req, int64_t tokens, const Ids& computed,
          const std::vector<rt::BlockHash>& h, int32_t reserved = 0) {
  std::vector<Ids> fresh;
  EXPECT_TRUE(m.allocate_slots(req, tokens, computed.data(), computed.size(), tokens, h.data(), h.size(),
                               reserved, &fresh));
  return fresh.at(0);
}

}  // namespace

TEST(KvCacheManager, AllocatesPerBlockAndCachesFullBlocksOnly) {
  auto m = make(10);
  const auto h = hashes(1, 2);  // 10 tokens: two full blocks of 4
  EXPECT_EQ(alloc(m, "a", 10, {}, h), (Ids{1, 2, 3}));
  EXPECT_EQ(m.num_cached_blocks("a"), 2u);
  EXPECT_TRUE(m.pool().is_cached(1));
  EXPECT_TRUE(m.pool().is_cached(2));
  EXPECT_FALSE(m.pool().is_cached(3));
  // growing within the last block allocates nothing; past it, one block
  EXPECT_TRUE(alloc(m, "a", 12, {}, h).empty());
  EXPECT_EQ(alloc(m, "a", 13, {}, h), (Ids{4}));
  EXPECT_EQ(m.blocks("a", 0), (Ids{1, 2, 3, 4}));
}

TEST(KvCacheManager, AHitIsAdoptedTouchedAndCounted) {
  auto m = make(6);
  const auto h = hashes(1, 3);
  alloc(m, "a", 12, {}, h);  // blocks 1 2 3, all cached
  m.free("a");               // free queue: 4 5, then 3 2 1 (tail first)
  EXPECT_EQ(m.pool().free_queue(), (Ids{4, 5, 3, 2, 1}));
  // the last token is always computed: a 12-token prompt hits 2 blocks
  const Ids hit = m.find_cached_prefix(h.data(), h.size(), 11);
  EXPECT_EQ(hit, (Ids{1, 2}));
  // 2 hit blocks are free (touching uses them) + 1 new block for tokens 8..11
  EXPECT_EQ(m.num_blocks_to_allocate("b", 12, hit.data(), hit.size()), 3);
  EXPECT_EQ(alloc(m, "b", 12, hit, h), (Ids{4}));
  EXPECT_EQ(m.blocks("b", 0), (Ids{1, 2, 4}));
  EXPECT_EQ(m.pool().ref_count(1), 1);
  // block 4 took tokens 8..11 under hash 2; block 3 still holds that hash too
  EXPECT_EQ(m.num_cached_blocks("b"), 3u);
}

TEST(KvCacheManager, RefusesWhatDoesNotFitBesideTheReserveAndChangesNothing) {
  auto m = make(5);  // 4 usable blocks
  const auto h = hashes(1, 0);
  std::vector<Ids> fresh;
  EXPECT_FALSE(m.allocate_slots("a", 17, nullptr, 0, 0, h.data(), 0, 0, &fresh));  // needs 5
  EXPECT_FALSE(m.allocate_slots("a", 16, nullptr, 0, 0, h.data(), 0, 1, &fresh));  // 4 + reserve 1
  EXPECT_FALSE(m.has_request("a"));
  EXPECT_EQ(m.pool().num_free_blocks(), 4);
  EXPECT_TRUE(m.allocate_slots("a", 16, nullptr, 0, 0, h.data(), 0, 0, &fresh));
  EXPECT_EQ(m.pool().num_free_blocks(), 0);
}

TEST(KvCacheManager, GroupsTakeTheirOwnBlockCounts) {
  // a hybrid layout: attention blocks of 4 tokens, one state block per request
  auto m = make(10, {4, 64}, /*caching=*/false);
  std::vector<Ids> fresh;
  EXPECT_EQ(m.num_blocks_to_allocate("a", 9, nullptr, 0), 3 + 1);
  ASSERT_TRUE(m.allocate_slots("a", 9, nullptr, 0, 9, nullptr, 0, 0, &fresh));
  EXPECT_EQ(fresh[0], (Ids{1, 2, 3}));
  EXPECT_EQ(fresh[1], (Ids{4}));
  ASSERT_TRUE(m.allocate_slots("a", 13, nullptr, 0, 13, nullptr, 0, 0, &fresh));
  EXPECT_EQ(fresh[0], (Ids{5}));
  EXPECT_TRUE(fresh[1].empty());
  m.free("a");
  EXPECT_EQ(m.pool().num_free_blocks(), 9);
}

TEST(KvCacheManager, HybridHitAdoptsGroupZeroAndTakesFreshStateBlocks) {
  // attention blocks of 4 tokens (cached), one uncached state block per request
  auto m = make(12, {4, 64}, /*caching=*/true);
  const auto h = hashes(1, 3);
  std::vector<Ids> fresh;
  ASSERT_TRUE(m.allocate_slots("a", 12, nullptr, 0, 12, h.data(), h.size(), 0, &fresh));
  EXPECT_EQ(fresh[0], (Ids{1, 2, 3}));
  EXPECT_EQ(fresh[1], (Ids{4}));
  m.free("a");
  const Ids hit = m.find_cached_prefix(h.data(), h.size(), 11);
  EXPECT_EQ(hit, (Ids{1, 2}));
  EXPECT_EQ(m.num_blocks_to_allocate("b", 12, hit.data(), hit.size()), 1 + 1 + 2);  // new + state + 2 hit blocks leave the free queue
  ASSERT_TRUE(m.allocate_slots("b", 12, hit.data(), hit.size(), 12, h.data(), h.size(), 0, &fresh));
  ASSERT_EQ(fresh[0].size(), 1u);
  ASSERT_EQ(fresh[1].size(), 1u);
  EXPECT_EQ(m.blocks("b", 0), (Ids{1, 2, fresh[0][0]}));
  EXPECT_EQ(m.blocks("b", 1), fresh[1]);
  EXPECT_NE(fresh[0][0], fresh[1][0]);
  EXPECT_EQ(m.num_cached_blocks("b"), 3u);  // its third block cached as it fills
}

TEST(KvCacheManager, CachingOffNeverHitsOrCaches) {
  auto m = make(8, {4}, /*caching=*/false);
  const auto h = hashes(1, 2);
  alloc(m, "a", 8, {}, h);
  EXPECT_EQ(m.pool().num_cached_blocks(), 0);
  EXPECT_TRUE(m.find_cached_prefix(h.data(), h.size(), 100).empty());
}

TEST(KvCacheManager, BadInputIsRefusedBeforeAnyChange) {
  rt::KvCacheManagerConfig c;
  c.num_blocks = 8;
  EXPECT_THROW(rt::KvCacheManager{c}, std::invalid_argument);  // no group
  c.group_block_sizes = {0};
  EXPECT_THROW(rt::KvCacheManager{c}, std::invalid_argument);

  auto m = make(8);
  const auto h = hashes(1, 2);
  alloc(m, "a", 8, {}, h);
  m.free("a");
  const Ids hit = m.find_cached_prefix(h.data(), h.size(), 8);
  alloc(m, "b", 4, {}, h);
  std::vector<Ids> fresh;
  // a hit is adopted only on a request's first allocation
  EXPECT_THROW(m.allocate_slots("b", 12, hit.data(), hit.size(), 12, h.data(), h.size(), 0, &fresh),
               std::invalid_argument);
  EXPECT_EQ(m.blocks("b", 0).size(), 1u);
  m.free("unknown");  // aborted before allocation: nothing to do
}
