// Bindings of the KV-cache manager (src/cpp/runtime/kv_cache_manager.h). Block
// hashes arrive as the request's own list of vLLM hash digests (bytes of at
// least 16; the first 16 are the key, see kv_cache_manager.py) and only the
// entries a call needs are read, so a decode step converts none.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "bindings/bindings.h"
#include "runtime/kv_cache_manager.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace rt = vllm_metal::runtime;

namespace {

using Ids = std::vector<int32_t>;

rt::BlockHash hash_of(nb::handle item) {
  if (!nb::isinstance<nb::bytes>(item)) {
    throw nb::type_error("[KvCacheManager] block hashes must be bytes");
  }
  nb::bytes b = nb::borrow<nb::bytes>(item);
  if (b.size() < 16) {
    throw nb::value_error(("[KvCacheManager] a block hash must have at least 16 bytes, got " +
                           std::to_string(b.size()))
                              .c_str());
  }
  rt::BlockHash h;
  std::memcpy(&h.lo, b.c_str(), 8);
  std::memcpy(&h.hi, b.c_str() + 8, 8);
  return h;
}

// hashes[start, end) converted; entries below start are left zero (not read).
std::vector<rt::BlockHash> hashes_range(const nb::list& hashes, size_t start, size_t end) {
  end = std::min(end, nb::len(hashes));
  std::vector<rt::BlockHash> out(end);
  for (size_t i = start; i < end; ++i) out[i] = hash_of(hashes[i]);
  return out;
}

nb::tuple group_lists(const std::vector<Ids>& groups) {
  nb::list out;
  for (const Ids& g : groups) out.append(nb::cast(g));
  return nb::tuple(out);
}

// KvCacheManager::allocate_slots with the hashes it will cache read from the
// request's list: the blocks past those already cached (or past the adopted hit)
// up to num_tokens_to_cache. False when the slots do not fit.
bool allocate(rt::KvCacheManager& mgr, const std::string& req, int64_t num_tokens, const Ids& computed,
              int64_t num_tokens_to_cache, const nb::list& hashes, int32_t reserved, std::vector<Ids>* fresh) {
  const size_t start = computed.empty() ? mgr.num_cached_blocks(req) : computed.size();
  const size_t end = num_tokens_to_cache > 0 ? static_cast<size_t>(num_tokens_to_cache / mgr.block_size(0)) : 0;
  const auto h = mgr.enable_caching() ? hashes_range(hashes, start, end) : std::vector<rt::BlockHash>{};
  return mgr.allocate_slots(req, num_tokens, computed.data(), computed.size(), num_tokens_to_cache, h.data(),
                            h.size(), reserved, fresh);
}

}  // namespace

namespace vllm_metal::bindings {

void bind_runtime_kv_manager(nb::module_& m) {
  nb::class_<rt::KvCacheManager>(
      m, "KvCacheManager",
      "Per-request KV blocks of every group over one BlockPool, with prefix caching of\n"
      "group 0 (vLLM 0.33's KVCacheManager semantics; see kv_cache_manager.h).")
      .def(
          "__init__",
          [](rt::KvCacheManager* self, int32_t num_blocks, const std::vector<int32_t>& group_block_sizes,
             bool enable_caching, bool enable_events) {
            rt::KvCacheManagerConfig c;
            c.num_blocks = num_blocks;
            c.group_block_sizes = group_block_sizes;
            c.enable_caching = enable_caching;
            c.enable_events = enable_events;
            new (self) rt::KvCacheManager(c);
          },
          "num_blocks"_a, "group_block_sizes"_a, nb::kw_only(), "enable_caching"_a = true,
          "enable_events"_a = false)
      .def_prop_ro("pool", nb::overload_cast<>(&rt::KvCacheManager::pool), nb::rv_policy::reference_internal,
                   "The BlockPool every block comes from.")
      .def_prop_ro("num_groups", &rt::KvCacheManager::num_groups)
      .def_prop_ro("enable_caching", &rt::KvCacheManager::enable_caching)
      .def_prop_ro("num_requests", &rt::KvCacheManager::num_requests)
      .def(
          "find_cached_prefix",
          [](const rt::KvCacheManager& mgr, const nb::list& hashes, int64_t max_tokens) {
            if (!mgr.enable_caching() || max_tokens <= 0) return Ids{};
            const size_t max_blocks = static_cast<size_t>(max_tokens / mgr.block_size(0));
            const auto h = hashes_range(hashes, 0, max_blocks);
            return mgr.find_cached_prefix(h.data(), h.size(), max_tokens);
          },
          "block_hashes"_a, "max_tokens"_a,
          "Group-0 blocks of the longest cached prefix, at most max_tokens tokens long.")
      .def(
          "num_blocks_to_allocate",
          [](const rt::KvCacheManager& mgr, const std::string& req, int64_t num_tokens, const Ids& computed) {
            return mgr.num_blocks_to_allocate(req, num_tokens, computed.data(), computed.size());
          },
          "request_id"_a, "num_tokens"_a, "computed_blocks"_a = Ids{})
      .def(
          "allocate_slots",
          [](rt::KvCacheManager& mgr, const std::string& req, int64_t num_tokens, const Ids& computed,
             int64_t num_tokens_to_cache, const nb::list& hashes, int32_t reserved) -> std::optional<nb::tuple> {
            std::vector<Ids> fresh;
            if (!allocate(mgr, req, num_tokens, computed, num_tokens_to_cache, hashes, reserved, &fresh)) {
              return std::nullopt;
            }
            return group_lists(fresh);
          },
          "request_id"_a, "num_tokens"_a, "computed_blocks"_a, "num_tokens_to_cache"_a, "block_hashes"_a,
          "reserved"_a = 0,
          "Slots for num_tokens tokens (new block ids per group), or None when they do not fit\n"
          "beside `reserved` free blocks; then caches the final full blocks.")
      .def(
          "extend",
          [](rt::KvCacheManager& mgr, const std::string& req, int64_t num_tokens, int64_t num_tokens_to_cache,
             const nb::list& hashes, int32_t reserved) -> nb::object {
            // allocate_slots for a request that adopts no hit (a running one), in
            // the fewest conversions: a decode step that needs no block returns ().
            static const Ids kNoHit;
            std::vector<Ids> fresh;
            if (!allocate(mgr, req, num_tokens, kNoHit, num_tokens_to_cache, hashes, reserved, &fresh)) {
              return nb::none();
            }
            for (const Ids& g : fresh) {
              if (!g.empty()) return group_lists(fresh);
            }
            return nb::tuple();
          },
          "request_id"_a, "num_tokens"_a, "num_tokens_to_cache"_a, "block_hashes"_a, "reserved"_a = 0,
          "allocate_slots without a prefix-cache hit: None when the slots do not fit, () when\n"
          "no block was needed, else the new block ids per group.")
      .def(
          "cache_blocks",
          [](rt::KvCacheManager& mgr, const std::string& req, int64_t num_tokens, const nb::list& hashes) {
            if (!mgr.enable_caching() || num_tokens <= 0) return std::pair<size_t, size_t>{0, 0};
            const auto h = hashes_range(hashes, mgr.num_cached_blocks(req),
                                        static_cast<size_t>(num_tokens / mgr.block_size(0)));
            return mgr.cache_blocks(req, num_tokens, h.data(), h.size());
          },
          "request_id"_a, "num_tokens"_a, "block_hashes"_a,
          "Caches the full blocks of the first num_tokens tokens; returns the new range [first, end).")
      .def("num_cached_blocks", &rt::KvCacheManager::num_cached_blocks, "request_id"_a)
      .def("free", &rt::KvCacheManager::free, "request_id"_a, "Returns the request's blocks, tail first.")
      .def("has_request", &rt::KvCacheManager::has_request, "request_id"_a)
      .def(
          "block_ids",
          [](const rt::KvCacheManager& mgr, const std::string& req) {
            std::vector<Ids> out;
            for (size_t g = 0; g < mgr.num_groups(); ++g) out.push_back(mgr.blocks(req, g));
            return group_lists(out);
          },
          "request_id"_a, "The request's block ids, one list per group.");
}

}  // namespace vllm_metal::bindings
