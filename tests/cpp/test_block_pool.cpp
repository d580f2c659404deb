// BlockPool and BlockHashChain (src/cpp/runtime/block_pool.h, block_hash.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/block_hash.h"
#include "runtime/block_pool.h"

namespace rt = vllm_metal::runtime;
using rt::BlockId;

namespace {

constexpr uint64_t kSeed = 1234;

rt::BlockPool make_pool(int32_t num_blocks, int32_t block_size = 4, bool caching = true,
                        bool null_block = true, bool events = false) {
  rt::BlockPoolConfig c;
  c.num_blocks = num_blocks;
  c.block_size = block_size;
  c.enable_caching = caching;
  c.reserve_null_block = null_block;
  c.enable_events = events;
  return rt::BlockPool(c);
}

std::vector<int32_t> iota_tokens(int32_t n, int32_t start = 0) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), start);
  return t;
}

rt::BlockHashChain chain_of(const std::vector<int32_t>& tokens, int32_t block_size = 4,
                            uint64_t request_key = 0) {
  rt::BlockHashChain c(block_size, kSeed, request_key);
  c.append(tokens.data(), tokens.size());
  return c;
}

// Everything observable about a pool, to show a rejected call changed nothing.
struct Snapshot {
  std::vector<BlockId> queue;
  std::vector<int32_t> refs;
  std::vector<uint8_t> cached;
  int32_t num_free;
  int32_t num_cached;
  bool operator==(const Snapshot& o) const {
    return queue == o.queue && refs == o.refs && cached == o.cached && num_free == o.num_free &&
           num_cached == o.num_cached;
  }
};

Snapshot snapshot(const rt::BlockPool& p) {
  Snapshot s{p.free_queue(), {}, {}, p.num_free_blocks(), p.num_cached_blocks()};
  for (BlockId b = 0; b < p.num_blocks(); ++b) {
    s.refs.push_back(p.ref_count(b));
    s.cached.push_back(p.is_cached(b));
  }
  return s;
}

template <typename F>
void expect_rejected(rt::BlockPool& p, F&& call, const std::string& fragment) {
  const Snapshot before = snapshot(p);
  try {
    call();
    FAIL() << "expected std::invalid_argument containing '" << fragment << "'";
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("[BlockPool]", 0), 0u) << msg;
    EXPECT_NE(msg.find(fragment), std::string::npos) << msg;
  }
  EXPECT_TRUE(snapshot(p) == before) << "a rejected call changed the pool";
  p.check_invariants();
}

// Allocates blocks for `tokens`, reusing the cached prefix, and caches its full
// blocks: what a scheduler does when a request arrives (whole prompt computed).
std::vector<BlockId> admit(rt::BlockPool& p, const rt::BlockHashChain& c) {
  std::vector<BlockId> blocks = p.find_cached_prefix(c.data(), c.num_blocks(), c.num_tokens());
  p.touch(blocks.data(), blocks.size());
  const size_t hit = blocks.size();
  const int32_t need = static_cast<int32_t>((c.num_tokens() + p.block_size() - 1) / p.block_size()) -
                       static_cast<int32_t>(hit);
  std::vector<BlockId> fresh = p.allocate(need);
  blocks.insert(blocks.end(), fresh.begin(), fresh.end());
  p.cache_full_blocks(blocks.data(), blocks.size(), c.data(), c.num_blocks(), hit, c.num_blocks());
  return blocks;
}

void release(rt::BlockPool& p, std::vector<BlockId> blocks) {
  std::reverse(blocks.begin(), blocks.end());  // tail first, as vLLM frees
  p.free(blocks.data(), blocks.size());
}

}  // namespace

// ---- SipHash and the hash chain ----------------------------------------------------

TEST(BlockHash, SipHashMatchesPublishedVectors) {
  // Key 00 01 .. 0f, message 00 01 .. (n-1): the reference test vectors.
  uint64_t k0, k1;
  uint8_t key[16], msg[64];
  for (int i = 0; i < 16; ++i) key[i] = static_cast<uint8_t>(i);
  for (int i = 0; i < 64; ++i) msg[i] = static_cast<uint8_t>(i);
  std::memcpy(&k0, key, 8);
  std::memcpy(&k1, key + 8, 8);
  EXPECT_EQ(rt::siphash24_64(k0, k1, msg, 0), 0x726fdb47dd0e0e31ULL);
  EXPECT_EQ(rt::siphash24_64(k0, k1, msg, 1), 0x74f839c593dc67fdULL);
  EXPECT_EQ(rt::siphash24_64(k0, k1, msg, 15), 0xa129ca6149be45e5ULL);  // the paper's example
  const rt::BlockHash h = rt::siphash24_128(k0, k1, msg, 0);
  const uint8_t expect0[16] = {0xa3, 0x81, 0x7f, 0x04, 0xba, 0x25, 0xa8, 0xe6,
                               0x6d, 0xf6, 0x72, 0x14, 0xc7, 0x55, 0x02, 0x93};
  uint8_t got[16];
  std::memcpy(got, &h.lo, 8);
  std::memcpy(got + 8, &h.hi, 8);
  EXPECT_EQ(std::memcmp(got, expect0, 16), 0);
}

TEST(BlockHash, ChainHashesOnlyFullBlocksAndIgnoresChunking) {
  const auto tokens = iota_tokens(23, 100);
  rt::BlockHashChain whole(4, kSeed);
  EXPECT_EQ(whole.append(tokens.data(), tokens.size()), 5u);
  EXPECT_EQ(whole.num_tokens(), 23);
  EXPECT_EQ(whole.num_blocks(), 5u);

  for (size_t step : {1u, 3u, 4u, 7u}) {
    rt::BlockHashChain pieces(4, kSeed);
    for (size_t i = 0; i < tokens.size(); i += step) {
      pieces.append(tokens.data() + i, std::min(step, tokens.size() - i));
    }
    EXPECT_EQ(pieces.hashes(), whole.hashes()) << "step " << step;
  }
  // The explicit formula: block i chains over block i-1, the first over the root.
  rt::BlockHash parent = whole.root();
  for (size_t b = 0; b < 5; ++b) {
    const rt::BlockHash h = rt::hash_block_tokens(kSeed, parent, tokens.data() + 4 * b, 4, nullptr, 0);
    EXPECT_EQ(h, whole.hashes()[b]);
    parent = h;
  }
}

TEST(BlockHash, ChainingSeedAndRequestKeySeparateSequences) {
  auto a = iota_tokens(16);
  auto b = a;
  b[1] = 999;  // differs in block 0: every hash differs
  const auto ca = chain_of(a), cb = chain_of(b);
  for (size_t i = 0; i < 4; ++i) EXPECT_NE(ca.hashes()[i], cb.hashes()[i]);
  auto c = a;
  c[9] = 999;  // differs in block 2: blocks 0, 1 equal
  const auto cc = chain_of(c);
  EXPECT_EQ(ca.hashes()[1], cc.hashes()[1]);
  EXPECT_NE(ca.hashes()[2], cc.hashes()[2]);
  EXPECT_NE(ca.hashes()[3], cc.hashes()[3]);
  EXPECT_NE(chain_of(a, 4, 7).hashes()[0], ca.hashes()[0]);  // request key (LoRA, salt)
  rt::BlockHashChain other_seed(4, kSeed + 1);
  other_seed.append(a.data(), a.size());
  EXPECT_NE(other_seed.hashes()[0], ca.hashes()[0]);
  EXPECT_EQ(chain_of(a).hashes(), ca.hashes());  // deterministic for a fixed seed
}

TEST(BlockHash, ExtraKeysChangeTheBlocksTheyCover) {
  const auto tokens = iota_tokens(16);
  const auto plain = chain_of(tokens);
  rt::BlockHashChain mm(4, kSeed);
  mm.add_extra_key(5, 2, 42);  // tokens 5, 6: block 1 only
  mm.append(tokens.data(), tokens.size());
  EXPECT_EQ(mm.hashes()[0], plain.hashes()[0]);
  EXPECT_NE(mm.hashes()[1], plain.hashes()[1]);
  EXPECT_NE(mm.hashes()[3], plain.hashes()[3]);  // chained
  rt::BlockHashChain other_item(4, kSeed);
  other_item.add_extra_key(5, 2, 43);
  other_item.append(tokens.data(), tokens.size());
  EXPECT_NE(other_item.hashes()[1], mm.hashes()[1]);
  rt::BlockHashChain moved(4, kSeed);
  moved.add_extra_key(6, 1, 42);  // same item, another offset in the same block
  moved.append(tokens.data(), tokens.size());
  EXPECT_NE(moved.hashes()[1], mm.hashes()[1]);
}

TEST(BlockHash, ExtraKeyValidation) {
  rt::BlockHashChain c(4, kSeed);
  const auto t = iota_tokens(6);
  c.append(t.data(), t.size());  // block 0 hashed
  EXPECT_THROW(c.add_extra_key(2, 1, 1), std::invalid_argument);  // block 0 already hashed
  EXPECT_THROW(c.add_extra_key(4, 0, 1), std::invalid_argument);  // empty span
  c.add_extra_key(5, 3, 1);                                        // partial block 1: fine
  EXPECT_THROW(c.add_extra_key(4, 1, 1), std::invalid_argument);  // out of offset order
  EXPECT_THROW(rt::BlockHashChain(0, kSeed), std::invalid_argument);
}

// ---- the pool: allocation, free, sharing -------------------------------------------

TEST(BlockPool, StartsWithEveryBlockButTheNullBlockFree) {
  auto p = make_pool(8);
  EXPECT_EQ(p.null_block(), 0);
  EXPECT_EQ(p.num_free_blocks(), 7);
  EXPECT_EQ(p.num_usable_blocks(), 7);
  EXPECT_EQ(p.free_queue(), (std::vector<BlockId>{1, 2, 3, 4, 5, 6, 7}));
  EXPECT_DOUBLE_EQ(p.usage(), 0.0);
  auto q = make_pool(3, 4, true, /*null_block=*/false);
  EXPECT_EQ(q.null_block(), -1);
  EXPECT_EQ(q.free_queue(), (std::vector<BlockId>{0, 1, 2}));
  EXPECT_THROW(make_pool(0), std::invalid_argument);
  EXPECT_THROW(make_pool(4, 0), std::invalid_argument);
}

TEST(BlockPool, AllocateTakesTheFrontAndRefusesMoreThanFree) {
  auto p = make_pool(8);
  EXPECT_EQ(p.allocate(3), (std::vector<BlockId>{1, 2, 3}));
  EXPECT_EQ(p.ref_count(2), 1);
  EXPECT_EQ(p.num_used_blocks(), 3);
  EXPECT_NEAR(p.usage(), 3.0 / 7.0, 1e-12);
  expect_rejected(p, [&] { p.allocate(5); }, "cannot allocate 5 blocks, 4 free");
  expect_rejected(p, [&] { p.allocate(-1); }, "must be >= 0");
  EXPECT_TRUE(p.allocate(0).empty());
  EXPECT_EQ(p.allocate(4).size(), 4u);
  EXPECT_EQ(p.num_free_blocks(), 0);
  p.check_invariants();
}

TEST(BlockPool, FreedUncachedBlocksAreReusedFirst) {
  auto p = make_pool(8);
  const auto a = p.allocate(3);  // 1 2 3
  release(p, a);                 // frees 3 2 1: put at the front in that order
  EXPECT_EQ(p.free_queue(), (std::vector<BlockId>{3, 2, 1, 4, 5, 6, 7}));
  EXPECT_EQ(p.allocate(1), (std::vector<BlockId>{3}));
  p.check_invariants();
}

TEST(BlockPool, FreedCachedBlocksGoToTheBackInFreeOrder) {
  auto p = make_pool(8);
  const auto c = chain_of(iota_tokens(10));  // 2 full blocks + 2 tokens
  const auto blocks = admit(p, c);
  EXPECT_EQ(blocks, (std::vector<BlockId>{1, 2, 3}));
  EXPECT_TRUE(p.is_cached(1));
  EXPECT_TRUE(p.is_cached(2));
  EXPECT_FALSE(p.is_cached(3));
  release(p, blocks);  // 3 (uncached) to the front; 2 then 1 to the back
  EXPECT_EQ(p.free_queue(), (std::vector<BlockId>{3, 4, 5, 6, 7, 2, 1}));
  EXPECT_EQ(p.num_cached_blocks(), 2);
  p.check_invariants();
}

TEST(BlockPool, DoubleFreeAndForeignIdsAreRejectedWithoutChange) {
  auto p = make_pool(8);
  const auto a = p.allocate(2);  // 1 2
  p.touch(&a[0], 1);             // block 1: 2 references
  expect_rejected(p, [&] { BlockId ids[] = {3}; p.free(ids, 1); }, "already free (double free)");
  expect_rejected(p, [&] { BlockId ids[] = {2, 2}; p.free(ids, 2); }, "freed 2 times but has 1 reference");
  expect_rejected(p, [&] { BlockId ids[] = {1, 2, 8}; p.free(ids, 3); }, "block id 8 is outside the pool");
  expect_rejected(p, [&] { BlockId ids[] = {-1}; p.free(ids, 1); }, "outside the pool");
  expect_rejected(p, [&] { BlockId ids[] = {1, 1, 1}; p.free(ids, 3); }, "freed 3 times but has 2");
  BlockId twice[] = {1, 1};
  p.free(twice, 2);  // both references: fine
  EXPECT_EQ(p.ref_count(1), 0);
  expect_rejected(p, [&] { BlockId ids[] = {9}; p.touch(ids, 1); }, "outside the pool");
  expect_rejected(p, [&] { BlockId ids[] = {2, 5}; p.touch(ids, 2); }, "block 5 is free and holds no cached prefix");
  expect_rejected(p, [&] { BlockId ids[] = {100}; p.evict_cached(ids, 1); }, "outside the pool");
  EXPECT_THROW(p.ref_count(8), std::invalid_argument);
  EXPECT_THROW(p.block_hash(2), std::invalid_argument);  // not cached
}

TEST(BlockPool, NullBlockIsSkippedByFreeTouchAndCache) {
  auto p = make_pool(4);
  const auto before = snapshot(p);
  BlockId null_ids[] = {0, 0};
  p.free(null_ids, 2);
  p.touch(null_ids, 2);
  EXPECT_TRUE(snapshot(p) == before);
  const auto c = chain_of(iota_tokens(8));
  auto b = p.allocate(1);
  BlockId ids[] = {0, b[0]};  // a sliding-window style table: null, then a real block
  p.cache_full_blocks(ids, 2, c.data(), c.num_blocks(), 0, 2);
  EXPECT_FALSE(p.is_cached(0));
  EXPECT_TRUE(p.is_cached(b[0]));
  p.check_invariants();
}

// ---- the prefix cache ------------------------------------------------------------

TEST(BlockPool, PrefixHitLeavesTheLastTokenToCompute) {
  auto p = make_pool(16);
  const auto c = chain_of(iota_tokens(12));  // exactly 3 blocks
  const auto first = admit(p, c);
  release(p, first);
  // A second identical prompt: 12 tokens, at most (12 - 1) / 4 = 2 blocks may hit.
  const auto hit = p.find_cached_prefix(c.data(), c.num_blocks(), c.num_tokens());
  EXPECT_EQ(hit, (std::vector<BlockId>{first[0], first[1]}));
  // One more token: all 3 blocks hit.
  const auto longer = chain_of(iota_tokens(13));
  EXPECT_EQ(p.find_cached_prefix(longer.data(), longer.num_blocks(), 13).size(), 3u);
  // A prompt diverging in block 1 hits block 0 only.
  auto t = iota_tokens(13);
  t[5] = -5;
  const auto diverged = chain_of(t);
  EXPECT_EQ(p.find_cached_prefix(diverged.data(), diverged.num_blocks(), 13).size(), 1u);
  EXPECT_EQ(p.stats().lookups, 4);  // admit() looked up once too
  EXPECT_EQ(p.stats().lookup_tokens, 12 + 12 + 13 + 13);
  EXPECT_EQ(p.stats().hit_tokens, 8 + 12 + 4);
  EXPECT_TRUE(p.find_cached_prefix(c.data(), c.num_blocks(), 0).empty());
  EXPECT_THROW(p.find_cached_prefix(c.data(), c.num_blocks(), -1), std::invalid_argument);
  EXPECT_EQ(p.stats().lookups, 5);
  // lookup() itself has no token cap and counts nothing.
  std::vector<BlockId> out(3);
  EXPECT_EQ(p.lookup(c.data(), c.num_blocks(), 3, out.data()), 3u);
  EXPECT_EQ(p.lookup(c.data(), c.num_blocks(), 1, out.data()), 1u);
  EXPECT_EQ(p.stats().lookups, 5);
}

TEST(BlockPool, SharingACachedPrefixKeepsItFromEviction) {
  auto p = make_pool(6);  // 5 usable
  const auto c = chain_of(iota_tokens(9));
  const auto a = admit(p, c);  // 1 2 3; 1 and 2 cached
  const auto b = admit(p, c);  // hits 1 2, allocates 4
  EXPECT_EQ(b, (std::vector<BlockId>{1, 2, 4}));
  EXPECT_EQ(p.ref_count(1), 2);
  release(p, a);
  EXPECT_EQ(p.ref_count(1), 1);
  EXPECT_EQ(p.free_queue(), (std::vector<BlockId>{3, 5}));  // 1 and 2 still shared by b
  release(p, b);
  EXPECT_EQ(p.free_queue(), (std::vector<BlockId>{4, 3, 5, 2, 1}));
  // Touching a free cached block takes it off the queue.
  const BlockId hit[] = {1, 2, 1, 4};
  EXPECT_EQ(p.count_free(hit, 4), 3);  // 1, 2 and 4 are free; 1 counts once
  BlockId one[] = {1};
  p.touch(one, 1);
  EXPECT_EQ(p.free_queue(), (std::vector<BlockId>{4, 3, 5, 2}));
  EXPECT_EQ(p.ref_count(1), 1);
  p.check_invariants();
}

TEST(BlockPool, EvictsLeastRecentlyFreedCachedBlocksOnlyWhenFreeBlocksRunOut) {
  auto p = make_pool(7, 4, true, true, /*events=*/true);  // 6 usable
  const auto ca = chain_of(iota_tokens(8, 0));
  const auto cb = chain_of(iota_tokens(8, 100));
  const auto a = admit(p, ca);  // 1 2 (2 full blocks, both cached)
  const auto b = admit(p, cb);  // 3 4
  release(p, a);                // back: 2 1
  release(p, b);                // back: 2 1 4 3
  EXPECT_EQ(p.free_queue(), (std::vector<BlockId>{5, 6, 2, 1, 4, 3}));
  p.take_events();
  const auto fresh = p.allocate(3);  // 5, 6 (never used), then evicts 2
  EXPECT_EQ(fresh, (std::vector<BlockId>{5, 6, 2}));
  EXPECT_FALSE(p.is_cached(2));
  EXPECT_TRUE(p.is_cached(1));
  // a's block 0 (block 1) is still findable; its block 1 (block 2) is gone.
  EXPECT_EQ(p.find_cached_prefix(ca.data(), ca.num_blocks(), 9), (std::vector<BlockId>{1}));
  const auto ev = p.take_events();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].kind, rt::KvEventKind::kRemoved);
  EXPECT_EQ(ev[0].block_id, 2);
  EXPECT_EQ(ev[0].hash, ca.hashes()[1]);
  EXPECT_EQ(p.stats().evicted, 1);
  p.check_invariants();
}

TEST(BlockPool, StoredEventsCarryParentHashes) {
  auto p = make_pool(8, 4, true, true, true);
  const auto c = chain_of(iota_tokens(12));
  admit(p, c);  // caches 3 blocks (12 tokens, all full)
  const auto ev = p.take_events();
  ASSERT_EQ(ev.size(), 3u);
  EXPECT_EQ(ev[0].kind, rt::KvEventKind::kStored);
  EXPECT_FALSE(ev[0].has_parent);
  EXPECT_TRUE(ev[2].has_parent);
  EXPECT_EQ(ev[2].parent, c.hashes()[1]);
  EXPECT_EQ(ev[2].hash, c.hashes()[2]);
  EXPECT_TRUE(p.take_events().empty());
  auto quiet = make_pool(8);  // events off: nothing recorded
  admit(quiet, c);
  EXPECT_TRUE(quiet.take_events().empty());
}

TEST(BlockPool, DuplicateHashesAreKeptAndTheOldestIsReturned) {
  auto p = make_pool(8);
  const auto c = chain_of(iota_tokens(5));  // 1 full block
  // Two requests compute the same block concurrently (neither saw the other's cache).
  const auto a = p.allocate(2);
  const auto b = p.allocate(2);
  p.cache_full_blocks(a.data(), a.size(), c.data(), c.num_blocks(), 0, 1);
  p.cache_full_blocks(b.data(), b.size(), c.data(), c.num_blocks(), 0, 1);
  EXPECT_TRUE(p.is_cached(a[0]));
  EXPECT_TRUE(p.is_cached(b[0]));
  std::vector<BlockId> out(1);
  ASSERT_EQ(p.lookup(c.data(), 1, 1, out.data()), 1u);
  EXPECT_EQ(out[0], a[0]);
  BlockId first[] = {a[0]};
  p.evict_cached(first, 1);
  ASSERT_EQ(p.lookup(c.data(), 1, 1, out.data()), 1u);
  EXPECT_EQ(out[0], b[0]);
  p.check_invariants();
}

TEST(BlockPool, CacheFullBlocksValidation) {
  auto p = make_pool(8);
  const auto c = chain_of(iota_tokens(12));
  const auto other = chain_of(iota_tokens(12, 50));
  auto blocks = p.allocate(3);
  p.cache_full_blocks(blocks.data(), 3, c.data(), 3, 0, 2);
  p.cache_full_blocks(blocks.data(), 3, c.data(), 3, 0, 2);  // same hashes again: no-op
  EXPECT_EQ(p.num_cached_blocks(), 2);
  expect_rejected(p, [&] { p.cache_full_blocks(blocks.data(), 3, other.data(), 3, 0, 3); },
                  "already cached under another hash");
  expect_rejected(p, [&] { p.cache_full_blocks(blocks.data(), 2, c.data(), 3, 0, 3); }, "needs that many");
  expect_rejected(p, [&] { p.cache_full_blocks(blocks.data(), 3, c.data(), 3, 3, 2); }, "must be <= num_full");
  BlockId free_block[] = {7};
  expect_rejected(p, [&] { p.cache_full_blocks(free_block, 1, c.data(), 3, 0, 1); }, "block 7 is free");
  BlockId foreign[] = {blocks[2], 12};
  expect_rejected(p, [&] { p.cache_full_blocks(foreign, 2, c.data(), 3, 0, 2); }, "block id 12 is outside");
  BlockId same_twice[] = {blocks[2], blocks[2]};
  expect_rejected(p, [&] { p.cache_full_blocks(same_twice, 2, other.data(), 3, 0, 2); },
                  "with different hashes");
  p.cache_full_blocks(blocks.data(), 3, c.data(), 3, 2, 3);
  EXPECT_EQ(p.num_cached_blocks(), 3);
  EXPECT_EQ(p.block_hash(blocks[2]), c.hashes()[2]);
}

TEST(BlockPool, ResetPrefixCacheOnlyWhenNothingIsInUse) {
  auto p = make_pool(8, 4, true, true, true);
  const auto c = chain_of(iota_tokens(9));
  const auto a = admit(p, c);
  p.take_events();
  EXPECT_FALSE(p.reset_prefix_cache());
  EXPECT_EQ(p.num_cached_blocks(), 2);
  release(p, a);
  const auto queue = p.free_queue();
  EXPECT_TRUE(p.reset_prefix_cache());
  EXPECT_EQ(p.num_cached_blocks(), 0);
  EXPECT_EQ(p.free_queue(), queue);  // order kept
  EXPECT_TRUE(p.find_cached_prefix(c.data(), c.num_blocks(), 9).empty());
  const auto ev = p.take_events();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].kind, rt::KvEventKind::kAllCleared);
  EXPECT_EQ(p.stats().resets, 1);
  p.check_invariants();
}

TEST(BlockPool, CachingDisabledCachesNothing) {
  auto p = make_pool(8, 4, /*caching=*/false);
  const auto c = chain_of(iota_tokens(9));
  const auto a = admit(p, c);
  EXPECT_EQ(p.num_cached_blocks(), 0);
  release(p, a);
  EXPECT_EQ(p.free_queue(), (std::vector<BlockId>{3, 2, 1, 4, 5, 6, 7}));  // all to the front
  EXPECT_TRUE(p.find_cached_prefix(c.data(), c.num_blocks(), 9).empty());
  EXPECT_EQ(p.stats().lookups, 0);
  p.check_invariants();
}

// Random operations, invariants checked after each (run under ASan/UBSan by
// tests/py/test_runtime_sanitizers.py).
TEST(BlockPool, RandomOperationsKeepInvariants) {
  std::mt19937 rng(7);
  for (int round = 0; round < 4; ++round) {
    auto p = make_pool(24, 4, round != 3, round != 2, round == 1);
    std::vector<std::vector<BlockId>> live;
    for (int step = 0; step < 2000; ++step) {
      const int op = static_cast<int>(rng() % 10);
      if (op < 5) {
        // a request whose prompt shares one of a few prefixes
        std::vector<int32_t> t = iota_tokens(1 + static_cast<int32_t>(rng() % 17), 1000 * static_cast<int32_t>(rng() % 3));
        const auto c = chain_of(t);
        const auto hit = p.find_cached_prefix(c.data(), c.num_blocks(), c.num_tokens());
        const int32_t need = static_cast<int32_t>((c.num_tokens() + 3) / 4) - static_cast<int32_t>(hit.size());
        const int32_t evictable = p.count_free(hit.data(), hit.size());
        if (need + evictable > p.num_free_blocks()) continue;
        live.push_back(admit(p, c));
      } else if (op < 8 && !live.empty()) {
        const size_t i = rng() % live.size();
        release(p, live[i]);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
      } else if (op == 8) {
        // a block nobody holds (or an id outside the pool): always refused
        const BlockId id = static_cast<BlockId>(rng() % 30) - 3;
        const bool inside = id >= 0 && id < p.num_blocks();
        if (inside && (id == p.null_block() || p.ref_count(id) > 0)) continue;
        EXPECT_THROW(p.free(&id, 1), std::invalid_argument);
      } else {
        p.reset_prefix_cache();
      }
      p.check_invariants();
    }
  }
}
