// BatchPacker: turns one step of scheduled requests into the flat arrays the
// kernels read, in buffers allocated once (pack() allocates nothing).
//
// Layout of a packed step (S = num_seqs, T = num_tokens, Tp = T padded, G = KV groups):
//   input_ids       int32 [Tp]         token ids; drafts follow each request's tokens
//   positions       int32 [Tp], or [mrope_num_dims, Tp] (row stride Tp) with M-RoPE
//   slot_mapping    int64 [G, Tp]      block_table[pos // B] * B + pos % B; -1 = skip
//                                      (padding tokens, state groups)
//   block_tables    int32 [S, width_g] per group, in kernel blocks, zero-padded;
//                                      width_g = max_blocks_g * (B_g / kernel B_g)
//   seq_lens        int32 [S]          context incl. this step's tokens
//   cu_seqlens_q    int32 [S + 1]
//   logits_indices  int32 [L]          token rows to sample: the last 1 + drafts of each
//   cu_num_logits   int32 [S + 1]      request's query (rejection sampling reads them)
//   req_rows        int32 [S]          batch index -> request-table row
//   discard_sampled uint8 [S]          1: a partial prefill chunk, its sample is dropped
//   input_sources   int32 [T]          with deferred samples (async scheduling): -1, or the
//                                      batch index, in the newest deferred step, of the
//                                      sample that this token is (input_ids holds a
//                                      placeholder there until the step is resolved)
// Rows: decode rows first (one new token, plus drafts), then prefill chunks,
// each group in the order scheduled. Which leading rows the decode kernel
// takes is split_decode_prefill()'s rule.
//
// Errors: std::invalid_argument with "[BatchPacker] ...". pack() validates the
// whole step before writing, so a rejected step leaves the previous step's
// outputs and the request table untouched.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "runtime/ngram_proposer.h"
#include "runtime/request_table.h"

namespace vllm_metal::runtime {

// Context length at which decode rows start going to the decode kernel.
constexpr int64_t kDecodeMinTotalContext = 512;

struct DecodePrefillSplit {
  int32_t num_decodes = 0;  // leading rows for the decode (split-KV) kernel
  int32_t num_decode_tokens = 0;
  int32_t num_prefills = 0;  // the remaining rows, for the varlen (prefill) kernel
  int32_t num_prefill_tokens = 0;
};

// A row is decode-like when it computes one new token (plus its drafts).
inline bool is_decode_row(int32_t num_scheduled_tokens, int32_t num_draft_tokens) {
  return num_scheduled_tokens - num_draft_tokens == 1;
}

// The decode/prefill split (issue 3). The first `num_decode_like` rows are
// decode-like; they go to the decode kernel together once their contexts add
// up to at least `min_total_context` tokens (sum of their seq_lens), which is
// when a split-KV decode pays for its extra launch. Below that they stay with
// the prefill rows in the varlen kernel (num_decodes = 0). The length of any
// single row does not matter: eight rows of 64 tokens go to the decode kernel,
// one row of 511 does not.
//   query_lens, seq_lens: [num_seqs]
DecodePrefillSplit split_decode_prefill(const int32_t* query_lens, const int32_t* seq_lens,
                                        int32_t num_decode_like, int32_t num_seqs,
                                        int64_t min_total_context = kDecodeMinTotalContext);

struct BatchPackerConfig {
  int32_t max_num_reqs = 0;            // sequences per step
  int32_t max_num_batched_tokens = 0;  // tokens per step, padding included
  int32_t max_model_len = 0;
  std::vector<KvGroupSpec> kv_groups;  // at least one
  int32_t mrope_num_dims = 0;          // 0: positions [Tp]; else [mrope_num_dims, Tp]
  int64_t decode_min_total_context = kDecodeMinTotalContext;
};

// Counts of the last packed step (the arrays are BatchPacker's accessors).
struct PackedBatch {
  int32_t num_seqs = 0;
  int32_t num_tokens = 0;         // T
  int32_t num_tokens_padded = 0;  // Tp >= T: row stride of positions and slot_mapping
  int32_t num_logits = 0;
  int32_t num_decode_like = 0;    // leading decode-like rows
  int64_t decode_context = 0;     // sum of their seq_lens
  DecodePrefillSplit split;
  int32_t max_query_len = 0;
  int32_t max_seq_len = 0;
};

class BatchPacker {
 public:
  explicit BatchPacker(BatchPackerConfig config);

  RequestTable& requests() { return table_; }
  const RequestTable& requests() const { return table_; }
  const BatchPackerConfig& config() const { return config_; }

  // ---- one step: begin_step, schedule each request, pack -----------------
  // schedule() checks the id and the counts it can check alone; an error
  // abandons the step (its staged requests are dropped).
  void begin_step();
  void schedule(std::string_view req_id, int32_t num_tokens, Int32Span draft_tokens = {});
  void schedule_row(int32_t row, int32_t num_tokens, Int32Span draft_tokens = {});
  // schedule() for n requests, the ids looked up together (faster on a cold
  // table); draft_tokens may be nullptr (no drafts).
  void schedule_many(const std::string_view* req_ids, const int32_t* num_tokens,
                     const Int32Span* draft_tokens, size_t n);
  // Packs the staged requests; pad_tokens_to > T pads the token arrays to that
  // length (input_ids 0, positions 0, slot -1) for fixed-shape graphs.
  const PackedBatch& pack(int32_t pad_tokens_to = 0);

  // After sampling: token_ids [num_seqs, stride] in the last step's batch
  // order, each row ending at its first negative entry (vLLM's -1 padding of
  // rejected drafts). Rows of partial prefill chunks are skipped. All or
  // nothing; once per packed step.
  void append_sampled(const int32_t* token_ids, int32_t num_seqs, int32_t stride);

  // ---- async scheduling: the next step is packed before this one's tokens exist ----
  // In place of append_sampled: appends a placeholder (kPlaceholderToken) to each row of
  // the last packed step that samples and remembers where. At most kMaxDeferredSteps
  // steps wait at once; a later pack() reports in input_sources() which of its tokens
  // are the newest deferred step's samples.
  void defer_sampled();
  // The oldest deferred step's tokens [num_seqs], in its batch order, written over its
  // placeholders. Rows that left the table, were replaced, rolled back or given new
  // tokens (V1 resume) since are skipped. All or nothing.
  void resolve_deferred(const int32_t* token_ids, int32_t num_seqs);
  int32_t num_deferred_steps() const { return num_deferred_; }
  static constexpr int32_t kPlaceholderToken = 0;
  static constexpr int32_t kMaxDeferredSteps = 2;

  // ---- speculative decoding: n-gram (prompt lookup) drafts -------------------------
  // For table rows [n], drafts from each row's history token_ids[0:num_tokens] by
  // ngram_propose() (runtime/ngram_proposer.h): drafts [n, k] row-major, row i's first
  // num_drafts[i] entries its drafts and the rest -1. Rows must be live (a row may
  // repeat). Validates everything before writing ("[BatchPacker] ..." for rows,
  // "[ngram] ..." for parameters); allocates nothing once its scratch has grown to max_n.
  void propose_ngram(const int32_t* rows, int32_t n, int32_t min_n, int32_t max_n, int32_t k,
                     int32_t max_model_len, int32_t* drafts, int32_t* num_drafts);

  // ---- the last packed step --------------------------------------------------------
  const PackedBatch& batch() const { return batch_; }
  const int32_t* input_ids() const { return input_ids_.data(); }
  const int32_t* positions() const { return positions_.data(); }
  const int64_t* slot_mapping(int32_t g) const {
    return slot_mapping_.data() + static_cast<size_t>(g) * batch_.num_tokens_padded;
  }
  const int32_t* block_table(int32_t g) const { return block_tables_[static_cast<size_t>(g)].data(); }
  int32_t block_table_width(int32_t g) const { return widths_[static_cast<size_t>(g)]; }
  // Columns of group g's block table that hold an id in some row of the last
  // step (the rest is padding): a consumer that copies may take only these.
  int32_t block_table_used_width(int32_t g) const { return used_widths_[static_cast<size_t>(g)]; }
  const int32_t* seq_lens() const { return seq_lens_.data(); }
  const int32_t* cu_seqlens_q() const { return cu_seqlens_q_.data(); }
  const int32_t* logits_indices() const { return logits_indices_.data(); }
  const int32_t* cu_num_logits() const { return cu_num_logits_.data(); }
  const int32_t* req_rows() const { return req_rows_.data(); }
  const uint8_t* discard_sampled() const { return discard_sampled_.data(); }
  // [T], valid when num_input_sources() > 0 (see the layout above)
  const int32_t* input_sources() const { return input_sources_.data(); }
  int32_t num_input_sources() const { return num_input_sources_; }
  int32_t num_groups() const { return table_.num_groups(); }
  int32_t position_dims() const { return config_.mrope_num_dims > 0 ? config_.mrope_num_dims : 1; }

 private:
  struct Staged {
    int32_t row;
    uint32_t generation;
    int32_t num_tokens;
    int32_t draft_offset;  // into staged_drafts_
    int32_t num_drafts;
  };
  // What a batch slot's block-table rows hold (to rewrite only what changed).
  struct SlotCache {
    int32_t row = -1;
    uint32_t generation = 0;
    uint32_t block_ids_version = 0;
  };

  // A placeholder a step appended: token_ids[index] of (row, generation), valid while the
  // row's tokens_version is unchanged (a rollback or a token resync voids it).
  struct DeferredSample {
    int32_t row = -1;  // -1: the batch row does not sample (partial prefill chunk)
    uint32_t generation = 0;
    uint32_t tokens_version = 0;
    int32_t index = 0;
  };
  struct DeferredStep {
    uint64_t serial = 0;
    std::vector<DeferredSample> samples;  // [num_seqs] in that step's batch order
  };
  // The newest deferred placeholder of each table row; a serial below the oldest waiting
  // step's (0 included) means its step was resolved.
  struct RowPlaceholder {
    uint64_t serial = 0;
    DeferredSample sample;
    int32_t batch = 0;  // its step's batch index
  };

  void validate_staged(int32_t pad_tokens_to);
  void check_sampling_rows(const char* what, const int32_t* counts) const;
  const DeferredStep* newest_deferred() const;
  // The sample's row still holds that request and token list (not left, replaced or rolled back).
  bool placeholder_current(const DeferredSample& s) const;
  // The placeholder of row r within tokens [begin, end), from a step still deferred, or null.
  const RowPlaceholder* placeholder_in(int32_t r, int64_t begin, int64_t end) const;
  void write_input_sources();
  void prefetch_request(const Staged& s) const;
  void write_request(int32_t b, const Staged& s, int32_t query_start, int32_t logits_start);

  BatchPackerConfig config_;
  RequestTable table_;

  // staging
  std::vector<Staged> staged_;
  std::vector<int32_t> staged_drafts_;
  int32_t staged_num_drafts_ = 0;
  std::vector<uint32_t> row_stamp_;  // duplicate detection, per table row
  uint32_t stamp_ = 0;
  std::vector<int32_t> order_;  // batch index -> staged index
  std::vector<int32_t> many_rows_;  // schedule_many's lookups

  // outputs
  PackedBatch batch_;
  bool sampled_appended_ = true;
  std::vector<uint32_t> batch_generations_;  // [max_num_reqs] generation of each req_rows entry
  std::vector<int32_t> input_ids_;           // [max_num_batched_tokens]
  std::vector<int32_t> positions_;           // [dims * max_num_batched_tokens]
  std::vector<int64_t> slot_mapping_;        // [G * max_num_batched_tokens]
  std::vector<std::vector<int32_t>> block_tables_;  // G x [max_num_reqs * width_g]
  std::vector<int32_t> widths_;                     // [G]
  std::vector<int32_t> used_widths_;                // [G] of the last step
  std::vector<int32_t> entries_written_;            // [G * max_num_reqs]
  std::vector<SlotCache> slot_cache_;               // [max_num_reqs]
  std::vector<int32_t> seq_lens_;        // [max_num_reqs]
  std::vector<int32_t> query_lens_;      // [max_num_reqs]
  std::vector<int32_t> cu_seqlens_q_;    // [max_num_reqs + 1]
  std::vector<int32_t> logits_indices_;  // [max_num_batched_tokens]
  std::vector<int32_t> cu_num_logits_;   // [max_num_reqs + 1]
  std::vector<int32_t> req_rows_;        // [max_num_reqs]
  std::vector<uint8_t> discard_sampled_;  // [max_num_reqs]
  std::vector<int32_t> input_sources_;    // [max_num_batched_tokens]
  std::vector<int32_t> sample_counts_;    // [max_num_reqs] scratch: tokens each row appends
  int32_t num_input_sources_ = 0;

  // deferred samples: a ring of kMaxDeferredSteps, oldest at first_deferred_
  DeferredStep deferred_[kMaxDeferredSteps];
  int32_t first_deferred_ = 0;
  int32_t num_deferred_ = 0;
  uint64_t deferred_serial_ = 0;
  std::vector<RowPlaceholder> row_placeholders_;  // [table rows]

  std::vector<int32_t> ngram_failure_;  // [max_n] scratch of propose_ngram
};

}  // namespace vllm_metal::runtime
