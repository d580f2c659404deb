#include "runtime/request_table.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <functional>
#include <stdexcept>

namespace vllm_metal::runtime {

namespace {

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("[BatchPacker] " + what);
}

std::string quoted(std::string_view id) { return "'" + std::string(id) + "'"; }

uint64_t hash_id(std::string_view id) { return std::hash<std::string_view>{}(id); }

}  // namespace

RequestTable::RequestTable(RequestTableConfig config) : config_(std::move(config)) {
  if (config_.max_model_len <= 0) {
    fail("max_model_len must be positive, got " + std::to_string(config_.max_model_len));
  }
  if (config_.kv_groups.empty()) fail("expected at least one KV-cache group, got none");
  if (config_.mrope_num_dims < 0) {
    fail("mrope_num_dims must be >= 0, got " + std::to_string(config_.mrope_num_dims));
  }
  for (size_t g = 0; g < config_.kv_groups.size(); ++g) {
    KvGroupSpec& spec = config_.kv_groups[g];
    const std::string name = "KV group " + std::to_string(g);
    if (spec.block_size <= 0) {
      fail(name + ": block_size must be positive, got " + std::to_string(spec.block_size));
    }
    if (spec.kernel_block_size == 0) spec.kernel_block_size = spec.block_size;
    if (spec.kernel_block_size <= 0 || spec.block_size % spec.kernel_block_size != 0) {
      fail(name + ": kernel_block_size must divide block_size " +
           std::to_string(spec.block_size) + ", got " + std::to_string(spec.kernel_block_size));
    }
    if (spec.max_blocks_per_req < 0 || spec.num_blocks < 0) {
      fail(name + ": max_blocks_per_req and num_blocks must be >= 0");
    }
    // kernel block ids (b * k + j) are int32
    if (spec.num_blocks * (spec.block_size / spec.kernel_block_size) > INT32_MAX) {
      fail(name + ": num_blocks * (block_size / kernel_block_size) must fit int32, got " +
           std::to_string(spec.num_blocks) + " * " +
           std::to_string(spec.block_size / spec.kernel_block_size));
    }
    const int64_t needed =
        (static_cast<int64_t>(config_.max_model_len) + spec.block_size - 1) / spec.block_size;
    max_blocks_.push_back(spec.max_blocks_per_req > 0 ? spec.max_blocks_per_req
                                                      : static_cast<int32_t>(needed));
  }
  blocks_.resize(config_.kv_groups.size());
  const auto reserve = static_cast<size_t>(std::max(config_.initial_rows, 1));
  states_.reserve(reserve);
  rows_.reserve(reserve);
  row_stamp_.reserve(reserve);
  num_blocks_.reserve(reserve * config_.kv_groups.size());
  last_block_.reserve(reserve * config_.kv_groups.size());
  row_hash_.reserve(reserve);
  keys_.reserve(reserve * kKeyBytes);
  for (size_t g = 0; g < blocks_.size(); ++g) blocks_[g].reserve(reserve * max_blocks_[g]);
  index_rebuild(64);
  while (index_.size() < 2 * reserve) index_rebuild(index_.size() * 2);
}

// ---- id index ------------------------------------------------------------------

namespace {
inline void prefetch(const void* p) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p);
#else
  (void)p;
#endif
}
uint32_t tag_of(uint64_t hash) { return static_cast<uint32_t>(hash >> 32); }
}  // namespace

bool RequestTable::key_equals(int32_t row, std::string_view req_id) const {
  const char* key = keys_.data() + static_cast<size_t>(row) * kKeyBytes;
  const auto len = static_cast<unsigned char>(key[kKeyInline]);
  if (len <= kKeyInline) {
    return len == req_id.size() && std::memcmp(key, req_id.data(), len) == 0;
  }
  return rows_[static_cast<size_t>(row)].req_id == req_id;
}

void RequestTable::set_key(int32_t row, std::string_view req_id, uint64_t hash) {
  char* key = keys_.data() + static_cast<size_t>(row) * kKeyBytes;
  if (req_id.size() <= kKeyInline) {
    std::memcpy(key, req_id.data(), req_id.size());
    key[kKeyInline] = static_cast<char>(req_id.size());
  } else {
    key[kKeyInline] = static_cast<char>(0xFF);  // compare with rows_[row].req_id
  }
  row_hash_[static_cast<size_t>(row)] = hash;
}

size_t RequestTable::probe(std::string_view req_id, uint64_t hash, size_t s) const {
  const uint32_t tag = tag_of(hash);
  while (index_[s].row >= 0 && !(index_[s].tag == tag && key_equals(index_[s].row, req_id))) {
    s = (s + 1) & index_mask_;
  }
  return s;
}

// `row` is live and counted in num_live_.
void RequestTable::index_insert(int32_t row) {
  // keep the load factor <= 1/2; a rebuild inserts every live row
  if (static_cast<size_t>(num_live_) * 2 > index_.size()) {
    index_rebuild(index_.size() * 2);
    return;
  }
  const uint64_t hash = row_hash_[static_cast<size_t>(row)];
  size_t s = hash & index_mask_;
  while (index_[s].row >= 0) s = (s + 1) & index_mask_;
  index_[s] = IndexSlot{row, tag_of(hash)};
}

void RequestTable::index_erase(int32_t row) {
  const uint64_t hash = row_hash_[static_cast<size_t>(row)];
  size_t hole = hash & index_mask_;
  while (index_[hole].row != row) {
    if (index_[hole].row < 0) return;
    hole = (hole + 1) & index_mask_;
  }
  index_[hole] = IndexSlot{};
  // backward-shift: move later entries of the probe run into the hole
  size_t s = (hole + 1) & index_mask_;
  while (index_[s].row >= 0) {
    const size_t home = row_hash_[static_cast<size_t>(index_[s].row)] & index_mask_;
    // the entry may move to `hole` when `hole` lies cyclically in [home, s)
    if (((s - home) & index_mask_) >= ((s - hole) & index_mask_)) {
      index_[hole] = index_[s];
      index_[s] = IndexSlot{};
      hole = s;
    }
    s = (s + 1) & index_mask_;
  }
}

void RequestTable::index_rebuild(size_t capacity) {
  index_.assign(capacity, IndexSlot{});
  index_mask_ = capacity - 1;
  for (size_t r = 0; r < rows_.size(); ++r) {
    if (!states_[r].live) continue;
    size_t s = row_hash_[r] & index_mask_;
    while (index_[s].row >= 0) s = (s + 1) & index_mask_;
    index_[s] = IndexSlot{static_cast<int32_t>(r), tag_of(row_hash_[r])};
  }
}

int32_t RequestTable::find(std::string_view req_id) const {
  const uint64_t hash = hash_id(req_id);
  return index_[probe(req_id, hash, hash & index_mask_)].row;
}

void RequestTable::find_many(const std::string_view* req_ids, size_t n, int32_t* rows) const {
  constexpr size_t kGroup = 16;
  uint64_t hash[kGroup];
  size_t slot[kGroup];
  for (size_t i = 0; i < std::min(n, kGroup); ++i) prefetch(req_ids[i].data());
  for (size_t base = 0; base < n; base += kGroup) {
    const size_t m = std::min(kGroup, n - base);
    const std::string_view* ids = req_ids + base;
    for (size_t i = base + kGroup; i < std::min(n, base + 2 * kGroup); ++i) {
      prefetch(req_ids[i].data());  // the next group's ids, hashed next round
    }
    for (size_t i = 0; i < m; ++i) {  // 1: the home slots
      hash[i] = hash_id(ids[i]);
      slot[i] = hash[i] & index_mask_;
      prefetch(&index_[slot[i]]);
    }
    for (size_t i = 0; i < m; ++i) {  // 2: the first slot with a matching tag, and its key
      const uint32_t tag = tag_of(hash[i]);
      while (index_[slot[i]].row >= 0 && index_[slot[i]].tag != tag) {
        slot[i] = (slot[i] + 1) & index_mask_;
      }
      if (index_[slot[i]].row >= 0) {
        prefetch(keys_.data() + static_cast<size_t>(index_[slot[i]].row) * kKeyBytes);
      }
    }
    for (size_t i = 0; i < m; ++i) {  // 3: confirm (a tag collision probes on)
      rows[base + i] = index_[probe(ids[i], hash[i], slot[i])].row;
    }
  }
}

int32_t RequestTable::row_of(std::string_view req_id) const {
  const int32_t r = find(req_id);
  if (r < 0) fail("unknown request id " + quoted(req_id));
  return r;
}

std::vector<std::string> RequestTable::request_ids() const {
  std::vector<std::string> ids;
  for (size_t r = 0; r < rows_.size(); ++r) {
    if (states_[r].live) ids.push_back(rows_[r].req_id);
  }
  return ids;
}

std::vector<std::vector<int32_t>> RequestTable::block_id_lists(int32_t r) const {
  std::vector<std::vector<int32_t>> out;
  for (int32_t g = 0; g < num_groups(); ++g) {
    out.emplace_back(block_ids(r, g), block_ids(r, g) + num_blocks(r, g));
  }
  return out;
}

// ---- validation ------------------------------------------------------------------

// ids: [num_groups] new block ids, appended to the blocks row `append_to` holds
// (-1: the ids replace whatever was held).
void RequestTable::check_block_ids(std::string_view req_id, const Int32Span* ids,
                                   int32_t append_to) const {
  for (int32_t g = 0; g < num_groups(); ++g) {
    const Int32Span& list = ids[g];
    const size_t held = append_to >= 0 ? static_cast<size_t>(num_blocks(append_to, g)) : 0;
    const int64_t total = static_cast<int64_t>(list.size + held);
    if (total > max_blocks(g)) {
      fail("request " + quoted(req_id) + ": KV group " + std::to_string(g) + " would hold " +
           std::to_string(total) + " blocks, the block table has room for " +
           std::to_string(max_blocks(g)) + " (max_model_len " +
           std::to_string(config_.max_model_len) + ", block size " +
           std::to_string(group(g).block_size) + ")");
    }
    const int64_t limit = group(g).num_blocks;
    for (int32_t id : list) {
      if (id < 0 || (limit > 0 && id >= limit)) {
        fail("request " + quoted(req_id) + ": block id " + std::to_string(id) + " in KV group " +
             std::to_string(g) + " is outside the pool [0, " +
             (limit > 0 ? std::to_string(limit) : std::string("inf")) + ")");
      }
    }
  }
}

void RequestTable::check_mrope(const NewRequest& request) const {
  const size_t n = request.mrope_positions.size;
  if (n == 0) return;
  const int32_t dims = config_.mrope_num_dims;
  if (dims == 0) {
    fail("request " + quoted(request.req_id) +
         ": M-RoPE positions given but the packer was built with mrope_num_dims=0");
  }
  if (n % static_cast<size_t>(dims) != 0 ||
      n / static_cast<size_t>(dims) > static_cast<size_t>(config_.max_model_len)) {
    fail("request " + quoted(request.req_id) + ": M-RoPE positions must be [" +
         std::to_string(dims) + ", L] with L <= max_model_len " +
         std::to_string(config_.max_model_len) + ", got " + std::to_string(n) + " values");
  }
}

// ---- mutation --------------------------------------------------------------------

int32_t RequestTable::take_free_row() {
  if (!free_rows_.empty()) {
    const int32_t r = free_rows_.back();
    free_rows_.pop_back();
    return r;
  }
  states_.emplace_back();
  rows_.emplace_back();
  row_stamp_.push_back(0);
  for (size_t g = 0; g < blocks_.size(); ++g) blocks_[g].resize(blocks_[g].size() + max_blocks_[g], 0);
  num_blocks_.resize(num_blocks_.size() + blocks_.size(), 0);
  last_block_.resize(last_block_.size() + blocks_.size(), 0);
  row_hash_.push_back(0);
  keys_.resize(keys_.size() + kKeyBytes, 0);
  return static_cast<int32_t>(rows_.size() - 1);
}

void RequestTable::set_tokens(int32_t r, Int32Span token_ids) {
  RequestRow& row = rows_[static_cast<size_t>(r)];
  RowState& st = states_[static_cast<size_t>(r)];
  row.token_ids.assign(token_ids.begin(), token_ids.end());
  st.num_tokens = static_cast<int32_t>(token_ids.size);
  st.last_token = token_ids.size ? token_ids[token_ids.size - 1] : 0;
  st.tokens_version += 1;
}

// Writes validated ids (one list per group) after the held ones, or in their place.
void RequestTable::set_block_ids(int32_t r, const Int32Span* ids, bool append) {
  for (int32_t g = 0; g < num_groups(); ++g) {
    const size_t i = static_cast<size_t>(r) * blocks_.size() + static_cast<size_t>(g);
    int32_t& n = num_blocks_[i];
    if (!append) n = 0;
    if (ids) {
      int32_t* row = blocks_[static_cast<size_t>(g)].data() + static_cast<size_t>(r) * max_blocks(g);
      std::copy(ids[g].begin(), ids[g].end(), row + n);
      n += static_cast<int32_t>(ids[g].size);
    }
    last_block_[i] = n > 0 ? block_ids(r, g)[n - 1] : 0;
  }
}

int32_t RequestTable::add(const NewRequest& request, bool replace) {
  const std::string_view id = request.req_id;
  const int32_t existing = find(id);
  if (existing >= 0 && !replace) fail("request id " + quoted(id) + " is already in the table");
  const int64_t n = static_cast<int64_t>(request.token_ids.size);
  if (n > config_.max_model_len) {
    fail("request " + quoted(id) + ": " + std::to_string(n) + " tokens exceed max_model_len " +
         std::to_string(config_.max_model_len));
  }
  const int64_t prompt_len = request.prompt_len < 0 ? n : request.prompt_len;
  if (prompt_len > n) {
    fail("request " + quoted(id) + ": prompt_len must be <= the " + std::to_string(n) +
         " tokens given, got " + std::to_string(prompt_len));
  }
  if (request.num_computed_tokens < 0 || request.num_computed_tokens > n) {
    fail("request " + quoted(id) + ": num_computed_tokens must be in [0, " + std::to_string(n) +
         "], got " + std::to_string(request.num_computed_tokens));
  }
  if (request.block_ids) check_block_ids(id, request.block_ids, -1);
  check_mrope(request);

  // valid: from here on nothing throws except allocation failure
  if (existing >= 0) remove(id);
  const int32_t r = take_free_row();
  RequestRow& row = rows_[static_cast<size_t>(r)];
  RowState& st = states_[static_cast<size_t>(r)];
  row.req_id.assign(id.data(), id.size());
  st.live = 1;
  st.generation += 1;
  st.block_ids_version += 1;
  st.num_computed_tokens = request.num_computed_tokens;
  st.prompt_len = static_cast<int32_t>(prompt_len);
  set_tokens(r, request.token_ids);
  set_block_ids(r, request.block_ids, /*append=*/false);
  row.mrope_positions.assign(request.mrope_positions.begin(), request.mrope_positions.end());
  row.mrope_len = config_.mrope_num_dims > 0
                      ? static_cast<int32_t>(request.mrope_positions.size /
                                             static_cast<size_t>(config_.mrope_num_dims))
                      : 0;
  row.mrope_position_delta = request.mrope_position_delta;
  set_key(r, row.req_id, hash_id(row.req_id));
  num_live_ += 1;
  index_insert(r);
  return r;
}

bool RequestTable::remove(std::string_view req_id) {
  const int32_t r = find(req_id);
  if (r < 0) return false;
  index_erase(r);
  RowState& st = states_[static_cast<size_t>(r)];
  st.live = 0;
  st.generation += 1;
  (config_.defer_row_reuse ? retired_rows_ : free_rows_).push_back(r);
  num_live_ -= 1;
  return true;
}

void RequestTable::release_retired_rows() {
  free_rows_.insert(free_rows_.end(), retired_rows_.begin(), retired_rows_.end());
  retired_rows_.clear();
}

void RequestTable::update(const RequestUpdate* updates, size_t count) {
  // Pass 1: validate everything (an id may appear once per call).
  stamp_ += 1;
  update_ids_.resize(count);
  update_rows_.resize(count);
  for (size_t i = 0; i < count; ++i) update_ids_[i] = updates[i].req_id;
  find_many(update_ids_.data(), count, update_rows_.data());
  for (size_t i = 0; i < count; ++i) {
    const RequestUpdate& u = updates[i];
    const int32_t r = update_rows_[i];
    if (r < 0) fail("unknown request id " + quoted(u.req_id));
    if (row_stamp_[static_cast<size_t>(r)] == stamp_) {
      fail("request " + quoted(u.req_id) + " appears twice in one update");
    }
    row_stamp_[static_cast<size_t>(r)] = stamp_;
    const RowState& st = states_[static_cast<size_t>(r)];
    if (u.num_computed_tokens < 0 || u.num_computed_tokens > config_.max_model_len) {
      fail("request " + quoted(u.req_id) + ": num_computed_tokens must be in [0, " +
           std::to_string(config_.max_model_len) + "], got " +
           std::to_string(u.num_computed_tokens));
    }
    if (u.token_ids) {
      const size_t n = u.token_ids->size;
      if (n > static_cast<size_t>(config_.max_model_len) ||
          n < static_cast<size_t>(st.prompt_len)) {
        fail("request " + quoted(u.req_id) + ": token_ids must hold the prompt (" +
             std::to_string(st.prompt_len) + ") and at most max_model_len (" +
             std::to_string(config_.max_model_len) + ") tokens, got " + std::to_string(n));
      }
    }
    if (u.replace_block_ids && !u.new_block_ids) {
      fail("request " + quoted(u.req_id) +
           " is resumed (its block ids are replaced) but no block ids came");
    }
    if (u.new_block_ids) {
      check_block_ids(u.req_id, u.new_block_ids, u.replace_block_ids ? -1 : r);
    }
  }
  // Pass 2: apply.
  for (size_t i = 0; i < count; ++i) {
    const RequestUpdate& u = updates[i];
    const int32_t r = update_rows_[i];
    RowState& st = states_[static_cast<size_t>(r)];
    st.num_computed_tokens = u.num_computed_tokens;
    if (u.token_ids) set_tokens(r, *u.token_ids);
    if (u.num_output_tokens >= 0) {
      const int64_t keep = static_cast<int64_t>(st.prompt_len) + u.num_output_tokens;
      if (keep < st.num_tokens) {  // the only case that reads the token list
        std::vector<int32_t>& tokens = rows_[static_cast<size_t>(r)].token_ids;
        tokens.resize(static_cast<size_t>(keep));
        st.num_tokens = static_cast<int32_t>(keep);
        st.last_token = keep > 0 ? tokens.back() : 0;
        st.tokens_version += 1;
      }
    }
    if (u.new_block_ids) {
      if (u.replace_block_ids) st.block_ids_version += 1;
      set_block_ids(r, u.new_block_ids, /*append=*/!u.replace_block_ids);
    }
  }
}

void RequestTable::append_tokens(std::string_view req_id, Int32Span token_ids) {
  append_tokens_to_row(row_of(req_id), token_ids);
}

void RequestTable::append_tokens_to_row(int32_t r, Int32Span token_ids) {
  if (!is_live(r)) fail("row " + std::to_string(r) + " holds no request");
  RequestRow& row = rows_[static_cast<size_t>(r)];
  RowState& st = states_[static_cast<size_t>(r)];
  const int64_t total = static_cast<int64_t>(st.num_tokens) + token_ids.size;
  if (total > config_.max_model_len) {
    fail("request " + quoted(row.req_id) + ": appending " + std::to_string(token_ids.size) +
         " tokens to " + std::to_string(st.num_tokens) + " exceeds max_model_len " +
         std::to_string(config_.max_model_len));
  }
  if (token_ids.size == 0) return;
  row.token_ids.insert(row.token_ids.end(), token_ids.begin(), token_ids.end());
  st.num_tokens = static_cast<int32_t>(total);
  st.last_token = token_ids[token_ids.size - 1];
}

void RequestTable::overwrite_token(int32_t r, int32_t index, int32_t token_id) {
  if (!is_live(r)) fail("row " + std::to_string(r) + " holds no request");
  RowState& st = states_[static_cast<size_t>(r)];
  if (index < 0 || index >= st.num_tokens) {
    fail("request " + quoted(rows_[static_cast<size_t>(r)].req_id) + ": token index " +
         std::to_string(index) + " is not below its " + std::to_string(st.num_tokens) + " tokens");
  }
  rows_[static_cast<size_t>(r)].token_ids[static_cast<size_t>(index)] = token_id;
  if (index == st.num_tokens - 1) st.last_token = token_id;
}

}  // namespace vllm_metal::runtime
