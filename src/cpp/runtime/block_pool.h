// BlockPool: a fixed set of KV-cache blocks with reference counts and a prefix
// cache of full blocks (plain C++17, no MLX, no Python). The native engine's
// allocator; inside `vllm serve` vLLM's own pool hands out the block ids.
//
// Behaviour matches vLLM 0.33's BlockPool for one KV-cache group, so the same
// operation trace gives the same block ids, hits and evictions
// (tests/py/test_block_pool_vllm_trace.py replays one through both):
//   - Free blocks wait in one queue, in eviction order. allocate() takes from
//     its front. free() puts blocks whose ref count reaches 0 back: blocks with
//     no cached prefix at the front (reused first, LIFO), cached blocks at the
//     back (FIFO, so the least recently freed cached block is evicted first).
//     Free a sequence's blocks tail first, so its chain is evicted from the end.
//   - A cached block whose ref count is 0 stays findable until allocate()
//     reaches it in the queue: only then is it evicted (its hash dropped).
//   - touch() (sharing a cached prefix) takes a free cached block out of the queue.
//   - Block 0 is the null block when reserve_null_block is set: never handed out,
//     never cached, skipped by free/touch/cache (a padding target for block tables).
//   - Blocks are not de-duplicated: two blocks may hold the same hash; a lookup
//     returns the one cached first among those still cached.
//
// Errors: std::invalid_argument with "[BlockPool] ...". Every mutating call
// validates all of its input before changing anything, so on an exception the
// pool is exactly as it was. Not thread-safe: one owner drives it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "runtime/block_hash.h"

namespace vllm_metal::runtime {

using BlockId = int32_t;

struct BlockPoolConfig {
  int32_t num_blocks = 0;          // including the null block
  int32_t block_size = 16;         // tokens per block
  bool enable_caching = true;      // prefix cache on/off
  bool reserve_null_block = true;  // block 0 is the null block (as in vLLM)
  bool enable_events = false;      // record KvCacheEvents for take_events()
};

enum class KvEventKind : uint8_t {
  kStored = 0,      // a block entered the prefix cache
  kRemoved = 1,     // a cached block was evicted (or evict_cached() dropped it)
  kAllCleared = 2,  // reset_prefix_cache() dropped every entry
};

struct KvCacheEvent {
  KvEventKind kind = KvEventKind::kStored;
  BlockId block_id = -1;  // kStored, kRemoved
  BlockHash hash;         // kStored, kRemoved
  BlockHash parent;       // kStored with has_parent: the previous block's hash
  bool has_parent = false;
};

// Counters since construction (or reset_stats()).
struct BlockPoolStats {
  int64_t lookups = 0;        // find_cached_prefix() calls
  int64_t lookup_tokens = 0;  // their num_tokens, summed
  int64_t hit_tokens = 0;     // tokens found cached
  int64_t allocated = 0;      // blocks handed out by allocate()
  int64_t stored = 0;         // blocks entered into the prefix cache
  int64_t evicted = 0;        // cached blocks dropped by allocate() or evict_cached()
  int64_t resets = 0;         // successful reset_prefix_cache() calls
};

class BlockPool {
 public:
  explicit BlockPool(const BlockPoolConfig& config);

  const BlockPoolConfig& config() const { return config_; }
  int32_t num_blocks() const { return config_.num_blocks; }
  int32_t block_size() const { return config_.block_size; }
  BlockId null_block() const { return config_.reserve_null_block ? 0 : -1; }
  // Blocks allocate() can hand out: free ones and evictable cached ones.
  int32_t num_free_blocks() const { return num_free_; }
  int32_t num_usable_blocks() const { return config_.num_blocks - (config_.reserve_null_block ? 1 : 0); }
  int32_t num_used_blocks() const { return num_usable_blocks() - num_free_; }
  int32_t num_cached_blocks() const { return num_hashed_; }  // in use or free
  double usage() const;  // used / usable, in [0, 1]

  // ---- allocation ------------------------------------------------------------
  // Takes n blocks from the front of the free queue (evicting any cached prefix
  // they hold), each with ref count 1, written to out[0..n). Throws if n < 0 or
  // n > num_free_blocks().
  void allocate(int32_t n, BlockId* out);
  std::vector<BlockId> allocate(int32_t n);

  // Drops one reference from each block, in eviction order (the first block
  // freed is evicted first among blocks freed together). A block may appear as
  // often as it has references. Throws on an id outside the pool or a block
  // with no reference left (double free).
  void free(const BlockId* ids, size_t n);

  // Adds one reference to each block (sharing a cached prefix). A free block
  // may be touched only while it holds a cached prefix: it leaves the queue.
  void touch(const BlockId* ids, size_t n);

  // How many distinct blocks among ids are in the free queue, i.e. how many
  // free blocks touch(ids) would use up (a prefix hit's evictable blocks, which
  // an admission check must count: vLLM's get_num_blocks_to_allocate).
  int32_t count_free(const BlockId* ids, size_t n) const;

  // ---- prefix cache ----------------------------------------------------------
  // Longest run of leading hashes that are cached, at most max_blocks long:
  // writes the blocks to out (capacity >= min(n, max_blocks)) and returns the
  // count. Changes nothing; the caller touch()es the blocks it keeps.
  size_t lookup(const BlockHash* hashes, size_t n, size_t max_blocks, BlockId* out) const;

  // The cached prefix of a sequence of num_tokens tokens whose full blocks
  // hash to hashes[0..n): at most (num_tokens - 1) / block_size blocks, so the
  // last token is always left to compute. Counts a lookup in stats(). No
  // blocks when caching is disabled.
  std::vector<BlockId> find_cached_prefix(const BlockHash* hashes, size_t n, int64_t num_tokens);

  // Enters blocks ids[num_cached, num_full) of a sequence into the prefix cache
  // under hashes[num_cached, num_full) (its first num_cached blocks are cached
  // already). Each block must be in use; a block already cached under the same
  // hash is left as it is, one cached under another hash is an error. The null
  // block is skipped. No-op when caching is disabled.
  void cache_full_blocks(const BlockId* ids, size_t num_ids, const BlockHash* hashes,
                         size_t num_hashes, size_t num_cached, size_t num_full);

  // Drops the cached prefix of each given block (blocks stay allocated or free
  // where they are). Blocks without one are skipped.
  void evict_cached(const BlockId* ids, size_t n);

  // Forgets every cached prefix. Refused (returns false, nothing changes) while
  // any block is in use, as in vLLM.
  bool reset_prefix_cache();

  // Events recorded since the last call (enable_events), oldest first.
  std::vector<KvCacheEvent> take_events();

  // ---- introspection -----------------------------------------------------------
  int32_t ref_count(BlockId id) const;
  bool is_cached(BlockId id) const;
  // The block's hash; throws if the block holds no cached prefix.
  const BlockHash& block_hash(BlockId id) const;
  // The free queue, front (next to allocate) first.
  std::vector<BlockId> free_queue() const;
  const BlockPoolStats& stats() const { return stats_; }
  void reset_stats() { stats_ = BlockPoolStats{}; }
  // Checks every internal invariant (queue links and count, ref counts vs.
  // queue membership, hash table vs. block hashes); throws std::logic_error
  // naming the first one broken. O(num_blocks), for tests.
  void check_invariants() const;

 private:
  static constexpr int32_t kNotQueued = -1;

  struct CacheEntry {
    BlockId first;                // the block lookups return
    std::vector<BlockId> others;  // later blocks with the same hash, oldest first
  };

  void check_id(BlockId id, const char* what) const;
  bool is_null(BlockId id) const { return config_.reserve_null_block && id == 0; }
  void queue_remove(BlockId id);
  void queue_push_front(const BlockId* ids, size_t n);
  void queue_push_back(const BlockId* ids, size_t n);
  void uncache(BlockId id);  // drops the block's hash (evicted += 1, event)

  BlockPoolConfig config_;
  int32_t head_;  // sentinel index num_blocks: links_[head_].next is the front
  int32_t tail_;  // sentinel index num_blocks + 1
  std::vector<int32_t> prev_;     // [num_blocks + 2] queue links, kNotQueued off-queue
  std::vector<int32_t> next_;     // [num_blocks + 2]
  std::vector<int32_t> ref_;      // [num_blocks] reference counts
  std::vector<uint8_t> hashed_;   // [num_blocks] 1: block holds a cached prefix
  std::vector<BlockHash> hash_;   // [num_blocks] valid where hashed_
  std::unordered_map<BlockHash, CacheEntry, BlockHashHasher> cache_;  // hash -> blocks
  int32_t num_free_ = 0;
  int32_t num_hashed_ = 0;
  mutable std::vector<int32_t> scratch_;  // [num_blocks] zero between calls (validation)
  std::vector<BlockId> front_, back_;  // scratch for free()
  std::vector<KvCacheEvent> events_;
  BlockPoolStats stats_;
};

}  // namespace vllm_metal::runtime
