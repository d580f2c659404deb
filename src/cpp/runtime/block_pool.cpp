#include "runtime/block_pool.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

namespace vllm_metal::runtime {

namespace {

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument("[BlockPool] " + msg); }

[[noreturn]] void broken(const std::string& msg) {
  throw std::logic_error("[BlockPool] invariant broken: " + msg);
}

std::string id_str(BlockId id) { return std::to_string(id); }

}  // namespace

BlockPool::BlockPool(const BlockPoolConfig& config) : config_(config) {
  if (config.num_blocks <= 0 || config.num_blocks > std::numeric_limits<int32_t>::max() - 2) {
    fail("num_blocks must be in [1, 2^31 - 3], got " + std::to_string(config.num_blocks));
  }
  if (config.block_size <= 0) {
    fail("block_size must be > 0, got " + std::to_string(config.block_size));
  }
  const auto n = static_cast<size_t>(config.num_blocks);
  head_ = config.num_blocks;
  tail_ = config.num_blocks + 1;
  prev_.assign(n + 2, kNotQueued);
  next_.assign(n + 2, kNotQueued);
  ref_.assign(n, 0);
  hashed_.assign(n, 0);
  hash_.resize(n);
  scratch_.assign(n, 0);
  cache_.reserve(n);
  // Every block but the null block starts free, in id order.
  prev_[head_] = kNotQueued;
  next_[head_] = tail_;
  prev_[tail_] = head_;
  next_[tail_] = kNotQueued;
  std::vector<BlockId> all;
  all.reserve(n);
  for (BlockId id = config.reserve_null_block ? 1 : 0; id < config.num_blocks; ++id) all.push_back(id);
  queue_push_back(all.data(), all.size());
}

double BlockPool::usage() const {
  const int32_t usable = num_usable_blocks();
  return usable > 0 ? 1.0 - static_cast<double>(num_free_) / usable : 0.0;
}

void BlockPool::check_id(BlockId id, const char* what) const {
  if (id < 0 || id >= config_.num_blocks) {
    fail(std::string(what) + ": block id " + id_str(id) + " is outside the pool (ids 0.." +
         std::to_string(config_.num_blocks - 1) + ")");
  }
}

// ---- free queue ------------------------------------------------------------------

void BlockPool::queue_remove(BlockId id) {
  const int32_t p = prev_[id];
  const int32_t nx = next_[id];
  next_[p] = nx;
  prev_[nx] = p;
  prev_[id] = next_[id] = kNotQueued;
  --num_free_;
}

void BlockPool::queue_push_front(const BlockId* ids, size_t n) {
  if (n == 0) return;
  const int32_t old_first = next_[head_];
  int32_t p = head_;
  for (size_t i = 0; i < n; ++i) {
    prev_[ids[i]] = p;
    next_[p] = ids[i];
    p = ids[i];
  }
  next_[p] = old_first;
  prev_[old_first] = p;
  num_free_ += static_cast<int32_t>(n);
}

void BlockPool::queue_push_back(const BlockId* ids, size_t n) {
  if (n == 0) return;
  int32_t p = prev_[tail_];
  for (size_t i = 0; i < n; ++i) {
    prev_[ids[i]] = p;
    next_[p] = ids[i];
    p = ids[i];
  }
  next_[p] = tail_;
  prev_[tail_] = p;
  num_free_ += static_cast<int32_t>(n);
}

// ---- allocation ------------------------------------------------------------------

void BlockPool::allocate(int32_t n, BlockId* out) {
  if (n < 0) fail("allocate: block count must be >= 0, got " + std::to_string(n));
  if (n > num_free_) {
    fail("allocate: cannot allocate " + std::to_string(n) + " blocks, " + std::to_string(num_free_) +
         " free (of " + std::to_string(num_usable_blocks()) + " usable)");
  }
  for (int32_t k = 0; k < n; ++k) {
    const BlockId id = next_[head_];
    queue_remove(id);
    if (hashed_[id]) uncache(id);
    ref_[id] = 1;
    out[k] = id;
  }
  stats_.allocated += n;
}

std::vector<BlockId> BlockPool::allocate(int32_t n) {
  if (n < 0) fail("allocate: block count must be >= 0, got " + std::to_string(n));
  std::vector<BlockId> out(static_cast<size_t>(n));
  allocate(n, out.data());
  return out;
}

void BlockPool::free(const BlockId* ids, size_t n) {
  // Validate: every id in range, no block freed more often than it is referenced.
  // scratch_ counts this call's frees per block and is zeroed again before return.
  size_t i = 0;
  std::string error;
  for (; i < n; ++i) {
    const BlockId id = ids[i];
    if (id < 0 || id >= config_.num_blocks) {
      error = "free: block id " + id_str(id) + " is outside the pool (ids 0.." +
              std::to_string(config_.num_blocks - 1) + ")";
      break;
    }
    if (is_null(id)) continue;
    if (++scratch_[id] > ref_[id]) {
      error = ref_[id] == 0
                  ? "free: block " + id_str(id) + " is already free (double free)"
                  : "free: block " + id_str(id) + " freed " + std::to_string(scratch_[id]) +
                        " times but has " + std::to_string(ref_[id]) + " reference(s) (double free)";
      ++i;
      break;
    }
  }
  for (size_t j = 0; j < i; ++j) {
    if (ids[j] >= 0 && ids[j] < config_.num_blocks) scratch_[ids[j]] = 0;
  }
  if (!error.empty()) fail(error);

  front_.clear();
  back_.clear();
  for (size_t k = 0; k < n; ++k) {
    const BlockId id = ids[k];
    if (is_null(id)) continue;
    if (--ref_[id] == 0) {
      // Blocks with nothing cached are reused first; cached ones wait at the back.
      (hashed_[id] ? back_ : front_).push_back(id);
    }
  }
  queue_push_front(front_.data(), front_.size());
  queue_push_back(back_.data(), back_.size());
}

void BlockPool::touch(const BlockId* ids, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const BlockId id = ids[i];
    check_id(id, "touch");
    if (!is_null(id) && ref_[id] == 0 && !hashed_[id]) {
      fail("touch: block " + id_str(id) +
           " is free and holds no cached prefix (only cached blocks can be shared from the free queue)");
    }
  }
  for (size_t i = 0; i < n; ++i) {
    const BlockId id = ids[i];
    if (is_null(id)) continue;
    if (ref_[id] == 0) queue_remove(id);
    ++ref_[id];
  }
}

int32_t BlockPool::count_free(const BlockId* ids, size_t n) const {
  for (size_t i = 0; i < n; ++i) check_id(ids[i], "count_free");
  int32_t count = 0;
  for (size_t i = 0; i < n; ++i) {
    const BlockId id = ids[i];
    if (is_null(id) || ref_[id] != 0 || scratch_[id] != 0) continue;
    scratch_[id] = 1;
    ++count;
  }
  for (size_t i = 0; i < n; ++i) scratch_[ids[i]] = 0;
  return count;
}

// ---- prefix cache ----------------------------------------------------------------

size_t BlockPool::lookup(const BlockHash* hashes, size_t n, size_t max_blocks, BlockId* out) const {
  const size_t limit = n < max_blocks ? n : max_blocks;
  size_t k = 0;
  for (; k < limit; ++k) {
    const auto it = cache_.find(hashes[k]);
    if (it == cache_.end()) break;  // chained hashes: every later block misses too
    out[k] = it->second.first;
  }
  return k;
}

std::vector<BlockId> BlockPool::find_cached_prefix(const BlockHash* hashes, size_t n,
                                                   int64_t num_tokens) {
  if (num_tokens < 0) {
    fail("find_cached_prefix: num_tokens must be >= 0, got " + std::to_string(num_tokens));
  }
  std::vector<BlockId> out;
  if (!config_.enable_caching) return out;
  const size_t max_blocks = num_tokens > 0 ? static_cast<size_t>((num_tokens - 1) / config_.block_size) : 0;
  out.resize(n < max_blocks ? n : max_blocks);
  out.resize(lookup(hashes, n, max_blocks, out.data()));
  stats_.lookups += 1;
  stats_.lookup_tokens += num_tokens;
  stats_.hit_tokens += static_cast<int64_t>(out.size()) * config_.block_size;
  return out;
}

void BlockPool::cache_full_blocks(const BlockId* ids, size_t num_ids, const BlockHash* hashes,
                                  size_t num_hashes, size_t num_cached, size_t num_full) {
  if (num_cached > num_full) {
    fail("cache_full_blocks: num_cached (" + std::to_string(num_cached) +
         ") must be <= num_full (" + std::to_string(num_full) + ")");
  }
  if (num_full > num_ids || num_full > num_hashes) {
    fail("cache_full_blocks: num_full = " + std::to_string(num_full) + " needs that many block ids and hashes, got " +
         std::to_string(num_ids) + " ids and " + std::to_string(num_hashes) + " hashes");
  }
  // Validate; scratch_ remembers (index + 1) of each block's first appearance.
  size_t i = num_cached;
  std::string error;
  for (; i < num_full; ++i) {
    const BlockId id = ids[i];
    if (id < 0 || id >= config_.num_blocks) {
      error = "cache_full_blocks: block id " + id_str(id) + " is outside the pool (ids 0.." +
              std::to_string(config_.num_blocks - 1) + ")";
      break;
    }
    if (is_null(id)) continue;
    if (ref_[id] == 0) {
      error = "cache_full_blocks: block " + id_str(id) + " is free (only blocks in use can be cached)";
      break;
    }
    if (hashed_[id] && hash_[id] != hashes[i]) {
      error = "cache_full_blocks: block " + id_str(id) + " is already cached under another hash";
      break;
    }
    if (scratch_[id] != 0 && hashes[scratch_[id] - 1] != hashes[i]) {
      error = "cache_full_blocks: block " + id_str(id) + " appears at positions " +
              std::to_string(scratch_[id] - 1) + " and " + std::to_string(i) + " with different hashes";
      break;
    }
    if (scratch_[id] == 0) scratch_[id] = static_cast<int32_t>(i + 1);
  }
  for (size_t j = num_cached; j < i; ++j) {
    if (ids[j] >= 0 && ids[j] < config_.num_blocks) scratch_[ids[j]] = 0;
  }
  if (!error.empty()) fail(error);
  if (!config_.enable_caching) return;

  for (size_t k = num_cached; k < num_full; ++k) {
    const BlockId id = ids[k];
    if (is_null(id) || hashed_[id]) continue;
    hashed_[id] = 1;
    hash_[id] = hashes[k];
    ++num_hashed_;
    auto [it, inserted] = cache_.try_emplace(hashes[k], CacheEntry{id, {}});
    if (!inserted) it->second.others.push_back(id);
    ++stats_.stored;
    if (config_.enable_events) {
      KvCacheEvent e;
      e.kind = KvEventKind::kStored;
      e.block_id = id;
      e.hash = hashes[k];
      if (k > 0) {
        e.parent = hashes[k - 1];
        e.has_parent = true;
      }
      events_.push_back(e);
    }
  }
}

void BlockPool::uncache(BlockId id) {
  const auto it = cache_.find(hash_[id]);
  CacheEntry& entry = it->second;
  if (entry.first == id) {
    if (entry.others.empty()) {
      cache_.erase(it);
    } else {
      entry.first = entry.others.front();
      entry.others.erase(entry.others.begin());
    }
  } else {
    for (auto o = entry.others.begin(); o != entry.others.end(); ++o) {
      if (*o == id) {
        entry.others.erase(o);
        break;
      }
    }
  }
  hashed_[id] = 0;
  --num_hashed_;
  ++stats_.evicted;
  if (config_.enable_events) {
    KvCacheEvent e;
    e.kind = KvEventKind::kRemoved;
    e.block_id = id;
    e.hash = hash_[id];
    events_.push_back(e);
  }
}

void BlockPool::evict_cached(const BlockId* ids, size_t n) {
  for (size_t i = 0; i < n; ++i) check_id(ids[i], "evict_cached");
  for (size_t i = 0; i < n; ++i) {
    if (hashed_[ids[i]]) uncache(ids[i]);
  }
}

bool BlockPool::reset_prefix_cache() {
  if (num_used_blocks() > 0) return false;
  cache_.clear();
  std::fill(hashed_.begin(), hashed_.end(), 0);
  num_hashed_ = 0;
  ++stats_.resets;
  if (config_.enable_events) {
    KvCacheEvent e;
    e.kind = KvEventKind::kAllCleared;
    events_.push_back(e);
  }
  return true;
}

std::vector<KvCacheEvent> BlockPool::take_events() {
  std::vector<KvCacheEvent> out;
  out.swap(events_);
  return out;
}

// ---- introspection -----------------------------------------------------------------

int32_t BlockPool::ref_count(BlockId id) const {
  check_id(id, "ref_count");
  return ref_[id];
}

bool BlockPool::is_cached(BlockId id) const {
  check_id(id, "is_cached");
  return hashed_[id] != 0;
}

const BlockHash& BlockPool::block_hash(BlockId id) const {
  check_id(id, "block_hash");
  if (!hashed_[id]) fail("block_hash: block " + id_str(id) + " holds no cached prefix");
  return hash_[id];
}

std::vector<BlockId> BlockPool::free_queue() const {
  std::vector<BlockId> out;
  out.reserve(static_cast<size_t>(num_free_));
  for (int32_t id = next_[head_]; id != tail_; id = next_[id]) out.push_back(id);
  return out;
}

void BlockPool::check_invariants() const {
  const int32_t n = config_.num_blocks;
  // The queue: a well-linked chain of num_free_ distinct non-null blocks, each unreferenced.
  std::vector<uint8_t> queued(static_cast<size_t>(n), 0);
  int32_t count = 0;
  int32_t p = head_;
  for (int32_t id = next_[head_]; id != tail_; p = id, id = next_[id]) {
    if (id < 0 || id >= n) broken("queue holds " + id_str(id));
    if (prev_[id] != p) broken("queue link prev[" + id_str(id) + "]");
    if (queued[id]) broken("block " + id_str(id) + " queued twice");
    queued[id] = 1;
    if (++count > n) broken("queue longer than the pool");
  }
  if (prev_[tail_] != p) broken("queue tail link");
  if (count != num_free_) broken("num_free " + std::to_string(num_free_) + " != queue length " + std::to_string(count));
  int32_t hashed = 0;
  for (BlockId id = 0; id < n; ++id) {
    if (ref_[id] < 0) broken("block " + id_str(id) + " has ref count " + std::to_string(ref_[id]));
    if (is_null(id)) {
      if (queued[id] || hashed_[id] || ref_[id] != 0) broken("the null block is queued, cached or referenced");
      continue;
    }
    if ((ref_[id] == 0) != (queued[id] != 0)) {
      broken("block " + id_str(id) + " has ref count " + std::to_string(ref_[id]) +
             (queued[id] ? " but is queued" : " but is not queued"));
    }
    if (!queued[id] && (prev_[id] != kNotQueued || next_[id] != kNotQueued)) {
      broken("block " + id_str(id) + " is off the queue but keeps links");
    }
    if (scratch_[id] != 0) broken("scratch not cleared");
    if (hashed_[id]) {
      ++hashed;
      const auto it = cache_.find(hash_[id]);
      if (it == cache_.end()) broken("cached block " + id_str(id) + " missing from the hash table");
      bool found = it->second.first == id;
      for (BlockId o : it->second.others) found = found || o == id;
      if (!found) broken("cached block " + id_str(id) + " missing from its hash entry");
    }
  }
  if (hashed != num_hashed_) broken("num_cached " + std::to_string(num_hashed_) + " != " + std::to_string(hashed));
  int32_t entries = 0;
  for (const auto& kv : cache_) {
    entries += 1 + static_cast<int32_t>(kv.second.others.size());
    auto check = [&](BlockId id) {
      if (id < 0 || id >= n || !hashed_[id] || hash_[id] != kv.first) broken("hash table entry for block " + id_str(id));
    };
    check(kv.second.first);
    for (BlockId o : kv.second.others) check(o);
  }
  if (entries != num_hashed_) broken("hash table holds " + std::to_string(entries) + " blocks, expected " + std::to_string(num_hashed_));
  if (!config_.enable_caching && num_hashed_ != 0) broken("blocks cached with caching disabled");
}

}  // namespace vllm_metal::runtime
