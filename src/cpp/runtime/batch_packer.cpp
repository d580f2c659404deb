#include "runtime/batch_packer.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

namespace vllm_metal::runtime {

namespace {

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("[BatchPacker] " + what);
}

std::string quoted(std::string_view id) { return "'" + std::string(id) + "'"; }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Rows live at scattered heap addresses; a step walks hundreds of them, so
// their cache lines are requested a few rows ahead.
inline void prefetch(const void* p) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p);
#else
  (void)p;
#endif
}
constexpr size_t kPrefetchAhead = 6;

RequestTableConfig table_config(const BatchPackerConfig& c) {
  RequestTableConfig t;
  t.max_model_len = c.max_model_len;
  t.kv_groups = c.kv_groups;
  t.mrope_num_dims = c.mrope_num_dims;
  t.defer_row_reuse = true;  // the last packed step's rows keep their ids
  t.initial_rows = 2 * c.max_num_reqs;
  return t;
}

}  // namespace

DecodePrefillSplit split_decode_prefill(const int32_t* query_lens, const int32_t* seq_lens,
                                        int32_t num_decode_like, int32_t num_seqs,
                                        int64_t min_total_context) {
  int64_t context = 0;
  for (int32_t i = 0; i < num_decode_like; ++i) context += seq_lens[i];
  DecodePrefillSplit split;
  split.num_decodes = context >= min_total_context ? num_decode_like : 0;
  for (int32_t i = 0; i < num_seqs; ++i) {
    if (i < split.num_decodes) {
      split.num_decode_tokens += query_lens[i];
    } else {
      split.num_prefill_tokens += query_lens[i];
    }
  }
  split.num_prefills = num_seqs - split.num_decodes;
  return split;
}

BatchPacker::BatchPacker(BatchPackerConfig config)
    : config_(std::move(config)), table_(table_config(config_)) {
  if (config_.max_num_reqs <= 0 || config_.max_num_batched_tokens <= 0) {
    fail("max_num_reqs and max_num_batched_tokens must be positive, got " +
         std::to_string(config_.max_num_reqs) + " and " +
         std::to_string(config_.max_num_batched_tokens));
  }
  const auto R = static_cast<size_t>(config_.max_num_reqs);
  const auto T = static_cast<size_t>(config_.max_num_batched_tokens);
  const auto G = static_cast<size_t>(table_.num_groups());
  staged_.reserve(R);
  row_stamp_.reserve(2 * R);  // grows with the table only (initial_rows = 2 * R)
  staged_drafts_.resize(T);
  order_.resize(R);
  many_rows_.resize(R);
  batch_generations_.resize(R);
  input_ids_.assign(T, 0);
  positions_.assign(static_cast<size_t>(position_dims()) * T, 0);
  slot_mapping_.assign(G * T, -1);
  for (int32_t g = 0; g < table_.num_groups(); ++g) {
    const KvGroupSpec& spec = table_.group(g);
    const int32_t width = table_.max_blocks(g) * (spec.block_size / spec.kernel_block_size);
    widths_.push_back(width);
    used_widths_.push_back(0);
    block_tables_.emplace_back(R * static_cast<size_t>(width), 0);
  }
  entries_written_.assign(G * R, 0);
  slot_cache_.resize(R);
  seq_lens_.assign(R, 0);
  query_lens_.assign(R, 0);
  cu_seqlens_q_.assign(R + 1, 0);
  logits_indices_.assign(T, 0);
  cu_num_logits_.assign(R + 1, 0);
  req_rows_.assign(R, 0);
  discard_sampled_.assign(R, 0);
  input_sources_.assign(T, -1);
  sample_counts_.assign(R, 0);
  for (DeferredStep& d : deferred_) d.samples.reserve(R);
  row_placeholders_.reserve(2 * R);  // grows with the table only
}

// ---- staging -----------------------------------------------------------------------

void BatchPacker::begin_step() {
  staged_.clear();
  staged_num_drafts_ = 0;
}

void BatchPacker::schedule(std::string_view req_id, int32_t num_tokens, Int32Span draft_tokens) {
  const int32_t row = table_.find(req_id);
  if (row < 0) {
    begin_step();
    fail("unknown request id " + quoted(req_id) + " scheduled");
  }
  schedule_row(row, num_tokens, draft_tokens);
}

void BatchPacker::schedule_many(const std::string_view* req_ids, const int32_t* num_tokens,
                                const Int32Span* draft_tokens, size_t n) {
  if (staged_.size() + n > static_cast<size_t>(config_.max_num_reqs)) {
    begin_step();
    fail("more than max_num_reqs = " + std::to_string(config_.max_num_reqs) +
         " requests scheduled in one step (" + std::to_string(n) + ")");
  }
  table_.find_many(req_ids, n, many_rows_.data());
  for (size_t i = 0; i < n; ++i) {
    if (many_rows_[i] < 0) {
      begin_step();
      fail("unknown request id " + quoted(req_ids[i]) + " scheduled");
    }
  }
  for (size_t i = 0; i < n; ++i) {
    schedule_row(many_rows_[i], num_tokens[i], draft_tokens ? draft_tokens[i] : Int32Span());
  }
}

void BatchPacker::schedule_row(int32_t row, int32_t num_tokens, Int32Span draft_tokens) {
  const auto abandon = [this](const std::string& what) {
    begin_step();
    fail(what);
  };
  if (!table_.is_live(row)) abandon("row " + std::to_string(row) + " holds no request");
  // the id (cold storage) is read for error messages only
  const auto id = [&] { return quoted(table_.row(row).req_id); };
  if (static_cast<int32_t>(staged_.size()) >= config_.max_num_reqs) {
    abandon("more than max_num_reqs = " + std::to_string(config_.max_num_reqs) +
            " requests scheduled in one step (at " + id() + ")");
  }
  const auto num_drafts = static_cast<int64_t>(draft_tokens.size);
  if (num_tokens < 1 || num_drafts > num_tokens - 1) {
    abandon("request " + id() + ": expected 1 + drafts <= num_tokens, got num_tokens " +
            std::to_string(num_tokens) + " with " + std::to_string(num_drafts) + " drafts");
  }
  if (staged_num_drafts_ + num_drafts > config_.max_num_batched_tokens) {
    abandon("more draft tokens than max_num_batched_tokens = " +
            std::to_string(config_.max_num_batched_tokens) + " in one step");
  }
  std::copy(draft_tokens.begin(), draft_tokens.end(),
            staged_drafts_.begin() + staged_num_drafts_);
  staged_.push_back(Staged{row, table_.state(row).generation, num_tokens, staged_num_drafts_,
                           static_cast<int32_t>(num_drafts)});
  staged_num_drafts_ += static_cast<int32_t>(num_drafts);
}

// ---- pack ----------------------------------------------------------------------------

void BatchPacker::validate_staged(int32_t pad_tokens_to) {
  if (row_stamp_.size() < static_cast<size_t>(table_.num_rows())) {
    row_stamp_.resize(static_cast<size_t>(table_.num_rows()), 0);
  }
  stamp_ += 1;
  int64_t total = 0;
  for (const Staged& s : staged_) {
    if (!table_.is_live(s.row) || table_.state(s.row).generation != s.generation) {
      fail("a request scheduled in this step left the table before pack()");
    }
    const RowState& st = table_.state(s.row);
    const auto id = [&] { return quoted(table_.row(s.row).req_id); };
    if (row_stamp_[static_cast<size_t>(s.row)] == stamp_) {
      fail("request " + id() + " scheduled twice in one step");
    }
    row_stamp_[static_cast<size_t>(s.row)] = stamp_;
    const int64_t c = st.num_computed_tokens;
    const int64_t end = c + s.num_tokens;  // seq_len
    if (end - s.num_drafts > st.num_tokens) {
      fail("request " + id() + ": " + std::to_string(s.num_tokens - s.num_drafts) +
           " tokens scheduled after " + std::to_string(c) + " computed need " +
           std::to_string(end - s.num_drafts) + " known tokens, the request has " +
           std::to_string(st.num_tokens) + " (append the sampled tokens first)");
    }
    const RowPlaceholder* ph = placeholder_in(s.row, c, end - s.num_drafts);
    if (ph && ph->serial != newest_deferred()->serial) {
      fail("request " + id() + ": its input token " + std::to_string(ph->sample.index) +
           " is the sample of a deferred step older than the newest (resolve_deferred first)");
    }
    if (end > table_.max_model_len()) {
      fail("request " + id() + ": seq_len " + std::to_string(end) + " exceeds max_model_len " +
           std::to_string(table_.max_model_len()));
    }
    for (int32_t g = 0; g < table_.num_groups(); ++g) {
      const KvGroupSpec& spec = table_.group(g);
      if (!spec.paged) continue;
      const int64_t need = ceil_div(end, spec.block_size);
      const int64_t held = table_.num_blocks(s.row, g);
      if (need > held) {
        fail("request " + id() + ": " + std::to_string(end) + " tokens need " +
             std::to_string(need) + " blocks of " + std::to_string(spec.block_size) +
             " in KV group " + std::to_string(g) + ", the block table holds " +
             std::to_string(held));
      }
    }
    total += s.num_tokens;
  }
  if (total > config_.max_num_batched_tokens || pad_tokens_to > config_.max_num_batched_tokens) {
    fail("step of " + std::to_string(std::max<int64_t>(total, pad_tokens_to)) +
         " tokens exceeds max_num_batched_tokens " +
         std::to_string(config_.max_num_batched_tokens));
  }
  if (pad_tokens_to < 0) fail("pad_tokens_to must be >= 0, got " + std::to_string(pad_tokens_to));
}

const PackedBatch& BatchPacker::pack(int32_t pad_tokens_to) {
  validate_staged(pad_tokens_to);  // throws before anything is written

  // Order: decode-like rows first, then prefill chunks, each in scheduled order.
  const auto n = static_cast<int32_t>(staged_.size());
  int32_t num_decode_like = 0;
  for (int32_t i = 0; i < n; ++i) {
    const Staged& s = staged_[static_cast<size_t>(i)];
    if (is_decode_row(s.num_tokens, s.num_drafts)) order_[static_cast<size_t>(num_decode_like++)] = i;
  }
  int32_t k = num_decode_like;
  for (int32_t i = 0; i < n; ++i) {
    const Staged& s = staged_[static_cast<size_t>(i)];
    if (!is_decode_row(s.num_tokens, s.num_drafts)) order_[static_cast<size_t>(k++)] = i;
  }

  PackedBatch& out = batch_;
  out = PackedBatch{};
  out.num_seqs = n;
  out.num_decode_like = num_decode_like;
  int32_t total = 0;
  for (const Staged& s : staged_) total += s.num_tokens;
  out.num_tokens = total;
  out.num_tokens_padded = std::max(total, pad_tokens_to);

  std::fill(used_widths_.begin(), used_widths_.end(), 0);
  int32_t query_start = 0;
  int32_t logits_start = 0;
  cu_seqlens_q_[0] = 0;
  cu_num_logits_[0] = 0;
  for (int32_t b = 0; b < n; ++b) {
    if (static_cast<size_t>(b) + kPrefetchAhead < static_cast<size_t>(n)) {
      prefetch_request(staged_[static_cast<size_t>(order_[static_cast<size_t>(b) + kPrefetchAhead])]);
    }
    const Staged& s = staged_[static_cast<size_t>(order_[static_cast<size_t>(b)])];
    write_request(b, s, query_start, logits_start);
    query_start += s.num_tokens;
    logits_start += s.num_drafts + 1;
    cu_seqlens_q_[static_cast<size_t>(b) + 1] = query_start;
    cu_num_logits_[static_cast<size_t>(b) + 1] = logits_start;
    out.max_query_len = std::max(out.max_query_len, s.num_tokens);
    out.max_seq_len = std::max(out.max_seq_len, seq_lens_[static_cast<size_t>(b)]);
    if (b < num_decode_like) out.decode_context += seq_lens_[static_cast<size_t>(b)];
  }
  out.num_logits = logits_start;

  // padding tokens: id 0, position 0, no cache write
  const int32_t Tp = out.num_tokens_padded;
  const size_t pad = static_cast<size_t>(Tp - total);
  if (pad > 0) {
    std::fill_n(input_ids_.begin() + total, pad, 0);
    for (int32_t d = 0; d < position_dims(); ++d) {
      std::fill_n(positions_.begin() + static_cast<ptrdiff_t>(d) * Tp + total, pad, 0);
    }
  }
  for (int32_t g = 0; g < table_.num_groups(); ++g) {
    int64_t* slots = slot_mapping_.data() + static_cast<size_t>(g) * Tp;
    if (!table_.group(g).paged) {
      std::fill_n(slots, Tp, -1);
    } else if (pad > 0) {
      std::fill_n(slots + total, pad, -1);
    }
  }

  out.split = split_decode_prefill(query_lens_.data(), seq_lens_.data(), num_decode_like, n,
                                   config_.decode_min_total_context);
  write_input_sources();
  sampled_appended_ = false;
  table_.release_retired_rows();  // rows removed before this step are no longer referenced
  staged_.clear();
  staged_num_drafts_ = 0;
  return out;
}

// Requests the cache lines write_request() reads for a row that is not a plain
// decode (those read the dense per-row state only); state is warm from validation.
void BatchPacker::prefetch_request(const Staged& s) const {
  const RowState& st = table_.state(s.row);
  const int32_t c = st.num_computed_tokens;
  if (is_decode_row(s.num_tokens, s.num_drafts) && c + 1 == st.num_tokens) return;
  const std::vector<int32_t>& tokens = table_.row(s.row).token_ids;
  if (static_cast<size_t>(c) < tokens.size()) prefetch(tokens.data() + c);
  for (int32_t g = 0; g < table_.num_groups(); ++g) {
    const int32_t blk = c / table_.group(g).block_size;
    if (blk < table_.num_blocks(s.row, g)) prefetch(table_.block_ids(s.row, g) + blk);
  }
}

// Writes batch row b (request s) into every output. Never throws.
void BatchPacker::write_request(int32_t b, const Staged& s, int32_t query_start,
                                int32_t logits_start) {
  const RowState& st = table_.state(s.row);
  const size_t bi = static_cast<size_t>(b);
  const int32_t c = st.num_computed_tokens;
  const int32_t q = s.num_tokens;
  const int32_t known = q - s.num_drafts;  // tokens from the table; the drafts follow
  const int32_t seq_len = c + q;
  const int32_t Tp = batch_.num_tokens_padded;

  // input_ids (a decode of the last token reads it from the row state)
  int32_t* ids = input_ids_.data() + query_start;
  if (known == 1 && c + 1 == st.num_tokens) {
    ids[0] = st.last_token;
  } else {
    std::memcpy(ids, table_.row(s.row).token_ids.data() + c,
                sizeof(int32_t) * static_cast<size_t>(known));
  }
  std::memcpy(ids + known, staged_drafts_.data() + s.draft_offset,
              sizeof(int32_t) * static_cast<size_t>(s.num_drafts));

  // positions: c .. c+q-1, or M-RoPE rows (precomputed up to mrope_len, then pos + delta)
  if (config_.mrope_num_dims == 0) {
    int32_t* pos = positions_.data() + query_start;
    for (int32_t t = 0; t < q; ++t) pos[t] = c + t;
  } else {
    const RequestRow& row = table_.row(s.row);
    const int32_t L = row.mrope_len;
    for (int32_t d = 0; d < config_.mrope_num_dims; ++d) {
      int32_t* pos = positions_.data() + static_cast<size_t>(d) * Tp + query_start;
      const int32_t* pre = row.mrope_positions.data() + static_cast<size_t>(d) * L;
      for (int32_t t = 0; t < q; ++t) {
        const int32_t p = c + t;
        pos[t] = p < L ? pre[p] : p + row.mrope_position_delta;
      }
    }
  }

  const SlotCache& cached = slot_cache_[bi];
  const bool same = cached.row == s.row && cached.generation == st.generation &&
                    cached.block_ids_version == st.block_ids_version;
  for (int32_t g = 0; g < table_.num_groups(); ++g) {
    const KvGroupSpec& spec = table_.group(g);
    const int32_t* held = table_.block_ids(s.row, g);  // read only for blocks before the last
    // slot_mapping, one block-sized run at a time
    if (spec.paged) {
      int64_t* slots = slot_mapping_.data() + static_cast<size_t>(g) * Tp + query_start;
      const int32_t B = spec.block_size;
      int32_t t = 0;
      while (t < q) {
        const int32_t p = c + t;
        const int32_t off = p % B;
        const int32_t run = std::min(B - off, q - t);
        const int64_t base = static_cast<int64_t>(table_.block_id(s.row, g, p / B)) * B + off;
        for (int32_t j = 0; j < run; ++j) slots[t + j] = base + j;
        t += run;
      }
    }
    // block table row in kernel blocks: entry e = held[e / k] * k + e % k
    const int32_t kb = spec.block_size / spec.kernel_block_size;
    const int32_t need = spec.paged
                             ? static_cast<int32_t>(ceil_div(seq_len, spec.kernel_block_size))
                             : table_.num_blocks(s.row, g) * kb;
    int32_t* table = block_tables_[static_cast<size_t>(g)].data() +
                     bi * static_cast<size_t>(widths_[static_cast<size_t>(g)]);
    int32_t& written = entries_written_[static_cast<size_t>(g) * config_.max_num_reqs + bi];
    // entries [0, min(written, need)) already hold this request's ids when `same`
    const int32_t from = same ? std::min(written, need) : 0;
    if (kb == 1 && need - from > 1) {
      std::memcpy(table + from, held + from, sizeof(int32_t) * static_cast<size_t>(need - from));
    } else {
      for (int32_t e = from; e < need; ++e) table[e] = table_.block_id(s.row, g, e / kb) * kb + e % kb;
    }
    if (written > need) std::fill(table + need, table + written, 0);
    written = need;
    used_widths_[static_cast<size_t>(g)] = std::max(used_widths_[static_cast<size_t>(g)], need);
  }
  slot_cache_[bi] = SlotCache{s.row, st.generation, st.block_ids_version};

  seq_lens_[bi] = seq_len;
  query_lens_[bi] = q;
  int32_t* logits = logits_indices_.data() + logits_start;
  const int32_t first = query_start + known - 1;
  for (int32_t j = 0; j <= s.num_drafts; ++j) logits[j] = first + j;
  req_rows_[bi] = s.row;
  batch_generations_[bi] = st.generation;
  discard_sampled_[bi] = c + known < st.num_tokens ? 1 : 0;
}

// ---- after sampling ---------------------------------------------------------------

void BatchPacker::append_sampled(const int32_t* token_ids, int32_t num_seqs, int32_t stride) {
  if (sampled_appended_) {
    fail("append_sampled: no packed step is waiting for its sampled tokens");
  }
  if (num_seqs != batch_.num_seqs || stride < 1) {
    fail("append_sampled: expected token_ids [" + std::to_string(batch_.num_seqs) +
         ", k >= 1] in the last step's batch order, got [" + std::to_string(num_seqs) + ", " +
         std::to_string(stride) + "]");
  }
  const auto count_of = [&](int32_t b) {
    const int32_t* r = token_ids + static_cast<size_t>(b) * stride;
    int32_t k = 0;
    while (k < stride && r[k] >= 0) ++k;
    return k;
  };
  int32_t* counts = sample_counts_.data();
  for (int32_t b = 0; b < num_seqs; ++b) counts[b] = count_of(b);
  check_sampling_rows("append_sampled", counts);
  for (int32_t b = 0; b < num_seqs; ++b) {
    const size_t bi = static_cast<size_t>(b);
    if (bi + kPrefetchAhead < static_cast<size_t>(num_seqs)) {
      const std::vector<int32_t>& ahead = table_.row(req_rows_[bi + kPrefetchAhead]).token_ids;
      if (!ahead.empty()) prefetch(ahead.data() + ahead.size() - 1);  // where tokens go
    }
    if (discard_sampled_[bi]) continue;
    table_.append_tokens_to_row(req_rows_[bi],
                                Int32Span(token_ids + bi * static_cast<size_t>(stride),
                                          static_cast<size_t>(counts[b])));
  }
  sampled_appended_ = true;
}

// Every sampling row of the last step must still be its request and have room for
// counts[b] more tokens. Reads each row's header, which the writes then find cached.
void BatchPacker::check_sampling_rows(const char* what, const int32_t* counts) const {
  for (int32_t b = 0; b < batch_.num_seqs; ++b) {
    const size_t bi = static_cast<size_t>(b);
    if (discard_sampled_[bi]) continue;
    const int32_t r = req_rows_[bi];
    if (!table_.is_live(r) || table_.state(r).generation != batch_generations_[bi]) {
      fail(std::string(what) + ": the request of batch row " + std::to_string(b) +
           " left the table after pack()");
    }
    if (table_.state(r).num_tokens + counts[b] > table_.max_model_len()) {
      fail(std::string(what) + ": request " + quoted(table_.row(r).req_id) +
           " would exceed max_model_len " + std::to_string(table_.max_model_len()));
    }
    prefetch(&table_.row(r));  // the token list's header
  }
}

// ---- deferred samples (async scheduling) -------------------------------------------

void BatchPacker::defer_sampled() {
  if (sampled_appended_) fail("defer_sampled: no packed step is waiting for its sampled tokens");
  if (num_deferred_ == kMaxDeferredSteps) {
    fail("defer_sampled: " + std::to_string(kMaxDeferredSteps) +
         " steps already wait for their tokens (resolve_deferred the oldest first)");
  }
  const int32_t n = batch_.num_seqs;
  std::fill_n(sample_counts_.begin(), n, 1);
  check_sampling_rows("defer_sampled", sample_counts_.data());
  if (row_placeholders_.size() < static_cast<size_t>(table_.num_rows())) {
    row_placeholders_.resize(static_cast<size_t>(table_.num_rows()));
  }
  DeferredStep& d = deferred_[(first_deferred_ + num_deferred_) % kMaxDeferredSteps];
  d.serial = ++deferred_serial_;
  d.samples.assign(static_cast<size_t>(n), DeferredSample{});
  const int32_t placeholder = kPlaceholderToken;
  for (int32_t b = 0; b < n; ++b) {
    const size_t bi = static_cast<size_t>(b);
    if (discard_sampled_[bi]) continue;
    const int32_t r = req_rows_[bi];
    const RowState& st = table_.state(r);
    d.samples[bi] = DeferredSample{r, st.generation, st.tokens_version, st.num_tokens};
    row_placeholders_[static_cast<size_t>(r)] = RowPlaceholder{d.serial, d.samples[bi], b};
    table_.append_tokens_to_row(r, Int32Span(&placeholder, 1));
  }
  num_deferred_ += 1;
  sampled_appended_ = true;
}

void BatchPacker::resolve_deferred(const int32_t* token_ids, int32_t num_seqs) {
  if (num_deferred_ == 0) fail("resolve_deferred: no step is waiting for its tokens");
  DeferredStep& d = deferred_[first_deferred_];
  if (static_cast<size_t>(num_seqs) != d.samples.size()) {
    fail("resolve_deferred: expected the " + std::to_string(d.samples.size()) +
         " tokens of the oldest deferred step, got " + std::to_string(num_seqs));
  }
  for (int32_t b = 0; b < num_seqs; ++b) {
    if (d.samples[static_cast<size_t>(b)].row >= 0 && token_ids[b] < 0) {
      fail("resolve_deferred: batch row " + std::to_string(b) + " has no token (" +
           std::to_string(token_ids[b]) + ")");
    }
  }
  for (int32_t b = 0; b < num_seqs; ++b) {
    const DeferredSample& s = d.samples[static_cast<size_t>(b)];
    if (placeholder_current(s)) table_.overwrite_token(s.row, s.index, token_ids[b]);
  }
  first_deferred_ = (first_deferred_ + 1) % kMaxDeferredSteps;
  num_deferred_ -= 1;
}

const BatchPacker::DeferredStep* BatchPacker::newest_deferred() const {
  if (num_deferred_ == 0) return nullptr;
  return &deferred_[(first_deferred_ + num_deferred_ - 1) % kMaxDeferredSteps];
}

const BatchPacker::RowPlaceholder* BatchPacker::placeholder_in(int32_t r, int64_t begin,
                                                               int64_t end) const {
  if (num_deferred_ == 0 || static_cast<size_t>(r) >= row_placeholders_.size()) return nullptr;
  const RowPlaceholder& ph = row_placeholders_[static_cast<size_t>(r)];
  if (ph.serial < deferred_[first_deferred_].serial || !placeholder_current(ph.sample)) return nullptr;
  return ph.sample.index >= begin && ph.sample.index < end ? &ph : nullptr;
}

bool BatchPacker::placeholder_current(const DeferredSample& s) const {
  if (s.row < 0 || !table_.is_live(s.row)) return false;
  const RowState& st = table_.state(s.row);
  return st.generation == s.generation && st.tokens_version == s.tokens_version;
}

void BatchPacker::write_input_sources() {
  num_input_sources_ = 0;
  if (num_deferred_ == 0) return;
  std::fill_n(input_sources_.begin(), batch_.num_tokens, -1);
  for (int32_t b = 0; b < batch_.num_seqs; ++b) {
    const size_t bi = static_cast<size_t>(b);
    const int32_t begin = seq_lens_[bi] - query_lens_[bi];  // num_computed_tokens
    const int32_t drafts = cu_num_logits_[bi + 1] - cu_num_logits_[bi] - 1;
    const RowPlaceholder* ph = placeholder_in(req_rows_[bi], begin, seq_lens_[bi] - drafts);
    if (!ph) continue;  // validate_staged allowed only the newest step's placeholders
    input_sources_[static_cast<size_t>(cu_seqlens_q_[bi] + ph->sample.index - begin)] = ph->batch;
    num_input_sources_ += 1;
  }
}

// ---- n-gram drafts ------------------------------------------------------------------

void BatchPacker::propose_ngram(const int32_t* rows, int32_t n, int32_t min_n, int32_t max_n,
                                int32_t k, int32_t max_model_len, int32_t* drafts,
                                int32_t* num_drafts) {
  NgramParams params;
  params.min_n = min_n;
  params.max_n = max_n;
  params.k = k;
  params.max_model_len = max_model_len;
  check_ngram_params(params);
  if (n < 0) fail("propose_ngram: expected n >= 0 rows, got " + std::to_string(n));
  for (int32_t i = 0; i < n; ++i) {
    if (!table_.is_live(rows[i])) {
      fail("propose_ngram: row " + std::to_string(rows[i]) + " (entry " + std::to_string(i) +
           ") is not a live request");
    }
  }
  for (int32_t i = 0; i < n; ++i) {
    const int32_t r = rows[i];
    const Int32Span history(table_.row(r).token_ids.data(),
                            static_cast<size_t>(table_.state(r).num_tokens));
    int32_t* out = drafts + static_cast<size_t>(i) * static_cast<size_t>(k);
    const int32_t c = ngram_propose(history, params, out, ngram_failure_);
    std::fill(out + c, out + k, -1);
    num_drafts[i] = c;
  }
}

}  // namespace vllm_metal::runtime
