#include "runtime/request_table.h"

#include <algorithm>
#include <functional>
#include <stdexcept>

namespace vllm_metal::runtime {

namespace {

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("[BatchPacker] " + what);
}

std::string quoted(std::string_view id) { return "'" + std::string(id) + "'"; }

size_t hash_id(std::string_view id) { return std::hash<std::string_view>{}(id); }

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
    const int64_t needed =
        (static_cast<int64_t>(config_.max_model_len) + spec.block_size - 1) / spec.block_size;
    max_blocks_.push_back(spec.max_blocks_per_req > 0 ? spec.max_blocks_per_req
                                                      : static_cast<int32_t>(needed));
  }
  index_rebuild(64);
}

// ---- id index ------------------------------------------------------------------

size_t RequestTable::slot_of(std::string_view req_id) const {
  size_t s = hash_id(req_id) & index_mask_;
  while (index_[s] >= 0 && rows_[static_cast<size_t>(index_[s])].req_id != req_id) {
    s = (s + 1) & index_mask_;
  }
  return s;
}

void RequestTable::index_insert(std::string_view req_id, int32_t row) {
  // keep the load factor <= 1/2
  if (static_cast<size_t>(num_live_ + 1) * 2 > index_.size()) index_rebuild(index_.size() * 2);
  index_[slot_of(req_id)] = row;
}

void RequestTable::index_erase(std::string_view req_id) {
  size_t hole = slot_of(req_id);
  if (index_[hole] < 0) return;
  index_[hole] = -1;
  // backward-shift: move later entries of the probe run into the hole
  size_t s = (hole + 1) & index_mask_;
  while (index_[s] >= 0) {
    const size_t home = hash_id(rows_[static_cast<size_t>(index_[s])].req_id) & index_mask_;
    // the entry may move to `hole` when `hole` lies cyclically in [home, s)
    const bool movable = ((s - home) & index_mask_) >= ((s - hole) & index_mask_);
    if (movable) {
      index_[hole] = index_[s];
      index_[s] = -1;
      hole = s;
    }
    s = (s + 1) & index_mask_;
  }
}

void RequestTable::index_rebuild(size_t capacity) {
  index_.assign(capacity, -1);
  index_mask_ = capacity - 1;
  for (size_t r = 0; r < rows_.size(); ++r) {
    if (rows_[r].live) index_[slot_of(rows_[r].req_id)] = static_cast<int32_t>(r);
  }
}

int32_t RequestTable::find(std::string_view req_id) const { return index_[slot_of(req_id)]; }

int32_t RequestTable::row_of(std::string_view req_id) const {
  const int32_t r = find(req_id);
  if (r < 0) fail("unknown request id " + quoted(req_id));
  return r;
}

std::vector<std::string> RequestTable::request_ids() const {
  std::vector<std::string> ids;
  for (const RequestRow& row : rows_) {
    if (row.live) ids.push_back(row.req_id);
  }
  return ids;
}

// ---- validation ------------------------------------------------------------------

// ids: [num_groups] new block ids, appended to the blocks `append_to` holds
// (nullptr: the ids replace whatever was held).
void RequestTable::check_block_ids(std::string_view req_id, const Int32Span* ids,
                                   const RequestRow* append_to) const {
  for (int32_t g = 0; g < num_groups(); ++g) {
    const Int32Span& list = ids[g];
    const size_t held = append_to ? append_to->block_ids[static_cast<size_t>(g)].size() : 0;
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
  rows_.emplace_back();
  row_stamp_.push_back(0);
  RequestRow& row = rows_.back();
  row.block_ids.resize(config_.kv_groups.size());
  for (size_t g = 0; g < row.block_ids.size(); ++g) row.block_ids[g].reserve(max_blocks_[g]);
  return static_cast<int32_t>(rows_.size() - 1);
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
  if (request.block_ids) check_block_ids(id, request.block_ids, nullptr);
  check_mrope(request);

  // valid: from here on nothing throws except allocation failure
  if (existing >= 0) remove(id);
  const int32_t r = take_free_row();
  RequestRow& row = rows_[static_cast<size_t>(r)];
  row.req_id.assign(id.data(), id.size());
  row.live = true;
  row.generation += 1;
  row.block_ids_version += 1;
  row.prompt_len = static_cast<int32_t>(prompt_len);
  row.num_computed_tokens = request.num_computed_tokens;
  row.token_ids.assign(request.token_ids.begin(), request.token_ids.end());
  for (int32_t g = 0; g < num_groups(); ++g) {
    auto& held = row.block_ids[static_cast<size_t>(g)];
    if (request.block_ids) {
      held.assign(request.block_ids[g].begin(), request.block_ids[g].end());
    } else {
      held.clear();
    }
  }
  row.mrope_positions.assign(request.mrope_positions.begin(), request.mrope_positions.end());
  row.mrope_len = config_.mrope_num_dims > 0
                      ? static_cast<int32_t>(request.mrope_positions.size /
                                             static_cast<size_t>(config_.mrope_num_dims))
                      : 0;
  row.mrope_position_delta = request.mrope_position_delta;
  index_insert(row.req_id, r);
  num_live_ += 1;
  return r;
}

bool RequestTable::remove(std::string_view req_id) {
  const int32_t r = find(req_id);
  if (r < 0) return false;
  index_erase(req_id);
  RequestRow& row = rows_[static_cast<size_t>(r)];
  row.live = false;
  row.generation += 1;
  row.req_id.clear();
  free_rows_.push_back(r);
  num_live_ -= 1;
  return true;
}

void RequestTable::update(const RequestUpdate* updates, size_t count) {
  // Pass 1: validate everything (an id may appear once per call).
  stamp_ += 1;
  update_rows_.clear();
  for (size_t i = 0; i < count; ++i) {
    const RequestUpdate& u = updates[i];
    const int32_t r = row_of(u.req_id);
    if (row_stamp_[static_cast<size_t>(r)] == stamp_) {
      fail("request " + quoted(u.req_id) + " appears twice in one update");
    }
    row_stamp_[static_cast<size_t>(r)] = stamp_;
    update_rows_.push_back(r);
    const RequestRow& row = rows_[static_cast<size_t>(r)];
    if (u.num_computed_tokens < 0 || u.num_computed_tokens > config_.max_model_len) {
      fail("request " + quoted(u.req_id) + ": num_computed_tokens must be in [0, " +
           std::to_string(config_.max_model_len) + "], got " +
           std::to_string(u.num_computed_tokens));
    }
    if (u.token_ids) {
      const size_t n = u.token_ids->size;
      if (n > static_cast<size_t>(config_.max_model_len) ||
          n < static_cast<size_t>(row.prompt_len)) {
        fail("request " + quoted(u.req_id) + ": token_ids must hold the prompt (" +
             std::to_string(row.prompt_len) + ") and at most max_model_len (" +
             std::to_string(config_.max_model_len) + ") tokens, got " + std::to_string(n));
      }
    }
    if (u.replace_block_ids && !u.new_block_ids) {
      fail("request " + quoted(u.req_id) +
           " is resumed (its block ids are replaced) but no block ids came");
    }
    if (u.new_block_ids) {
      check_block_ids(u.req_id, u.new_block_ids, u.replace_block_ids ? nullptr : &row);
    }
  }
  // Pass 2: apply.
  for (size_t i = 0; i < count; ++i) {
    const RequestUpdate& u = updates[i];
    RequestRow& row = rows_[static_cast<size_t>(update_rows_[i])];
    row.num_computed_tokens = u.num_computed_tokens;
    if (u.token_ids) row.token_ids.assign(u.token_ids->begin(), u.token_ids->end());
    if (u.num_output_tokens >= 0) {
      const int64_t keep = static_cast<int64_t>(row.prompt_len) + u.num_output_tokens;
      if (keep < row.num_tokens()) row.token_ids.resize(static_cast<size_t>(keep));
    }
    if (u.new_block_ids) {
      if (u.replace_block_ids) row.block_ids_version += 1;
      for (int32_t g = 0; g < num_groups(); ++g) {
        auto& held = row.block_ids[static_cast<size_t>(g)];
        if (u.replace_block_ids) held.clear();
        held.insert(held.end(), u.new_block_ids[g].begin(), u.new_block_ids[g].end());
      }
    }
  }
}

void RequestTable::append_tokens(std::string_view req_id, Int32Span token_ids) {
  append_tokens_to_row(row_of(req_id), token_ids);
}

void RequestTable::append_tokens_to_row(int32_t r, Int32Span token_ids) {
  if (r < 0 || r >= num_rows() || !rows_[static_cast<size_t>(r)].live) {
    fail("row " + std::to_string(r) + " holds no request");
  }
  RequestRow& row = rows_[static_cast<size_t>(r)];
  const std::string_view req_id = row.req_id;
  const int64_t total = static_cast<int64_t>(row.num_tokens()) + token_ids.size;
  if (total > config_.max_model_len) {
    fail("request " + quoted(req_id) + ": appending " + std::to_string(token_ids.size) +
         " tokens to " + std::to_string(row.num_tokens()) + " exceeds max_model_len " +
         std::to_string(config_.max_model_len));
  }
  row.token_ids.insert(row.token_ids.end(), token_ids.begin(), token_ids.end());
}

}  // namespace vllm_metal::runtime
