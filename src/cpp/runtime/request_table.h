// RequestTable: the worker's persistent copy of every request vLLM's scheduler
// has sent it (request id -> tokens, number computed, block ids per KV-cache
// group, M-RoPE positions), updated from each step's deltas.
//
// Plain C++17: no MLX, no Python. Storage is by row, and rows are reused after
// a request leaves, so a steady-state step allocates nothing (the table grows
// past `initial_rows` rows, and a row's token list past its earlier occupants'
// longest, by doubling). What a step reads is kept dense: RowState per row,
// block ids in one flat [rows, max_blocks] table per group with each row's
// last id beside the counts, ids up to 63 bytes in a key array; the cold rest
// (the id string, tokens, M-RoPE positions) sits in RequestRow.
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
  int32_t initial_rows = 64;         // rows allocated up front (the table grows past them)
  // Rows of removed requests wait for release_retired_rows() before reuse, so
  // a packed step's rows keep their ids until the next step (the packer's mode).
  bool defer_row_reuse = false;
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

// The per-request fields a step reads, contiguous by row: packing a step
// touches these, the block ids it needs and (for prefill chunks) the tokens.
struct RowState {
  int32_t num_computed_tokens = 0;
  int32_t num_tokens = 0;          // prompt + output
  int32_t prompt_len = 0;
  int32_t last_token = 0;          // token_ids[num_tokens - 1]: a decode's input
  uint32_t generation = 0;         // bumped on add and remove: (row, generation) names a request
  uint32_t block_ids_version = 0;  // bumped when block ids are replaced, not appended
  uint32_t tokens_version = 0;     // bumped when tokens are replaced or rolled back
  int32_t live = 0;
};

// The rest of a request. Vectors keep their capacity when the row is reused.
struct RequestRow {
  std::string req_id;  // kept after removal until the row is reused
  std::vector<int32_t> token_ids;        // prompt + output tokens
  std::vector<int32_t> mrope_positions;  // [mrope_num_dims, mrope_len]
  int32_t mrope_len = 0;
  int32_t mrope_position_delta = 0;
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
  // With defer_row_reuse: makes the rows removed so far reusable.
  void release_retired_rows();

  // Applies the deltas of one step, all or nothing.
  void update(const RequestUpdate* updates, size_t count);

  // Appends tokens (sampled by the model) to a request.
  void append_tokens(std::string_view req_id, Int32Span token_ids);
  void append_tokens_to_row(int32_t row, Int32Span token_ids);
  // Sets token_ids[index] of a live row (index < its num_tokens): a deferred sample's
  // placeholder becomes the sampled token.
  void overwrite_token(int32_t row, int32_t index, int32_t token_id);

  // Row of an id, or -1.
  int32_t find(std::string_view req_id) const;
  // Rows of n ids (-1 for unknown ones); looks them up in groups, requesting
  // each group's cache lines before reading any (a step's ids are cold).
  void find_many(const std::string_view* req_ids, size_t n, int32_t* rows) const;
  // Row of an id; throws "[BatchPacker] unknown request id ..." when absent.
  int32_t row_of(std::string_view req_id) const;

  const RowState& state(int32_t r) const { return states_[static_cast<size_t>(r)]; }
  const RequestRow& row(int32_t r) const { return rows_[static_cast<size_t>(r)]; }
  // Block ids of row r in group g: [num_blocks(r, g)], in a flat [rows, max_blocks(g)] table.
  const int32_t* block_ids(int32_t r, int32_t g) const {
    return blocks_[static_cast<size_t>(g)].data() + static_cast<size_t>(r) * max_blocks(g);
  }
  // Copies of row r's block ids, one list per group.
  std::vector<std::vector<int32_t>> block_id_lists(int32_t r) const;
  int32_t num_blocks(int32_t r, int32_t g) const {
    return num_blocks_[static_cast<size_t>(r) * config_.kv_groups.size() + static_cast<size_t>(g)];
  }
  // block_ids(r, g)[num_blocks(r, g) - 1], kept next to the counts: a decode
  // row's block is usually its last one, and the flat table's rows lie a page
  // apart (a cold step would pay a TLB miss per row to read it there).
  int32_t last_block_id(int32_t r, int32_t g) const {
    return last_block_[static_cast<size_t>(r) * config_.kv_groups.size() + static_cast<size_t>(g)];
  }
  // Block i of row r in group g (i < num_blocks(r, g)).
  int32_t block_id(int32_t r, int32_t g, int32_t i) const {
    return i == num_blocks(r, g) - 1 ? last_block_id(r, g) : block_ids(r, g)[i];
  }
  int32_t num_rows() const { return static_cast<int32_t>(rows_.size()); }
  bool is_live(int32_t r) const { return r >= 0 && r < num_rows() && state(r).live; }
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
  // append_to: the row the ids are appended to, or -1 when they replace the held ones
  void check_block_ids(std::string_view req_id, const Int32Span* ids, int32_t append_to) const;
  void set_tokens(int32_t r, Int32Span token_ids);
  void set_block_ids(int32_t r, const Int32Span* ids, bool append);
  void check_mrope(const NewRequest& request) const;
  int32_t take_free_row();
  // Open-addressing index: id -> row (linear probing, backward-shift
  // deletion). A slot keeps the row and 32 bits of the id's hash; an id is
  // confirmed against its row's key, which ids up to kKeyInline bytes keep in
  // a dense array (longer ones: the row's req_id).
  struct IndexSlot {
    int32_t row = -1;
    uint32_t tag = 0;
  };
  static constexpr size_t kKeyBytes = 64;
  static constexpr size_t kKeyInline = kKeyBytes - 1;  // the last byte holds the length
  // slot holding the id, or the empty slot ending its probe run, from slot `s`
  size_t probe(std::string_view req_id, uint64_t hash, size_t s) const;
  bool key_equals(int32_t row, std::string_view req_id) const;
  void set_key(int32_t row, std::string_view req_id, uint64_t hash);
  void index_insert(int32_t row);
  void index_erase(int32_t row);
  void index_rebuild(size_t capacity);

  RequestTableConfig config_;
  std::vector<int32_t> max_blocks_;  // [num_groups]
  std::vector<RowState> states_;    // [rows]
  std::vector<RequestRow> rows_;    // [rows]
  std::vector<std::vector<int32_t>> blocks_;  // [groups][rows * max_blocks(g)]
  std::vector<int32_t> num_blocks_;           // [rows * groups]
  std::vector<int32_t> last_block_;           // [rows * groups]
  std::vector<int32_t> free_rows_;
  std::vector<int32_t> retired_rows_;  // removed, not yet reusable (defer_row_reuse)
  std::vector<IndexSlot> index_;
  size_t index_mask_ = 0;
  std::vector<uint64_t> row_hash_;  // [rows] hash of the row's id
  std::vector<char> keys_;          // [rows * kKeyBytes]
  int32_t num_live_ = 0;
  // update(): duplicate detection and the rows resolved in its first pass
  std::vector<uint32_t> row_stamp_;
  uint32_t stamp_ = 0;
  std::vector<std::string_view> update_ids_;
  std::vector<int32_t> update_rows_;
};

}  // namespace vllm_metal::runtime
