#include "runtime/kv_cache_manager.h"

#include <algorithm>
#include <stdexcept>

namespace vllm_metal::runtime {

namespace {

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument("[KvCacheManager] " + msg); }

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

BlockPoolConfig pool_config(const KvCacheManagerConfig& c) {
  if (c.group_block_sizes.empty()) fail("at least one KV-cache group is needed");
  for (int32_t b : c.group_block_sizes) {
    if (b <= 0) fail("every group's block_size must be > 0, got " + std::to_string(b));
  }
  BlockPoolConfig p;
  p.num_blocks = c.num_blocks;
  p.block_size = c.group_block_sizes[0];
  p.enable_caching = c.enable_caching;
  p.reserve_null_block = true;
  p.enable_events = c.enable_events;
  return p;
}

}  // namespace

KvCacheManager::KvCacheManager(const KvCacheManagerConfig& config)
    : pool_(pool_config(config)), block_sizes_(config.group_block_sizes), caching_(config.enable_caching) {}

std::vector<BlockId> KvCacheManager::find_cached_prefix(const BlockHash* hashes, size_t n,
                                                        int64_t max_tokens) const {
  if (!caching_ || max_tokens <= 0) return {};
  const size_t max_blocks = static_cast<size_t>(max_tokens / block_sizes_[0]);
  std::vector<BlockId> out(std::min(n, max_blocks));
  out.resize(pool_.lookup(hashes, n, max_blocks, out.data()));
  return out;
}

const std::vector<BlockId>& KvCacheManager::blocks(const std::string& req, size_t group) const {
  auto it = reqs_.find(req);
  if (it == reqs_.end()) return empty_;
  return it->second.blocks.at(group);
}

size_t KvCacheManager::num_cached_blocks(const std::string& req) const {
  auto it = reqs_.find(req);
  return it == reqs_.end() ? 0 : it->second.num_cached;
}

int32_t KvCacheManager::num_blocks_to_allocate(const std::string& req, int64_t num_tokens, const BlockId* computed,
                                               size_t num_computed) const {
  auto it = reqs_.find(req);
  const Request* r = it == reqs_.end() ? nullptr : &it->second;
  int64_t total = 0;
  for (size_t g = 0; g < block_sizes_.size(); ++g) {
    const int64_t held = r == nullptr ? 0 : static_cast<int64_t>(r->blocks[g].size());
    const int64_t adopted = g == 0 ? static_cast<int64_t>(num_computed) : 0;
    total += std::max<int64_t>(cdiv(num_tokens, block_sizes_[g]) - held - adopted, 0);
  }
  // Hit blocks waiting in the free queue leave it when touched.
  if (num_computed > 0) total += pool_.count_free(computed, num_computed);
  return static_cast<int32_t>(total);
}

bool KvCacheManager::allocate_slots(const std::string& req, int64_t num_tokens, const BlockId* computed,
                                    size_t num_computed, int64_t num_tokens_to_cache, const BlockHash* hashes,
                                    size_t n_hashes, int32_t reserved,
                                    std::vector<std::vector<BlockId>>* new_blocks) {
  if (num_tokens < 0) fail("num_tokens must be >= 0, got " + std::to_string(num_tokens));
  auto it = reqs_.find(req);
  if (num_computed > 0) {
    if (!caching_) fail("request '" + req + "': prefix-cache blocks given while caching is off");
    if (it != reqs_.end() && !it->second.blocks[0].empty()) {
      fail("request '" + req + "' already holds blocks; a prefix-cache hit is adopted only on its first allocation");
    }
  }
  const int32_t needed = num_blocks_to_allocate(req, num_tokens, computed, num_computed);
  if (static_cast<int64_t>(needed) + reserved > pool_.num_free_blocks()) return false;

  Request& r = it != reqs_.end() ? it->second : reqs_[req];
  if (r.blocks.empty()) r.blocks.resize(block_sizes_.size());
  if (num_computed > 0) {
    pool_.touch(computed, num_computed);
    r.blocks[0].assign(computed, computed + num_computed);
    r.num_cached = num_computed;
  }
  new_blocks->assign(block_sizes_.size(), {});
  for (size_t g = 0; g < block_sizes_.size(); ++g) {
    const int64_t missing = cdiv(num_tokens, block_sizes_[g]) - static_cast<int64_t>(r.blocks[g].size());
    if (missing <= 0) continue;
    std::vector<BlockId>& out = (*new_blocks)[g];
    out.resize(static_cast<size_t>(missing));
    pool_.allocate(static_cast<int32_t>(missing), out.data());
    r.blocks[g].insert(r.blocks[g].end(), out.begin(), out.end());
  }
  cache_blocks(req, num_tokens_to_cache, hashes, n_hashes);
  return true;
}

std::pair<size_t, size_t> KvCacheManager::cache_blocks(const std::string& req, int64_t num_tokens,
                                                        const BlockHash* hashes, size_t n_hashes) {
  auto it = reqs_.find(req);
  if (!caching_ || it == reqs_.end() || num_tokens <= 0) return {0, 0};
  Request& r = it->second;
  const int64_t hashed_tokens = static_cast<int64_t>(n_hashes) * block_sizes_[0];
  const size_t num_full = std::min<size_t>(static_cast<size_t>(std::min(num_tokens, hashed_tokens) / block_sizes_[0]),
                                           r.blocks[0].size());
  if (r.num_cached >= num_full) return {r.num_cached, r.num_cached};
  const size_t first = r.num_cached;
  pool_.cache_full_blocks(r.blocks[0].data(), r.blocks[0].size(), hashes, n_hashes, first, num_full);
  r.num_cached = num_full;
  return {first, num_full};
}

void KvCacheManager::free(const std::string& req) {
  auto it = reqs_.find(req);
  if (it == reqs_.end()) return;
  for (auto& group : it->second.blocks) {
    std::reverse(group.begin(), group.end());  // tail first: evicted first
    pool_.free(group.data(), group.size());
  }
  reqs_.erase(it);
}

}  // namespace vllm_metal::runtime
