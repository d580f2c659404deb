// RequestTable: the worker's persistent copy of every request vLLM's scheduler
// has sent it (request id -> tokens, number computed, block ids per KV-cache
// group, M-RoPE positions), updated from each step's deltas.
//
// Plain C++17: no MLX, no Python. Rows are reused after a request leaves, so a
// steady-state step allocates nothing; a row's token storage grows (doubling)
// only when a request outgrows every earlier occupant of that row.
//
// Every mutating call validates all of its input before changing anything: on
// an exception (std::invalid_argument, message "[BatchPacker] ...") the table
// is exactly as it was.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace vllm_metal::runtime {

// A read-only run of int32 values (C++17 has no std::span).
struct Int32Span {
  const int32_t* data = nullptr;
  size_t size = 0;

  Int32Span() = default;
  Int32Span(const int32_t* d, size_t n) : data(d), size(n) {}
  Int32Span(const std::vector<int32_t>& v) : data(v.data()), size(v.size()) {}  // NOLINT
  const int32_t* begin() const { return data; }
  const int32_t* end() const { return data + size; }
  int32_t operator[](size_t i) const { return data[i]; }
};

// One KV-cache group (vLLM's KVCacheGroupSpec, as far as packing needs it).
struct KvGroupSpec {
  int32_t block_size = 16;        // vLLM's block size for this group, in tokens
  int32_t kernel_block_size = 0;  // block size the kernels read; 0 = block_size.
                                  // Must divide block_size: each vLLM block b is
                                  // split into kernel blocks b*k .. b*k+k-1 (no copy)
  int32_t max_blocks_per_req = 0;  // 0 = ceil(max_model_len / block_size)
  int64_t num_blocks = 0;          // pool size: block ids must be < this; 0 = unchecked
  bool paged = true;  // false for per-request state groups (Mamba / GDN): no slot
                      // mapping (all -1) and no tokens-vs-blocks check
};

struct RequestTableConfig {
  int32_t max_model_len = 0;         // tokens per request, prompt + output
  std::vector<KvGroupSpec> kv_groups;  // at least one
  int32_t mrope_num_dims = 0;        // 0: 1-D positions; else rows of M-RoPE positions
};

// A request the worker sees for the first time (vLLM's NewRequestData), or a
// request re-sent in full: V2 resumes preempted requests this way, with
// token_ids = prefill_token_ids (prompt + outputs so far).
struct NewRequest {
  std::string_view req_id;
  Int32Span token_ids;               // prompt (V1) or prefill_token_ids (V2)
  int32_t prompt_len = -1;           // -1: all of token_ids is prompt
  int32_t num_computed_tokens = 0;   // prefix-cache hits (or the tokens already computed)
  const Int32Span* block_ids = nullptr;  // [num_groups]; nullptr = no blocks yet
  Int32Span mrope_positions;         // [mrope_num_dims, L] row-major; empty = text only
  int32_t mrope_position_delta = 0;  // positions at and after L are pos + delta
};

// A cached request's delta (one entry of vLLM's CachedRequestData).
struct RequestUpdate {
  std::string_view req_id;
  int32_t num_computed_tokens = 0;
  const Int32Span* new_block_ids = nullptr;  // [num_groups]; nullptr = no new blocks
  bool replace_block_ids = false;  // resumed after preemption (V1): the ids replace the old
  int32_t num_output_tokens = -1;  // >= 0: drop output tokens beyond this count (rollback)
  const Int32Span* token_ids = nullptr;  // non-null: all of the request's tokens (V1 all_token_ids)
};

// Storage of one request. Vectors keep their capacity when the row is reused.
struct RequestRow {
  std::string req_id;
  bool live = false;
  uint32_t generation = 0;         // bumped on add and remove: (row, generation) names a request
  uint32_t block_ids_version = 0;  // bumped when block ids are replaced, not appended
  int32_t prompt_len = 0;
  int32_t num_computed_tokens = 0;
  std::vector<int32_t> token_ids;               // prompt + output tokens
  std::vector<std::vector<int32_t>> block_ids;  // [num_groups][num_blocks held]
  std::vector<int32_t> mrope_positions;         // [mrope_num_dims, mrope_len]
  int32_t mrope_len = 0;
  int32_t mrope_position_delta = 0;

  int32_t num_tokens() const { return static_cast<int32_t>(token_ids.size()); }
};

class RequestTable {
 public:
  explicit RequestTable(RequestTableConfig config);

  // Adds a request and returns its row. An id already present is an error
  // unless `replace` (vLLM re-sends a streaming request or, with V2, a
  // resumed one under the same id): then the old state is dropped.
  int32_t add(const NewRequest& request, bool replace = false);

  // Removes a request; returns false for an unknown id (vLLM's finished ids
  // include requests aborted before the worker ever saw them).
  bool remove(std::string_view req_id);

  // Applies the deltas of one step, all or nothing.
  void update(const RequestUpdate* updates, size_t count);

  // Appends tokens (sampled by the model) to a request.
  void append_tokens(std::string_view req_id, Int32Span token_ids);
  void append_tokens_to_row(int32_t row, Int32Span token_ids);

  // Row of an id, or -1.
  int32_t find(std::string_view req_id) const;
  // Row of an id; throws "[BatchPacker] unknown request id ..." when absent.
  int32_t row_of(std::string_view req_id) const;

  const RequestRow& row(int32_t r) const { return rows_[static_cast<size_t>(r)]; }
  int32_t num_rows() const { return static_cast<int32_t>(rows_.size()); }
  int32_t num_requests() const { return num_live_; }
  int32_t num_groups() const { return static_cast<int32_t>(config_.kv_groups.size()); }
  const RequestTableConfig& config() const { return config_; }
  const KvGroupSpec& group(int32_t g) const { return config_.kv_groups[static_cast<size_t>(g)]; }
  int32_t max_model_len() const { return config_.max_model_len; }
  // Block-table capacity of a group, in vLLM blocks.
  int32_t max_blocks(int32_t g) const { return max_blocks_[static_cast<size_t>(g)]; }

  // Ids of the live requests, in row order.
  std::vector<std::string> request_ids() const;

 private:
  void check_block_ids(std::string_view req_id, const Int32Span* ids,
                       const RequestRow* append_to) const;
  void check_mrope(const NewRequest& request) const;
  int32_t take_free_row();
  // open-addressing index: id -> row (linear probing, backward-shift deletion)
  size_t slot_of(std::string_view req_id) const;  // slot holding the id, or an empty slot
  void index_insert(std::string_view req_id, int32_t row);
  void index_erase(std::string_view req_id);
  void index_rebuild(size_t capacity);

  RequestTableConfig config_;
  std::vector<int32_t> max_blocks_;  // [num_groups]
  std::vector<RequestRow> rows_;
  std::vector<int32_t> free_rows_;
  std::vector<int32_t> index_;  // row or -1
  size_t index_mask_ = 0;
  int32_t num_live_ = 0;
  // update(): duplicate detection and the rows resolved in its first pass
  std::vector<uint32_t> row_stamp_;
  uint32_t stamp_ = 0;
  std::vector<int32_t> update_rows_;
};

}  // namespace vllm_metal::runtime
