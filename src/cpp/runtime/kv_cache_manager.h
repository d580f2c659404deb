// KvCacheManager: which blocks of one BlockPool each request holds, per KV-cache
// group, and the prefix-cache bookkeeping around them (plain C++17, no MLX, no
// Python). This is what vLLM 0.33's KVCacheManager + coordinator + single-type
// managers do for the groups this project serves, in one call per scheduler
// decision instead of a Python walk over block objects:
//
//   - Group 0 is paged attention (full attention; sliding-window layers keep
//     every block, as their spec is full attention). It alone is prefix-cached.
//   - Further groups hold a fixed number of tokens per block (a hybrid model's
//     linear-attention groups use block_size = max_model_len: one block per
//     request) and are never cached: a hit adopts group 0's blocks and takes
//     fresh blocks in the others. (A hybrid model's recurrent state at a hit's
//     end lives outside the pool: python/vllm_metal/state_checkpoints.py.)
//
// A request needs cdiv(num_tokens, block_size) blocks in each group. On its
// first allocation it may adopt a prefix-cache hit (group 0 blocks found by
// find_cached_prefix), whose blocks are touched; later allocations only append.
// Full blocks are entered into the cache as their tokens become final (vLLM's
// "num_tokens_to_cache", which excludes unverified drafts). free() returns every
// block, each group tail first, so a chain is evicted from its end.
//
// Errors: std::invalid_argument with "[KvCacheManager] ...", before any change.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "runtime/block_pool.h"

namespace vllm_metal::runtime {

struct KvCacheManagerConfig {
  int32_t num_blocks = 0;                  // pool size, the null block included
  std::vector<int32_t> group_block_sizes;  // tokens per block of each group; [0] is cached
  bool enable_caching = true;
  bool enable_events = false;
};

class KvCacheManager {
 public:
  explicit KvCacheManager(const KvCacheManagerConfig& config);

  BlockPool& pool() { return pool_; }
  const BlockPool& pool() const { return pool_; }
  size_t num_groups() const { return block_sizes_.size(); }
  int32_t block_size(size_t group) const { return block_sizes_.at(group); }
  bool enable_caching() const { return caching_; }

  // The longest run of leading hashes cached in group 0, capped at
  // max_tokens / block_size blocks. Changes nothing (vLLM's
  // find_longest_cache_hit). Empty when caching is off.
  std::vector<BlockId> find_cached_prefix(const BlockHash* hashes, size_t n, int64_t max_tokens) const;

  // Blocks allocate_slots would take from the pool for this request to hold
  // num_tokens tokens, adopting `computed` (a hit for a request with no blocks
  // yet): new blocks, plus hit blocks that are free now (touching them uses
  // them up). vLLM's get_num_blocks_to_allocate summed over groups.
  int32_t num_blocks_to_allocate(const std::string& req, int64_t num_tokens, const BlockId* computed,
                                 size_t num_computed) const;

  // Gives the request slots for num_tokens tokens in every group, if
  // num_blocks_to_allocate + reserved fits in the free blocks; returns false and
  // changes nothing otherwise. Adopts `computed` on a first allocation (error
  // for a request that already holds blocks). Then caches group 0's full blocks
  // of the first num_tokens_to_cache tokens (hashes[i] is the hash of block i;
  // blocks beyond n_hashes are not cached yet). new_blocks[g] receives the
  // group's newly allocated ids.
  bool allocate_slots(const std::string& req, int64_t num_tokens, const BlockId* computed, size_t num_computed,
                      int64_t num_tokens_to_cache, const BlockHash* hashes, size_t n_hashes, int32_t reserved,
                      std::vector<std::vector<BlockId>>* new_blocks);

  // Group 0's full blocks of the first num_tokens tokens enter the prefix
  // cache. Returns the index range [first, end) of blocks newly cached (for
  // events). No-op with caching off.
  std::pair<size_t, size_t> cache_blocks(const std::string& req, int64_t num_tokens, const BlockHash* hashes,
                                         size_t n_hashes);
  // The index of the first not-yet-cached block of group 0 (hashes below it are
  // not needed again).
  size_t num_cached_blocks(const std::string& req) const;

  // Returns every block of the request to the pool (tail first per group) and
  // forgets it. Unknown requests are ignored (aborted before allocation).
  void free(const std::string& req);

  bool has_request(const std::string& req) const { return reqs_.count(req) != 0; }
  // The request's blocks of one group (empty for an unknown request).
  const std::vector<BlockId>& blocks(const std::string& req, size_t group) const;
  size_t num_requests() const { return reqs_.size(); }

 private:
  struct Request {
    std::vector<std::vector<BlockId>> blocks;  // per group
    size_t num_cached = 0;                     // group 0 blocks already in the prefix cache
  };

  BlockPool pool_;
  std::vector<int32_t> block_sizes_;
  bool caching_;
  std::unordered_map<std::string, Request> reqs_;
  std::vector<BlockId> empty_;
};

}  // namespace vllm_metal::runtime
