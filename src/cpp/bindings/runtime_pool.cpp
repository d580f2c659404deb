// Bindings of the block pool, block hash chains and KV pool geometry
// (src/cpp/runtime/block_pool.h, block_hash.h, kv_geometry.h). Thin: each call
// forwards to the C++ method; block ids cross as lists of int, block hashes as
// 16 bytes (little-endian lo, hi), and a chain's hashes stay in C++.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <optional>
#include <utility>

#include "bindings/bindings.h"
#include "runtime/block_hash.h"
#include "runtime/block_pool.h"
#include "runtime/kv_geometry.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace rt = vllm_metal::runtime;

namespace {

using Ids = std::vector<int32_t>;
using Tokens1D = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using IdsND = nb::ndarray<const int32_t, nb::c_contig, nb::device::cpu>;

nb::bytes hash_bytes(const rt::BlockHash& h) {
  char buf[16];
  std::memcpy(buf, &h.lo, 8);
  std::memcpy(buf + 8, &h.hi, 8);
  return nb::bytes(buf, sizeof(buf));
}

const char* event_kind_name(rt::KvEventKind k) {
  switch (k) {
    case rt::KvEventKind::kStored: return "stored";
    case rt::KvEventKind::kRemoved: return "removed";
    default: return "all_cleared";
  }
}

void bind_hash_chain(nb::module_& m) {
  nb::class_<rt::BlockHashChain>(
      m, "BlockHashChain",
      "Chained 128-bit hashes of a token sequence's full blocks (vLLM's Request.block_hashes).\n"
      "seed=None uses the process's random seed; request_key separates equal prompts\n"
      "whose KV differs (LoRA adapter, cache salt).")
      .def(
          "__init__",
          [](rt::BlockHashChain* self, int32_t block_size, std::optional<uint64_t> seed,
             uint64_t request_key) {
            new (self) rt::BlockHashChain(block_size, seed ? *seed : rt::default_block_hash_seed(),
                                          request_key);
          },
          "block_size"_a, nb::kw_only(), "seed"_a = nb::none(), "request_key"_a = 0)
      .def("add_extra_key", &rt::BlockHashChain::add_extra_key, "offset"_a, "length"_a, "key"_a,
           "Extra key over tokens [offset, offset + length) (e.g. a multimodal item's hash),\n"
           "declared before its blocks fill, in offset order.")
      .def(
          "append",
          [](rt::BlockHashChain& c, Tokens1D tokens) { return c.append(tokens.data(), tokens.size()); },
          "tokens"_a, "Appends tokens (int32 array); returns the number of new full-block hashes.")
      .def(
          "append", [](rt::BlockHashChain& c, int32_t token) { return c.append(&token, 1); }, "token"_a,
          "Appends one token; returns the number of new full-block hashes (0 or 1).")
      .def(
          "append", [](rt::BlockHashChain& c, const Ids& tokens) { return c.append(tokens.data(), tokens.size()); },
          "tokens"_a, "Appends tokens (a list of int); returns the number of new full-block hashes.")
      .def_prop_ro("block_size", &rt::BlockHashChain::block_size)
      .def_prop_ro("seed", &rt::BlockHashChain::seed)
      .def_prop_ro("request_key", &rt::BlockHashChain::request_key)
      .def_prop_ro("num_tokens", &rt::BlockHashChain::num_tokens)
      .def_prop_ro("num_blocks", &rt::BlockHashChain::num_blocks)
      .def("__len__", &rt::BlockHashChain::num_blocks)
      .def_prop_ro("root", [](const rt::BlockHashChain& c) { return hash_bytes(c.root()); })
      .def_prop_ro(
          "hashes",
          [](const rt::BlockHashChain& c) {
            nb::list out;
            for (const rt::BlockHash& h : c.hashes()) out.append(hash_bytes(h));
            return out;
          },
          "The full blocks' hashes, 16 bytes each.");
}

void bind_block_pool(nb::module_& m) {
  nb::class_<rt::KvCacheEvent>(m, "KvCacheEvent", "A prefix-cache event (BlockPool.take_events).")
      .def_prop_ro("kind", [](const rt::KvCacheEvent& e) { return event_kind_name(e.kind); },
                   "'stored', 'removed' or 'all_cleared'.")
      .def_ro("block_id", &rt::KvCacheEvent::block_id)
      .def_prop_ro("hash", [](const rt::KvCacheEvent& e) -> nb::object {
        if (e.kind == rt::KvEventKind::kAllCleared) return nb::none();
        return hash_bytes(e.hash);
      })
      .def_prop_ro("parent", [](const rt::KvCacheEvent& e) -> nb::object {
        if (!e.has_parent) return nb::none();
        return hash_bytes(e.parent);
      });

  nb::class_<rt::BlockPoolStats>(m, "BlockPoolStats", "BlockPool counters.")
      .def_ro("lookups", &rt::BlockPoolStats::lookups)
      .def_ro("lookup_tokens", &rt::BlockPoolStats::lookup_tokens)
      .def_ro("hit_tokens", &rt::BlockPoolStats::hit_tokens)
      .def_ro("allocated", &rt::BlockPoolStats::allocated)
      .def_ro("stored", &rt::BlockPoolStats::stored)
      .def_ro("evicted", &rt::BlockPoolStats::evicted)
      .def_ro("resets", &rt::BlockPoolStats::resets);

  nb::class_<rt::BlockPool>(
      m, "BlockPool",
      "Fixed set of KV-cache blocks with ref counts and a prefix cache of full blocks,\n"
      "behaving like vLLM 0.33's BlockPool for one KV-cache group (see block_pool.h).")
      .def(
          "__init__",
          [](rt::BlockPool* self, int32_t num_blocks, int32_t block_size, bool enable_caching,
             bool reserve_null_block, bool enable_events) {
            rt::BlockPoolConfig c;
            c.num_blocks = num_blocks;
            c.block_size = block_size;
            c.enable_caching = enable_caching;
            c.reserve_null_block = reserve_null_block;
            c.enable_events = enable_events;
            new (self) rt::BlockPool(c);
          },
          "num_blocks"_a, "block_size"_a, nb::kw_only(), "enable_caching"_a = true,
          "reserve_null_block"_a = true, "enable_events"_a = false)
      .def_prop_ro("num_blocks", &rt::BlockPool::num_blocks)
      .def_prop_ro("block_size", &rt::BlockPool::block_size)
      .def_prop_ro("enable_caching", [](const rt::BlockPool& p) { return p.config().enable_caching; })
      .def_prop_ro("null_block", [](const rt::BlockPool& p) -> std::optional<int32_t> {
        if (p.null_block() < 0) return std::nullopt;
        return p.null_block();
      })
      .def_prop_ro("num_free_blocks", &rt::BlockPool::num_free_blocks)
      .def_prop_ro("num_usable_blocks", &rt::BlockPool::num_usable_blocks)
      .def_prop_ro("num_used_blocks", &rt::BlockPool::num_used_blocks)
      .def_prop_ro("num_cached_blocks", &rt::BlockPool::num_cached_blocks)
      .def_prop_ro("usage", &rt::BlockPool::usage)
      .def("allocate", nb::overload_cast<int32_t>(&rt::BlockPool::allocate), "n"_a,
           "n blocks from the front of the free queue (evicting cached prefixes they hold).")
      .def(
          "free", [](rt::BlockPool& p, const Ids& ids) { p.free(ids.data(), ids.size()); }, "block_ids"_a,
          "Drops one reference per id, in eviction order (free a sequence tail first).")
      .def(
          "touch", [](rt::BlockPool& p, const Ids& ids) { p.touch(ids.data(), ids.size()); }, "block_ids"_a,
          "Adds one reference per id (sharing cached blocks).")
      .def(
          "count_free", [](const rt::BlockPool& p, const Ids& ids) { return p.count_free(ids.data(), ids.size()); },
          "block_ids"_a, "How many distinct blocks among block_ids are free (touch would use them up).")
      .def(
          "lookup",
          [](const rt::BlockPool& p, const rt::BlockHashChain& chain, std::optional<size_t> max_blocks) {
            Ids out(chain.num_blocks());
            out.resize(p.lookup(chain.data(), chain.num_blocks(), max_blocks ? *max_blocks : chain.num_blocks(),
                                out.data()));
            return out;
          },
          "chain"_a, "max_blocks"_a = nb::none(), "Blocks of the longest cached prefix of chain's hashes.")
      .def(
          "find_cached_prefix",
          [](rt::BlockPool& p, const rt::BlockHashChain& chain, std::optional<int64_t> num_tokens) {
            return p.find_cached_prefix(chain.data(), chain.num_blocks(),
                                        num_tokens ? *num_tokens : chain.num_tokens());
          },
          "chain"_a, "num_tokens"_a = nb::none(),
          "Cached prefix of a sequence of num_tokens (default chain.num_tokens) tokens,\n"
          "leaving at least its last token to compute; counted in stats.")
      .def(
          "cache_full_blocks",
          [](rt::BlockPool& p, const Ids& ids, const rt::BlockHashChain& chain, size_t num_cached,
             size_t num_full) {
            p.cache_full_blocks(ids.data(), ids.size(), chain.data(), chain.num_blocks(), num_cached, num_full);
          },
          "block_ids"_a, "chain"_a, "num_cached_blocks"_a, "num_full_blocks"_a,
          "Caches block_ids[num_cached:num_full] under chain.hashes[num_cached:num_full].")
      .def(
          "evict_cached", [](rt::BlockPool& p, const Ids& ids) { p.evict_cached(ids.data(), ids.size()); },
          "block_ids"_a, "Drops the cached prefix of each block.")
      .def("reset_prefix_cache", &rt::BlockPool::reset_prefix_cache,
           "Forgets every cached prefix; False (and no change) while blocks are in use.")
      .def("take_events", &rt::BlockPool::take_events)
      .def("ref_count", &rt::BlockPool::ref_count, "block_id"_a)
      .def("is_cached", &rt::BlockPool::is_cached, "block_id"_a)
      .def(
          "block_hash", [](const rt::BlockPool& p, int32_t id) { return hash_bytes(p.block_hash(id)); },
          "block_id"_a)
      .def("free_queue", &rt::BlockPool::free_queue, "Free blocks in eviction order, next to allocate first.")
      .def_prop_ro("stats", &rt::BlockPool::stats)
      .def("reset_stats", &rt::BlockPool::reset_stats)
      .def("check_invariants", &rt::BlockPool::check_invariants,
           "Checks every internal invariant; raises RuntimeError naming a broken one.");
}

std::vector<int64_t> shape_of(const std::array<int64_t, 4>& a) { return {a.begin(), a.end()}; }

void bind_geometry(nb::module_& m) {
  nb::class_<rt::KvLayerSpec>(m, "KvLayerSpec", "One layer's KV needs (kv_geometry.h).")
      .def_static(
          "full_attention",
          [](int64_t num_kv_heads, int64_t head_dim, const std::string& dtype) {
            rt::KvLayerSpec l;
            l.kind = rt::KvLayerKind::kFullAttention;
            l.num_kv_heads = num_kv_heads;
            l.head_dim = head_dim;
            l.dtype = rt::parse_kv_dtype(dtype);
            return l;
          },
          "num_kv_heads"_a, "head_dim"_a, "dtype"_a = "float16")
      .def_static(
          "sliding_window_attention",
          [](int64_t num_kv_heads, int64_t head_dim, int64_t sliding_window, const std::string& dtype) {
            rt::KvLayerSpec l;
            l.kind = rt::KvLayerKind::kSlidingWindow;
            l.num_kv_heads = num_kv_heads;
            l.head_dim = head_dim;
            l.sliding_window = sliding_window;
            l.dtype = rt::parse_kv_dtype(dtype);
            return l;
          },
          "num_kv_heads"_a, "head_dim"_a, "sliding_window"_a, "dtype"_a = "float16")
      .def_static(
          "linear_attention",
          [](const std::vector<std::pair<std::vector<int64_t>, std::string>>& states) {
            rt::KvLayerSpec l;
            l.kind = rt::KvLayerKind::kLinearAttention;
            for (const auto& [shape, dtype] : states) l.states.push_back({shape, rt::parse_kv_dtype(dtype)});
            return l;
          },
          "states"_a, "Per-sequence state tensors as (shape, dtype) pairs.")
      .def_prop_ro("kind", [](const rt::KvLayerSpec& l) { return rt::kv_layer_kind_name(l.kind); })
      .def_ro("num_kv_heads", &rt::KvLayerSpec::num_kv_heads)
      .def_ro("head_dim", &rt::KvLayerSpec::head_dim)
      .def_prop_ro("dtype", [](const rt::KvLayerSpec& l) { return rt::kv_dtype_name(l.dtype); })
      .def_ro("sliding_window", &rt::KvLayerSpec::sliding_window);

  nb::class_<rt::KvLayerGeometry>(m, "KvLayerGeometry", "One layer's cache shapes.")
      .def_prop_ro("kind", [](const rt::KvLayerGeometry& l) { return rt::kv_layer_kind_name(l.kind); })
      .def_prop_ro("dtype", [](const rt::KvLayerGeometry& l) { return rt::kv_dtype_name(l.dtype); })
      .def_ro("sliding_window", &rt::KvLayerGeometry::sliding_window)
      .def_prop_ro("cache_shape", [](const rt::KvLayerGeometry& l) { return shape_of(l.cache_shape); },
                   "K and V each: [num_blocks, block_size, num_kv_heads, head_dim].")
      .def_prop_ro("kernel_cache_shape",
                   [](const rt::KvLayerGeometry& l) { return shape_of(l.kernel_cache_shape); },
                   "The same memory in kernel blocks: [num_kernel_blocks, kernel_block_size, heads, dim].")
      .def_ro("bytes_per_block", &rt::KvLayerGeometry::bytes_per_block)
      .def_ro("state_shapes", &rt::KvLayerGeometry::state_shapes)
      .def_prop_ro("state_dtypes",
                   [](const rt::KvLayerGeometry& l) {
                     std::vector<std::string> out;
                     for (rt::KvDtype d : l.state_dtypes) out.emplace_back(rt::kv_dtype_name(d));
                     return out;
                   })
      .def_ro("bytes", &rt::KvLayerGeometry::bytes);

  nb::class_<rt::KvPoolGeometry>(m, "KvPoolGeometry", "Block count and per-layer shapes of a KV pool.")
      .def_ro("num_blocks", &rt::KvPoolGeometry::num_blocks)
      .def_ro("block_size", &rt::KvPoolGeometry::block_size)
      .def_ro("kernel_block_size", &rt::KvPoolGeometry::kernel_block_size)
      .def_ro("kernel_blocks_per_block", &rt::KvPoolGeometry::kernel_blocks_per_block)
      .def_ro("num_kernel_blocks", &rt::KvPoolGeometry::num_kernel_blocks)
      .def_ro("bytes_per_block", &rt::KvPoolGeometry::bytes_per_block)
      .def_ro("kv_bytes", &rt::KvPoolGeometry::kv_bytes)
      .def_ro("state_bytes", &rt::KvPoolGeometry::state_bytes)
      .def_ro("total_bytes", &rt::KvPoolGeometry::total_bytes)
      .def_ro("max_num_seqs", &rt::KvPoolGeometry::max_num_seqs)
      .def_ro("state_copies", &rt::KvPoolGeometry::state_copies)
      .def_ro("num_attention_layers", &rt::KvPoolGeometry::num_attention_layers)
      .def_ro("num_linear_layers", &rt::KvPoolGeometry::num_linear_layers)
      .def_ro("max_tokens", &rt::KvPoolGeometry::max_tokens)
      .def_ro("layers", &rt::KvPoolGeometry::layers)
      .def_prop_ro("description", &rt::describe_kv_pool, "One line for the startup summary.");

  auto config = [](const std::vector<rt::KvLayerSpec>& layers, int64_t block_size, int64_t kernel_block_size,
                   int64_t memory_budget_bytes, int64_t num_blocks, int64_t max_num_seqs, int64_t state_copies,
                   int64_t max_model_len, bool reserve_null_block) {
    rt::KvPoolConfig c;
    c.layers = layers;
    c.block_size = block_size;
    c.kernel_block_size = kernel_block_size;
    c.memory_budget_bytes = memory_budget_bytes;
    c.num_blocks = num_blocks;
    c.max_num_seqs = max_num_seqs;
    c.state_copies = state_copies;
    c.max_model_len = max_model_len;
    c.reserve_null_block = reserve_null_block;
    return c;
  };
  m.def(
      "plan_kv_pool",
      [config](const std::vector<rt::KvLayerSpec>& layers, int64_t block_size, int64_t kernel_block_size,
               int64_t memory_budget_bytes, int64_t num_blocks, int64_t max_num_seqs, int64_t state_copies,
               int64_t max_model_len, bool reserve_null_block) {
        return rt::plan_kv_pool(config(layers, block_size, kernel_block_size, memory_budget_bytes, num_blocks,
                                       max_num_seqs, state_copies, max_model_len, reserve_null_block));
      },
      "layers"_a, nb::kw_only(), "block_size"_a, "kernel_block_size"_a = 0, "memory_budget_bytes"_a = 0,
      "num_blocks"_a = 0, "max_num_seqs"_a = 1, "state_copies"_a = 1, "max_model_len"_a = 0,
      "reserve_null_block"_a = true,
      "Number of blocks and per-layer cache shapes from a byte budget or a block count.");
  m.def(
      "size_kv_pool",
      [config](const std::vector<rt::KvLayerSpec>& layers, int64_t block_size, int64_t kernel_block_size,
               int64_t max_num_seqs, int64_t state_copies) {
        return rt::size_kv_pool(
            config(layers, block_size, kernel_block_size, 0, 0, max_num_seqs, state_copies, 0, true));
      },
      "layers"_a, nb::kw_only(), "block_size"_a, "kernel_block_size"_a = 0, "max_num_seqs"_a = 1,
      "state_copies"_a = 1,
      "Bytes per block and state bytes before the block count is known (a geometry of 0 blocks).");
  nb::class_<rt::KvPageAlignment>(m, "KvPageAlignment", "A hybrid model's block size and page (kv_geometry.h).")
      .def_ro("block_size", &rt::KvPageAlignment::block_size)
      .def_ro("page_bytes", &rt::KvPageAlignment::page_bytes)
      .def_ro("state_page_bytes", &rt::KvPageAlignment::state_page_bytes);
  m.def("align_kv_pages", &rt::align_kv_pages, "layers"_a, "base_block_size"_a,
        "The smallest multiple of base_block_size whose attention page holds one sequence's\n"
        "linear-attention state, and that page's bytes (vLLM's one page size for hybrid models).");
  m.def("choose_kernel_block_size", &rt::choose_kernel_block_size, "block_size"_a, "requested"_a = 0,
        "Kernel block size for vLLM's block_size: block_size itself (requested = 0; the kernels\n"
        "read any block size), or requested, which must divide it.");
  m.def(
      "split_block_ids",
      [](IdsND ids, int64_t kernel_blocks_per_block) {
        // Output: ids' shape with the last dimension times k (a 0-d input counts as [1]).
        std::vector<size_t> shape(ids.shape_ptr(), ids.shape_ptr() + ids.ndim());
        if (shape.empty()) shape.push_back(1);
        if (kernel_blocks_per_block > 0) shape.back() *= static_cast<size_t>(kernel_blocks_per_block);
        size_t total = 1;
        for (size_t d : shape) total *= d;
        auto* out = new int32_t[total > 0 ? total : 1];
        nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<int32_t*>(p); });
        rt::split_block_ids(ids.data(), ids.size(), kernel_blocks_per_block, out);
        return nb::ndarray<nb::numpy, int32_t>(out, shape.size(), shape.data(), owner);
      },
      "block_ids"_a, "kernel_blocks_per_block"_a,
      "Block ids (int32, any shape) -> kernel block ids: b -> b*k .. b*k+k-1 along the last axis;\n"
      "negative padding stays negative.");
}

}  // namespace

namespace vllm_metal::bindings {

void bind_runtime_pool(nb::module_& m) {
  bind_hash_chain(m);
  bind_block_pool(m);
  bind_geometry(m);
}

}  // namespace vllm_metal::bindings
