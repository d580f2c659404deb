#include "runtime/kv_geometry.h"

#include <cstdio>
#include <limits>
#include <stdexcept>

namespace vllm_metal::runtime {

namespace {

constexpr int64_t kMaxId = std::numeric_limits<int32_t>::max();  // block ids are int32

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument("[kv_geometry] " + msg); }

std::string str(int64_t v) { return std::to_string(v); }

// Bytes with a readable unit alongside the exact count.
std::string bytes_str(int64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  char buf[64];
  if (u == 0) {
    std::snprintf(buf, sizeof(buf), "%lld B", static_cast<long long>(b));
  } else {
    std::snprintf(buf, sizeof(buf), "%lld B (%.2f %s)", static_cast<long long>(b), v, units[u]);
  }
  return buf;
}

int64_t mul(int64_t a, int64_t b, const char* what) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) fail(std::string(what) + " overflows 64 bits");
  return r;
}

int64_t add(int64_t a, int64_t b, const char* what) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) fail(std::string(what) + " overflows 64 bits");
  return r;
}

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

int64_t kv_dtype_size(KvDtype dtype) {
  switch (dtype) {
    case KvDtype::kFloat32: return 4;
    case KvDtype::kFloat16:
    case KvDtype::kBFloat16: return 2;
    case KvDtype::kInt8:
    case KvDtype::kUInt8: return 1;
  }
  fail("unknown dtype");
}

const char* kv_dtype_name(KvDtype dtype) {
  switch (dtype) {
    case KvDtype::kFloat32: return "float32";
    case KvDtype::kFloat16: return "float16";
    case KvDtype::kBFloat16: return "bfloat16";
    case KvDtype::kInt8: return "int8";
    case KvDtype::kUInt8: return "uint8";
  }
  return "?";
}

KvDtype parse_kv_dtype(const std::string& name) {
  for (KvDtype d : {KvDtype::kFloat32, KvDtype::kFloat16, KvDtype::kBFloat16, KvDtype::kInt8,
                    KvDtype::kUInt8}) {
    if (name == kv_dtype_name(d)) return d;
  }
  fail("dtype must be 'float32', 'float16', 'bfloat16', 'int8' or 'uint8', got '" + name + "'");
}

const char* kv_layer_kind_name(KvLayerKind kind) {
  switch (kind) {
    case KvLayerKind::kFullAttention: return "full_attention";
    case KvLayerKind::kSlidingWindow: return "sliding_window";
    case KvLayerKind::kLinearAttention: return "linear_attention";
  }
  return "?";
}

KvLayerKind parse_kv_layer_kind(const std::string& name) {
  for (KvLayerKind k : {KvLayerKind::kFullAttention, KvLayerKind::kSlidingWindow,
                        KvLayerKind::kLinearAttention}) {
    if (name == kv_layer_kind_name(k)) return k;
  }
  fail("layer kind must be 'full_attention', 'sliding_window' or 'linear_attention', got '" + name + "'");
}

int64_t choose_kernel_block_size(int64_t block_size, int64_t requested) {
  if (block_size <= 0) fail("block_size must be > 0, got " + str(block_size));
  if (requested == 0) return block_size;  // the kernels read any block size
  if (requested < 0 || block_size % requested != 0) {
    fail("kernel_block_size must divide block_size " + str(block_size) + " (or be 0: block_size), got " +
         str(requested));
  }
  return requested;
}

void split_block_ids(const int32_t* ids, size_t n, int64_t kernel_blocks_per_block, int32_t* out) {
  const int64_t k = kernel_blocks_per_block;
  if (k <= 0) fail("kernel_blocks_per_block must be > 0, got " + str(k));
  for (size_t i = 0; i < n; ++i) {
    if (ids[i] >= 0 && (static_cast<int64_t>(ids[i]) + 1) * k - 1 > kMaxId) {
      fail("block id " + str(ids[i]) + " split " + str(k) + " ways exceeds the int32 id range");
    }
  }
  for (size_t i = 0; i < n; ++i) {
    const int64_t b = ids[i];
    for (int64_t j = 0; j < k; ++j) {
      out[i * static_cast<size_t>(k) + static_cast<size_t>(j)] =
          static_cast<int32_t>(b < 0 ? b : b * k + j);
    }
  }
}

namespace {

// Per-layer bytes (one block of each attention layer, one sequence of each
// state) and the pool's block and state bytes; no block count yet.
KvPoolGeometry size_layers(const KvPoolConfig& c, int64_t& state_bytes_per_seq) {
  KvPoolGeometry g;
  g.block_size = c.block_size;
  g.kernel_block_size = choose_kernel_block_size(c.block_size, c.kernel_block_size);
  g.kernel_blocks_per_block = c.block_size / g.kernel_block_size;
  g.max_num_seqs = c.max_num_seqs;
  g.state_copies = c.state_copies;
  if (c.memory_budget_bytes < 0) fail("memory_budget_bytes must be >= 0, got " + str(c.memory_budget_bytes));
  if (c.num_blocks < 0) fail("num_blocks must be >= 0, got " + str(c.num_blocks));
  if (c.max_model_len < 0) fail("max_model_len must be >= 0, got " + str(c.max_model_len));
  if (c.state_copies < 1) fail("state_copies must be >= 1, got " + str(c.state_copies));
  if (c.layers.empty()) fail("layers must not be empty");

  state_bytes_per_seq = 0;
  for (size_t i = 0; i < c.layers.size(); ++i) {
    const KvLayerSpec& l = c.layers[i];
    const std::string where = "layer " + std::to_string(i) + " (" + kv_layer_kind_name(l.kind) + "): ";
    KvLayerGeometry lg;
    lg.kind = l.kind;
    lg.dtype = l.dtype;
    if (l.kind == KvLayerKind::kLinearAttention) {
      ++g.num_linear_layers;
      if (l.states.empty()) fail(where + "needs at least one state tensor");
      for (const KvStateSpec& s : l.states) {
        int64_t elems = 1;
        for (int64_t d : s.shape) {
          if (d <= 0) fail(where + "state dimensions must be > 0, got " + str(d));
          elems = mul(elems, d, "state size");
        }
        state_bytes_per_seq = add(state_bytes_per_seq, mul(elems, kv_dtype_size(s.dtype), "state size"), "state size");
        lg.state_dtypes.push_back(s.dtype);
      }
    } else {
      ++g.num_attention_layers;
      if (l.num_kv_heads <= 0) fail(where + "num_kv_heads must be > 0, got " + str(l.num_kv_heads));
      if (l.head_dim <= 0) fail(where + "head_dim must be > 0, got " + str(l.head_dim));
      if (l.kind == KvLayerKind::kSlidingWindow) {
        if (l.sliding_window <= 0) fail(where + "sliding_window must be > 0, got " + str(l.sliding_window));
        lg.sliding_window = l.sliding_window;
      } else if (l.sliding_window != 0) {
        fail(where + "sliding_window is only for sliding_window layers, got " + str(l.sliding_window));
      }
      const int64_t per_block =
          mul(mul(mul(mul(2, c.block_size, "block bytes"), l.num_kv_heads, "block bytes"), l.head_dim, "block bytes"),
              kv_dtype_size(l.dtype), "block bytes");
      lg.bytes_per_block = per_block;
      g.bytes_per_block = add(g.bytes_per_block, per_block, "block bytes");
    }
    g.layers.push_back(std::move(lg));
  }
  if (g.num_linear_layers > 0 && c.max_num_seqs <= 0) {
    fail("max_num_seqs must be > 0 with linear-attention layers, got " + str(c.max_num_seqs));
  }
  g.state_bytes = g.num_linear_layers > 0
                      ? mul(mul(state_bytes_per_seq, c.max_num_seqs, "state bytes"), c.state_copies, "state bytes")
                      : 0;
  return g;
}

// Every layer's shapes and bytes for g.num_blocks, and the pool's totals.
void fill_shapes(const KvPoolConfig& c, KvPoolGeometry& g) {
  const int64_t null_blocks = c.reserve_null_block ? 1 : 0;
  g.num_kernel_blocks = g.num_blocks * g.kernel_blocks_per_block;
  g.kv_bytes = mul(g.num_blocks, g.bytes_per_block, "KV bytes");
  g.total_bytes = add(g.kv_bytes, g.state_bytes, "pool bytes");
  g.max_tokens = g.num_blocks > null_blocks ? (g.num_blocks - null_blocks) * c.block_size : 0;
  for (size_t i = 0; i < c.layers.size(); ++i) {
    const KvLayerSpec& l = c.layers[i];
    KvLayerGeometry& lg = g.layers[i];
    if (l.kind == KvLayerKind::kLinearAttention) {
      for (const KvStateSpec& s : l.states) {
        std::vector<int64_t> shape{c.max_num_seqs};
        shape.insert(shape.end(), s.shape.begin(), s.shape.end());
        int64_t elems = 1;
        for (int64_t d : shape) elems *= d;
        lg.bytes += elems * kv_dtype_size(s.dtype) * c.state_copies;
        lg.state_shapes.push_back(std::move(shape));
      }
    } else {
      lg.cache_shape = {g.num_blocks, c.block_size, l.num_kv_heads, l.head_dim};
      lg.kernel_cache_shape = {g.num_kernel_blocks, g.kernel_block_size, l.num_kv_heads, l.head_dim};
      lg.bytes = g.num_blocks * lg.bytes_per_block;
    }
  }
}

std::string mib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  return buf;
}

}  // namespace

KvPoolGeometry size_kv_pool(const KvPoolConfig& c) {
  int64_t per_seq = 0;
  KvPoolGeometry g = size_layers(c, per_seq);
  fill_shapes(c, g);  // 0 blocks
  return g;
}

std::string describe_kv_pool(const KvPoolGeometry& g) {
  const std::string blocks = str(g.num_blocks) + " blocks of " + str(g.block_size) + " tokens";
  if (g.num_linear_layers == 0) {
    return blocks + " (" + str(g.num_blocks * g.block_size) + " tokens, " + mib(g.kv_bytes) + ")";
  }
  const std::string states = str(g.max_num_seqs) + " state slots for " + str(g.num_linear_layers) +
                             " linear-attention layers (" + mib(g.state_bytes) + ")";
  if (g.num_attention_layers == 0) return states;
  return blocks + " for " + str(g.num_attention_layers) + " attention layers (" + mib(g.kv_bytes) + "), " + states;
}

KvPageAlignment align_kv_pages(const std::vector<KvLayerSpec>& layers, int64_t base_block_size) {
  if (base_block_size <= 0) fail("base_block_size must be > 0, got " + str(base_block_size));
  KvPoolConfig one_token;  // per token and per sequence: a one-token block, one slot
  one_token.layers = layers;
  one_token.block_size = 1;
  int64_t unused = 0;
  KvPoolGeometry g = size_layers(one_token, unused);
  fill_shapes(one_token, g);  // a linear layer's bytes: one sequence's state
  int64_t per_token = 0;
  KvPageAlignment a;
  for (size_t i = 0; i < layers.size(); ++i) {
    const KvLayerGeometry& l = g.layers[i];
    if (l.kind == KvLayerKind::kLinearAttention) {
      a.state_page_bytes = l.bytes > a.state_page_bytes ? l.bytes : a.state_page_bytes;
    } else if (per_token == 0) {
      per_token = l.bytes_per_block;
    } else if (l.bytes_per_block != per_token) {
      fail("layer " + str(static_cast<int64_t>(i)) + " (" + kv_layer_kind_name(l.kind) + "): " +
           str(l.bytes_per_block) + " bytes per token, but earlier attention layers take " + str(per_token) +
           ": one page size needs attention layers of one size");
    }
  }
  if (per_token == 0) fail("aligning pages needs an attention layer");
  const int64_t base_page = mul(base_block_size, per_token, "page bytes");
  a.block_size = mul(base_block_size, a.state_page_bytes > 0 ? cdiv(a.state_page_bytes, base_page) : 1, "block size");
  a.page_bytes = mul(a.block_size, per_token, "page bytes");
  return a;
}

KvPoolGeometry plan_kv_pool(const KvPoolConfig& c) {
  int64_t state_bytes_per_seq = 0;
  KvPoolGeometry g = size_layers(c, state_bytes_per_seq);

  const int64_t null_blocks = c.reserve_null_block ? 1 : 0;
  const bool has_attention = g.num_attention_layers > 0;
  // Blocks one sequence of max_model_len tokens needs, plus the null block.
  const int64_t min_blocks = (c.max_model_len > 0 ? cdiv(c.max_model_len, c.block_size) : 1) + null_blocks;
  const int64_t max_blocks = kMaxId / g.kernel_blocks_per_block;  // (kernel) block ids stay int32
  const std::string seq_need =
      c.max_model_len > 0 ? "one sequence of max_model_len = " + str(c.max_model_len) + " tokens needs " +
                                str(min_blocks - null_blocks) + " blocks" + (null_blocks ? " + the null block" : "")
                          : "the pool needs at least one usable block" + std::string(null_blocks ? " + the null block" : "");
  auto tokens_of = [&](int64_t blocks) { return blocks > null_blocks ? (blocks - null_blocks) * c.block_size : 0; };

  if (c.memory_budget_bytes > 0 && g.state_bytes > c.memory_budget_bytes) {
    const int64_t per_seq = state_bytes_per_seq * c.state_copies;  // no overflow: g.state_bytes holds a multiple
    fail("linear-attention state for max_num_seqs = " + str(c.max_num_seqs) +
         (c.state_copies > 1 ? " (" + str(c.state_copies) + " copies)" : std::string()) + " needs " +
         bytes_str(g.state_bytes) + " (" + bytes_str(per_seq) + " per sequence), more than the budget of " +
         bytes_str(c.memory_budget_bytes) + ": at most " + str(c.memory_budget_bytes / per_seq) + " sequences fit");
  }

  if (!has_attention) {
    if (c.num_blocks > 0) fail("num_blocks = " + str(c.num_blocks) + " given, but no layer uses KV blocks");
    g.num_blocks = 0;
  } else if (c.num_blocks > 0) {
    g.num_blocks = c.num_blocks;
    if (g.num_blocks > max_blocks) {
      fail("num_blocks = " + str(c.num_blocks) +
           (g.kernel_blocks_per_block > 1 ? " split into " + str(g.kernel_blocks_per_block) + " kernel blocks each"
                                          : std::string()) +
           " exceeds the int32 block id range: at most " + str(max_blocks) + " blocks");
    }
    if (g.num_blocks < min_blocks) {
      fail("num_blocks = " + str(c.num_blocks) + " holds " + str(tokens_of(g.num_blocks)) + " tokens, but " + seq_need +
           ": at least " + str(min_blocks) + " blocks (or max_model_len <= " + str(tokens_of(g.num_blocks)) + ")");
    }
    const int64_t need = add(mul(g.num_blocks, g.bytes_per_block, "KV bytes"), g.state_bytes, "pool bytes");
    if (c.memory_budget_bytes > 0 && need > c.memory_budget_bytes) {
      const int64_t fit = (c.memory_budget_bytes - g.state_bytes) / g.bytes_per_block;
      fail("num_blocks = " + str(c.num_blocks) + " needs " + bytes_str(need) + " (" + bytes_str(g.bytes_per_block) +
           " per block" + (g.state_bytes ? " + " + bytes_str(g.state_bytes) + " of state" : std::string()) +
           "), more than the budget of " + bytes_str(c.memory_budget_bytes) + ": at most " + str(fit) + " blocks fit");
    }
  } else {
    if (c.memory_budget_bytes <= 0) fail("need memory_budget_bytes > 0 or num_blocks > 0 to size the pool");
    const int64_t for_blocks = c.memory_budget_bytes - g.state_bytes;
    const int64_t fit = for_blocks / g.bytes_per_block;
    if (fit < min_blocks) {
      const int64_t need = add(mul(min_blocks, g.bytes_per_block, "KV bytes"), g.state_bytes, "pool bytes");
      fail("a budget of " + bytes_str(c.memory_budget_bytes) + " holds " + str(fit) + " blocks of " +
           bytes_str(g.bytes_per_block) + (g.state_bytes ? " after " + bytes_str(g.state_bytes) + " of state" : std::string()) +
           " = " + str(tokens_of(fit)) + " tokens, but " + seq_need + ": a budget of at least " + bytes_str(need) +
           " (or max_model_len <= " + str(tokens_of(fit)) + ")");
    }
    g.num_blocks = fit < max_blocks ? fit : max_blocks;
  }

  fill_shapes(c, g);
  return g;
}

}  // namespace vllm_metal::runtime
