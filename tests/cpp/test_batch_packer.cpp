// BatchPacker: packed arrays by hand on small cases, the decode/prefill split
// rule, bad input (state unchanged), and random steps against a reference.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <functional>
#include <map>
#include <new>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "runtime/batch_packer.h"

namespace rt = vllm_metal::runtime;

// ---- allocation counter: pack() must not allocate -----------------------------
// Replaces the global operator new of this test executable (counts, then
// mallocs); the core library's allocations resolve to it too.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
namespace {
std::atomic<long> g_packer_test_allocations{0};
}
void* operator new(std::size_t n) {
  g_packer_test_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace {

using Ints = std::vector<int32_t>;

rt::KvGroupSpec group(int32_t block_size, int32_t kernel_block_size = 0, bool paged = true) {
  rt::KvGroupSpec g;
  g.block_size = block_size;
  g.kernel_block_size = kernel_block_size;
  g.paged = paged;
  return g;
}

rt::BatchPackerConfig config(std::vector<rt::KvGroupSpec> groups = {group(4)},
                             int32_t mrope_num_dims = 0) {
  rt::BatchPackerConfig c;
  c.max_num_reqs = 8;
  c.max_num_batched_tokens = 64;
  c.max_model_len = 64;
  c.kv_groups = std::move(groups);
  c.mrope_num_dims = mrope_num_dims;
  return c;
}

int32_t add(rt::BatchPacker& p, const std::string& id, const Ints& tokens, int32_t computed,
            const std::vector<Ints>& blocks, const Ints& mrope = {}, int32_t delta = 0) {
  std::vector<rt::Int32Span> spans(blocks.begin(), blocks.end());
  rt::NewRequest r;
  r.req_id = id;
  r.token_ids = rt::Int32Span(tokens);
  r.num_computed_tokens = computed;
  r.block_ids = spans.data();
  r.mrope_positions = rt::Int32Span(mrope);
  r.mrope_position_delta = delta;
  return p.requests().add(r);
}

Ints range(int32_t from, int32_t n) {
  Ints v;
  for (int32_t i = 0; i < n; ++i) v.push_back(from + i);
  return v;
}

template <typename T>
std::vector<T> vec(const T* p, int64_t n) {
  return std::vector<T>(p, p + n);
}

void expect_error(const std::function<void()>& f, const std::string& part) {
  try {
    f();
    ADD_FAILURE() << "expected an error containing: " << part;
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.rfind("[BatchPacker] ", 0), 0u) << what;
    EXPECT_NE(what.find(part), std::string::npos) << what;
  }
}

// Everything a packed step exposes, by value.
struct Outputs {
  rt::PackedBatch b;
  Ints input_ids, positions, seq_lens, cu_q, logits, cu_logits, rows;
  std::vector<int64_t> slots;
  std::vector<Ints> tables;
  std::vector<uint8_t> discard;

  bool operator==(const Outputs& o) const {
    return b.num_seqs == o.b.num_seqs && b.num_tokens == o.b.num_tokens &&
           b.num_tokens_padded == o.b.num_tokens_padded && b.num_logits == o.b.num_logits &&
           b.split.num_decodes == o.b.split.num_decodes && input_ids == o.input_ids &&
           positions == o.positions && seq_lens == o.seq_lens && cu_q == o.cu_q &&
           logits == o.logits && cu_logits == o.cu_logits && rows == o.rows &&
           slots == o.slots && tables == o.tables && discard == o.discard;
  }
};

Outputs outputs(const rt::BatchPacker& p) {
  Outputs o;
  o.b = p.batch();
  const int32_t S = o.b.num_seqs, Tp = o.b.num_tokens_padded;
  o.input_ids = vec(p.input_ids(), Tp);
  o.positions = vec(p.positions(), int64_t(p.position_dims()) * Tp);
  o.seq_lens = vec(p.seq_lens(), S);
  o.cu_q = vec(p.cu_seqlens_q(), S + 1);
  o.logits = vec(p.logits_indices(), o.b.num_logits);
  o.cu_logits = vec(p.cu_num_logits(), S + 1);
  o.rows = vec(p.req_rows(), S);
  o.slots = vec(p.slot_mapping(0), int64_t(p.num_groups()) * Tp);
  for (int32_t g = 0; g < p.num_groups(); ++g) {
    o.tables.push_back(vec(p.block_table(g), int64_t(S) * p.block_table_width(g)));
  }
  o.discard = vec(p.discard_sampled(), S);
  return o;
}

Ints padded(Ints v, size_t width) {
  v.resize(width, 0);
  return v;
}

Ints concat(Ints a, const Ints& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace

// ---- the split rule ---------------------------------------------------------------

TEST(DecodePrefillSplit, DecodeRowsGoTogetherOnceTheirContextsReach512) {
  const Ints q1(8, 1);
  // eight short decodes adding up to exactly 512: decode kernel, though no row is long
  Ints eight(8, 64);
  auto s = rt::split_decode_prefill(q1.data(), eight.data(), 8, 8);
  EXPECT_EQ(s.num_decodes, 8);
  EXPECT_EQ(s.num_decode_tokens, 8);
  EXPECT_EQ(s.num_prefills, 0);
  // one token short: all rows to the varlen kernel
  eight[3] = 63;
  s = rt::split_decode_prefill(q1.data(), eight.data(), 8, 8);
  EXPECT_EQ(s.num_decodes, 0);
  EXPECT_EQ(s.num_prefills, 8);
  EXPECT_EQ(s.num_prefill_tokens, 8);
  // one row: 511 stays, 512 and 513 go; a row reaching 4096 goes like any other
  for (int32_t ctx : {511, 512, 513, 4096}) {
    s = rt::split_decode_prefill(q1.data(), &ctx, 1, 1);
    EXPECT_EQ(s.num_decodes, ctx >= 512 ? 1 : 0) << ctx;
  }
  // decodes + prefill chunks: the prefill rows never count toward the threshold
  const Ints q{1, 3, 100, 7};  // two decode-like rows (the second with 2 drafts), two chunks
  const Ints seq{301, 211, 900, 7};  // decode contexts: 512
  s = rt::split_decode_prefill(q.data(), seq.data(), 2, 4);
  EXPECT_EQ(s.num_decodes, 2);
  EXPECT_EQ(s.num_decode_tokens, 4);
  EXPECT_EQ(s.num_prefills, 2);
  EXPECT_EQ(s.num_prefill_tokens, 107);
  s = rt::split_decode_prefill(q.data(), seq.data(), 2, 4, /*min_total_context=*/512);
  EXPECT_EQ(s.num_decodes, 2);
  s = rt::split_decode_prefill(q.data(), seq.data(), 2, 4, /*min_total_context=*/513);
  EXPECT_EQ(s.num_decodes, 0);
  EXPECT_EQ(s.num_prefill_tokens, 111);
  // no decode-like rows
  s = rt::split_decode_prefill(q.data(), seq.data(), 0, 4);
  EXPECT_EQ(s.num_decodes, 0);
  EXPECT_EQ(s.num_prefills, 4);
  EXPECT_TRUE(rt::is_decode_row(1, 0));
  EXPECT_TRUE(rt::is_decode_row(4, 3));
  EXPECT_FALSE(rt::is_decode_row(2, 0));
}

// ---- packed arrays by hand ----------------------------------------------------------

TEST(BatchPacker, DecodeRowsFirstThenPrefillChunks) {
  rt::BatchPacker p(config());
  const int32_t rp = add(p, "p", range(10, 6), 0, {{7, 3}});
  const int32_t rd = add(p, "d", range(20, 5), 4, {{5, 9}});
  p.begin_step();
  p.schedule("p", 6);
  p.schedule("d", 1);
  const auto& b = p.pack();
  EXPECT_EQ(b.num_seqs, 2);
  EXPECT_EQ(b.num_tokens, 7);
  EXPECT_EQ(b.num_decode_like, 1);
  EXPECT_EQ(b.decode_context, 5);
  EXPECT_EQ(b.max_query_len, 6);
  EXPECT_EQ(b.max_seq_len, 6);
  Outputs o = outputs(p);
  EXPECT_EQ(o.input_ids, (Ints{24, 10, 11, 12, 13, 14, 15}));
  EXPECT_EQ(o.positions, (Ints{4, 0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(o.slots, (std::vector<int64_t>{36, 28, 29, 30, 31, 12, 13}));
  EXPECT_EQ(o.seq_lens, (Ints{5, 6}));
  EXPECT_EQ(o.cu_q, (Ints{0, 1, 7}));
  EXPECT_EQ(o.logits, (Ints{0, 6}));
  EXPECT_EQ(o.cu_logits, (Ints{0, 1, 2}));
  EXPECT_EQ(o.rows, (Ints{rd, rp}));
  EXPECT_EQ(p.block_table_width(0), 16);
  EXPECT_EQ(o.tables[0], concat(padded({5, 9}, 16), padded({7, 3}, 16)));
  EXPECT_EQ(p.block_table_used_width(0), 2);
  EXPECT_EQ(o.discard, (std::vector<uint8_t>{0, 0}));
  // 5 tokens of decode context < 512: everything to the varlen kernel
  EXPECT_EQ(b.split.num_decodes, 0);
  EXPECT_EQ(b.split.num_prefills, 2);
  EXPECT_EQ(b.split.num_prefill_tokens, 7);
}

TEST(BatchPacker, ScheduleManyIsScheduleForEach) {
  rt::BatchPacker p(config());
  add(p, "p", range(10, 6), 0, {{7, 3}});
  add(p, "d", range(20, 7), 4, {{5, 9}});
  p.begin_step();
  p.schedule("p", 6);
  const Ints drafts{1, 2};
  p.schedule("d", 3, rt::Int32Span(drafts));
  p.pack();
  const Outputs one_by_one = outputs(p);
  const std::string_view ids[2] = {"p", "d"};
  const int32_t counts[2] = {6, 3};
  const rt::Int32Span spans[2] = {rt::Int32Span(), rt::Int32Span(drafts)};
  p.begin_step();
  p.schedule_many(ids, counts, spans, 2);
  p.pack();
  EXPECT_TRUE(outputs(p) == one_by_one);
  const std::string_view bad[2] = {"p", "nope"};
  expect_error([&] { p.begin_step(); p.schedule_many(bad, counts, nullptr, 2); p.pack(); },
               "unknown request id 'nope' scheduled");
  EXPECT_TRUE(outputs(p) == one_by_one);
}

TEST(BatchPacker, ChunkedPrefillAndSpeculativeRows) {
  rt::BatchPacker p(config());
  add(p, "chunk", range(10, 9), 2, {{1, 2, 3}});  // computes 2..5 of 9: a partial chunk
  add(p, "spec", range(50, 7), 6, {{4, 5, 6}});   // 1 token + 2 drafts
  p.begin_step();
  p.schedule("chunk", 4);
  const Ints drafts{90, 91};
  p.schedule("spec", 3, rt::Int32Span(drafts));
  p.pack();
  Outputs o = outputs(p);
  EXPECT_EQ(o.input_ids, (Ints{56, 90, 91, 12, 13, 14, 15}));
  EXPECT_EQ(o.positions, (Ints{6, 7, 8, 2, 3, 4, 5}));
  EXPECT_EQ(o.slots, (std::vector<int64_t>{22, 23, 24, 6, 7, 8, 9}));
  EXPECT_EQ(o.seq_lens, (Ints{9, 6}));
  EXPECT_EQ(o.cu_q, (Ints{0, 3, 7}));
  EXPECT_EQ(o.logits, (Ints{0, 1, 2, 6}));  // target + 2 draft rows, then the chunk's last
  EXPECT_EQ(o.cu_logits, (Ints{0, 3, 4}));
  EXPECT_EQ(o.discard, (std::vector<uint8_t>{0, 1}));
  EXPECT_EQ(Ints(o.tables[0].begin(), o.tables[0].begin() + 4), (Ints{4, 5, 6, 0}));
  EXPECT_EQ(Ints(o.tables[0].begin() + 16, o.tables[0].begin() + 19), (Ints{1, 2, 0}));
  EXPECT_EQ(p.batch().num_decode_like, 1);
}

TEST(BatchPacker, KernelBlocksSplitVllmBlocksWithoutChangingSlots) {
  // vLLM block 8, kernel block 4: block b is kernel blocks 2b, 2b+1
  rt::BatchPacker p(config({group(8, 4)}));
  add(p, "a", range(0, 10), 0, {{3, 5}});
  p.begin_step();
  p.schedule("a", 10);
  p.pack();
  EXPECT_EQ(p.block_table_width(0), 16);  // 8 vLLM blocks x 2
  Outputs o = outputs(p);
  EXPECT_EQ(o.tables[0], padded({6, 7, 10}, 16));  // ceil(10 / 4) kernel blocks
  EXPECT_EQ(o.slots, (std::vector<int64_t>{24, 25, 26, 27, 28, 29, 30, 31, 40, 41}));
  // the same slot in kernel units: table[pos / 4] * 4 + pos % 4
  for (int32_t pos = 0; pos < 10; ++pos) {
    EXPECT_EQ(o.slots[pos], int64_t(o.tables[0][pos / 4]) * 4 + pos % 4);
  }
}

TEST(BatchPacker, MropePositionsThenDeltaAfterThePrecomputedPart) {
  rt::BatchPacker p(config({group(4)}, /*mrope_num_dims=*/3));
  // [3, 4] precomputed positions (an image squeezes t, h, w), delta -2 afterwards
  const Ints pre{0, 1, 1, 1,  //
                 0, 1, 2, 1,  //
                 0, 1, 1, 2};
  add(p, "v", range(0, 6), 0, {{1, 2}}, pre, -2);
  add(p, "t", range(0, 3), 2, {{3}});  // text only: every row is the 1-D position
  p.begin_step();
  p.schedule("v", 6);
  p.schedule("t", 1);
  p.pack(/*pad_tokens_to=*/9);
  Outputs o = outputs(p);
  ASSERT_EQ(o.positions.size(), 27u);
  // row stride = num_tokens_padded = 9; rows: decode "t" first, then "v", then 2 pads
  EXPECT_EQ(Ints(o.positions.begin(), o.positions.begin() + 9), (Ints{2, 0, 1, 1, 1, 2, 3, 0, 0}));
  EXPECT_EQ(Ints(o.positions.begin() + 9, o.positions.begin() + 18), (Ints{2, 0, 1, 2, 1, 2, 3, 0, 0}));
  EXPECT_EQ(Ints(o.positions.begin() + 18, o.positions.end()), (Ints{2, 0, 1, 1, 2, 2, 3, 0, 0}));
}

TEST(BatchPacker, PaddingAndStateGroups) {
  rt::BatchPacker p(config({group(4), group(64, 0, /*paged=*/false)}));
  add(p, "a", range(30, 5), 3, {{8, 9}, {2}});
  p.begin_step();
  p.schedule("a", 2);
  p.pack(/*pad_tokens_to=*/5);
  Outputs o = outputs(p);
  EXPECT_EQ(o.b.num_tokens, 2);
  EXPECT_EQ(o.b.num_tokens_padded, 5);
  EXPECT_EQ(o.input_ids, (Ints{33, 34, 0, 0, 0}));
  EXPECT_EQ(o.positions, (Ints{3, 4, 0, 0, 0}));
  // group 0: two slots then -1 padding; group 1 (state): no slots at all
  EXPECT_EQ(o.slots, (std::vector<int64_t>{35, 36, -1, -1, -1, -1, -1, -1, -1, -1}));
  EXPECT_EQ(o.tables[1], padded({2}, 1));
  EXPECT_EQ(p.block_table_width(1), 1);
  expect_error([&] { p.begin_step(); p.schedule("a", 2); p.pack(65); },
               "exceeds max_num_batched_tokens 64");
}

// ---- bad input: a clear error, nothing changes ----------------------------------------

TEST(BatchPacker, BadStepsLeaveOutputsAndTableUnchanged) {
  rt::BatchPacker p(config());
  add(p, "a", range(0, 8), 0, {{1, 2}});
  add(p, "b", range(0, 3), 2, {{3}});
  p.begin_step();
  p.schedule("a", 8);
  p.schedule("b", 1);
  p.pack();
  const Outputs before = outputs(p);
  const int32_t row_a = p.requests().row_of("a");
  const auto computed_a = p.requests().state(row_a).num_computed_tokens;
  const auto blocks_a = p.requests().block_id_lists(row_a);

  const auto step = [&](std::function<void()> schedule) {
    p.begin_step();
    schedule();
    p.pack();
  };
  expect_error([&] { step([&] { p.schedule("zzz", 1); }); }, "unknown request id 'zzz'");
  // 9 tokens need 3 blocks of 4; "a" holds 2 (and has only 8 tokens anyway: add one)
  p.requests().append_tokens("a", rt::Int32Span(Ints{77}));
  expect_error([&] { step([&] { p.schedule("a", 9); }); },
               "9 tokens need 3 blocks of 4 in KV group 0, the block table holds 2");
  expect_error([&] { step([&] { p.schedule("b", 2); }); },
               "need 4 known tokens, the request has 3");
  expect_error([&] { step([&] { p.schedule("b", 1); p.schedule("b", 1); }); },
               "scheduled twice");
  const Ints three{1, 2, 3};
  expect_error([&] { step([&] { p.schedule("b", 3, rt::Int32Span(three)); }); },
               "expected 1 + drafts <= num_tokens, got num_tokens 3 with 3 drafts");
  expect_error([&] { step([&] { p.schedule("b", 0); }); }, "got num_tokens 0");
  expect_error([&] {
    step([&] {
      for (int i = 0; i < 9; ++i) p.schedule_row(0, 1);
    });
  }, "more than max_num_reqs = 8");
  // a request removed between schedule() and pack()
  add(p, "c", range(0, 2), 0, {{4}});
  expect_error([&] { step([&] { p.schedule("c", 2); p.requests().remove("c"); }); },
               "left the table before pack()");
  // after an error the staged requests are gone: an empty pack is an empty step
  EXPECT_TRUE(outputs(p) == before);
  EXPECT_EQ(p.requests().state(row_a).num_computed_tokens, computed_a);
  EXPECT_EQ(p.requests().block_id_lists(row_a), blocks_a);
}

TEST(BatchPacker, AppendSampledSkipsPartialChunksAndStopsAtMinusOne) {
  rt::BatchPacker p(config());
  add(p, "d", range(0, 4), 3, {{1, 6}});
  add(p, "s", range(0, 4), 3, {{2, 3}});
  add(p, "c", range(0, 8), 0, {{4, 5}});
  p.begin_step();
  p.schedule("c", 4);  // partial chunk
  p.schedule("d", 1);
  const Ints drafts{9, 9};
  p.schedule("s", 3, rt::Int32Span(drafts));
  p.pack();
  // batch order: d, s, c
  const Ints sampled{40, -1, -1,  //
                     41, 42, -1,  // one draft accepted + the bonus token
                     43, 44, 45};  // ignored: partial chunk
  p.append_sampled(sampled.data(), 3, 3);
  const auto& t = p.requests();
  EXPECT_EQ(t.row(t.row_of("d")).token_ids, (Ints{0, 1, 2, 3, 40}));
  EXPECT_EQ(t.row(t.row_of("s")).token_ids, (Ints{0, 1, 2, 3, 41, 42}));
  EXPECT_EQ(t.row(t.row_of("c")).token_ids, range(0, 8));
  expect_error([&] { p.append_sampled(sampled.data(), 3, 3); }, "no packed step is waiting");

  rt::RequestUpdate u;
  u.req_id = "d";
  u.num_computed_tokens = 4;
  p.requests().update(&u, 1);
  p.begin_step();
  p.schedule("d", 1);
  p.pack();
  EXPECT_EQ(p.discard_sampled()[0], 0);
  expect_error([&] { p.append_sampled(sampled.data(), 2, 3); }, "expected token_ids [1, k >= 1]");
  p.requests().remove("d");
  expect_error([&] { p.append_sampled(sampled.data(), 1, 3); }, "left the table after pack()");
}

namespace {

void pack_step(rt::BatchPacker& p, const std::vector<std::pair<std::string, int32_t>>& sched) {
  p.begin_step();
  for (const auto& [id, n] : sched) p.schedule(id, n);
  p.pack();
}

void set_computed(rt::BatchPacker& p, const std::string& id, int32_t computed) {
  rt::RequestUpdate u;
  u.req_id = id;
  u.num_computed_tokens = computed;
  p.requests().update(&u, 1);
}

Ints tokens_of(const rt::BatchPacker& p, const std::string& id) {
  return p.requests().row(p.requests().row_of(id)).token_ids;
}

// "a" (tokens 0..3) and "b" (10..13) decode token 3 together; their samples are deferred,
// so token 4 of each is a placeholder.
void defer_a_and_b_decodes(rt::BatchPacker& p) {
  add(p, "a", range(0, 4), 3, {{1, 6}});
  add(p, "b", range(10, 4), 3, {{2, 3}});
  pack_step(p, {{"a", 1}, {"b", 1}});
  p.defer_sampled();
}

}  // namespace

TEST(BatchPacker, DeferredSamplesArePlaceholdersUntilResolved) {
  rt::BatchPacker p(config());
  add(p, "a", range(0, 4), 3, {{1, 6}});
  add(p, "b", range(10, 4), 3, {{2, 3}});
  add(p, "c", range(20, 8), 0, {{4, 5}});
  pack_step(p, {{"c", 4}, {"a", 1}, {"b", 1}});  // batch order a, b, c (c: a partial chunk)
  EXPECT_EQ(p.num_input_sources(), 0);
  p.defer_sampled();
  EXPECT_EQ(tokens_of(p, "a"), concat(range(0, 4), {rt::BatchPacker::kPlaceholderToken}));
  EXPECT_EQ(tokens_of(p, "c"), range(20, 8));  // its sample is dropped: nothing deferred
  expect_error([&] { p.defer_sampled(); }, "no packed step is waiting");

  // the next step is packed before the first one's tokens exist
  set_computed(p, "a", 4);
  set_computed(p, "b", 4);
  set_computed(p, "c", 4);
  pack_step(p, {{"a", 1}, {"b", 1}, {"c", 4}});
  EXPECT_EQ(vec(p.input_ids(), 6), (Ints{0, 0, 24, 25, 26, 27}));
  EXPECT_EQ(p.num_input_sources(), 2);
  EXPECT_EQ(vec(p.input_sources(), 6), (Ints{0, 1, -1, -1, -1, -1}));
  p.defer_sampled();
  EXPECT_EQ(p.num_deferred_steps(), 2);
  set_computed(p, "a", 5);
  pack_step(p, {{"a", 1}});
  expect_error([&] { p.defer_sampled(); }, "2 steps already wait");

  const Ints first{40, 41, 7};
  expect_error([&] { p.resolve_deferred(first.data(), 2); }, "expected the 3 tokens");
  const Ints negative{40, -1, 7};
  expect_error([&] { p.resolve_deferred(negative.data(), 3); }, "batch row 1 has no token");
  EXPECT_EQ(tokens_of(p, "a"), concat(range(0, 4), {0, 0}));  // errors change nothing
  p.resolve_deferred(first.data(), 3);
  EXPECT_EQ(tokens_of(p, "a"), concat(range(0, 4), {40, 0}));
  EXPECT_EQ(tokens_of(p, "b"), concat(range(10, 4), {41, 0}));
  EXPECT_EQ(tokens_of(p, "c"), concat(range(20, 8), {0}));  // its first placeholder came with step 2

  p.requests().remove("b");  // it left: its step-2 placeholder is skipped on resolve
  const Ints second{50, 51, 52};
  p.resolve_deferred(second.data(), 3);
  EXPECT_EQ(tokens_of(p, "a"), concat(range(0, 4), {40, 50}));
  EXPECT_EQ(tokens_of(p, "c"), concat(range(20, 8), {52}));
  EXPECT_EQ(p.num_deferred_steps(), 0);
  expect_error([&] { p.resolve_deferred(second.data(), 3); }, "no step is waiting");
  // the last token is a decode's input once resolved
  p.append_sampled(second.data(), 1, 1);
  pack_step(p, {{"a", 1}});
  EXPECT_EQ(p.input_ids()[0], 50);
  EXPECT_EQ(p.num_input_sources(), 0);
}

TEST(BatchPacker, RolledBackOrResyncedTokensVoidTheirPlaceholders) {
  rt::BatchPacker p(config());
  defer_a_and_b_decodes(p);
  rt::RequestUpdate u[2];
  u[0].req_id = "a";  // rolled back to no outputs, then sampled again
  u[0].num_computed_tokens = 3;
  u[0].num_output_tokens = 0;
  const Ints resync = concat(range(10, 4), {77});
  const rt::Int32Span resync_span(resync);
  u[1].req_id = "b";  // its tokens re-sent in full (V1 resume)
  u[1].num_computed_tokens = 3;
  u[1].token_ids = &resync_span;
  p.requests().update(u, 2);
  const Ints again{55};
  p.requests().append_tokens("a", rt::Int32Span(again));
  const Ints sampled{40, 41};
  p.resolve_deferred(sampled.data(), 2);
  EXPECT_EQ(tokens_of(p, "a"), concat(range(0, 4), {55}));
  EXPECT_EQ(tokens_of(p, "b"), concat(range(10, 4), {77}));
  EXPECT_EQ(p.requests().state(p.requests().row_of("a")).last_token, 55);
}

TEST(BatchPacker, APlaceholderOfAnOlderWaitingStepIsRefused) {
  rt::BatchPacker p(config());
  defer_a_and_b_decodes(p);  // step 1
  set_computed(p, "a", 4);
  pack_step(p, {{"a", 1}});
  p.defer_sampled();  // step 2: only a
  set_computed(p, "b", 4);
  p.begin_step();
  p.schedule("b", 1);  // its input is step 1's sample, and step 1 is not the newest
  expect_error([&] { p.pack(); }, "older than the newest");
}

TEST(BatchPacker, RowsOfTheLastStepAreReusedOnlyAfterTheNextPack) {
  rt::BatchPacker p(config());
  const int32_t ra = add(p, "a", range(0, 4), 0, {{1}});
  p.begin_step();
  p.schedule("a", 4);
  p.pack();
  p.requests().remove("a");
  const int32_t rb = add(p, "b", range(0, 4), 0, {{2}});
  EXPECT_NE(rb, ra);  // "a"'s row still names the packed step's request
  EXPECT_EQ(p.requests().row(p.req_rows()[0]).req_id, "a");
  p.begin_step();
  p.schedule("b", 4);
  p.pack();
  EXPECT_EQ(add(p, "c", range(0, 4), 0, {{3}}), ra);  // now it is free
}

TEST(BatchPacker, PackDoesNotAllocate) {
  rt::BatchPacker p(config({group(4), group(8, 4)}, 3));
  add(p, "a", range(0, 30), 0, {{1, 2, 3, 4, 5, 6, 7, 8}, {1, 2, 3, 4}});
  add(p, "b", range(0, 9), 8, {{9, 10, 11}, {5, 6}});
  const Ints drafts{1, 2};
  for (int warm = 0; warm < 2; ++warm) {
    const long before = g_packer_test_allocations.load();
    p.begin_step();
    p.schedule("a", 30);
    p.schedule("b", 3, rt::Int32Span(drafts));
    p.pack(/*pad_tokens_to=*/40);
    EXPECT_EQ(g_packer_test_allocations.load() - before, 0) << "allocation in step " << warm;
  }
}

// ---- random steps against a reference ---------------------------------------------

namespace {

struct RefRequest {
  Ints tokens;
  int32_t computed = 0;
  std::vector<Ints> blocks;
};

// The obvious construction of every output for scheduled (id, q, drafts), in
// the packer's row order; block table rows in kernel blocks, zero-padded.
Outputs reference(const rt::BatchPacker& p, const std::map<std::string, RefRequest>& reqs,
                  const std::vector<std::tuple<std::string, int32_t, Ints>>& sched) {
  Outputs o;
  std::vector<size_t> order;
  for (size_t i = 0; i < sched.size(); ++i) {
    if (std::get<1>(sched[i]) - int32_t(std::get<2>(sched[i]).size()) == 1) order.push_back(i);
  }
  for (size_t i = 0; i < sched.size(); ++i) {
    if (std::get<1>(sched[i]) - int32_t(std::get<2>(sched[i]).size()) != 1) order.push_back(i);
  }
  const int32_t G = p.num_groups();
  std::vector<std::vector<int64_t>> slots(G);
  o.tables.resize(G);
  o.cu_q = {0};
  o.cu_logits = {0};
  for (size_t i : order) {
    const auto& [id, q, drafts] = sched[i];
    const RefRequest& r = reqs.at(id);
    const int32_t known = q - int32_t(drafts.size());
    for (int32_t t = 0; t < q; ++t) {
      const int32_t pos = r.computed + t;
      o.input_ids.push_back(t < known ? r.tokens[pos] : drafts[t - known]);
      o.positions.push_back(pos);
      for (int32_t g = 0; g < G; ++g) {
        const int32_t B = p.requests().group(g).block_size;
        slots[g].push_back(int64_t(r.blocks[g][pos / B]) * B + pos % B);
      }
    }
    const int32_t start = o.cu_q.back();
    for (int32_t j = 0; j <= int32_t(drafts.size()); ++j) o.logits.push_back(start + known - 1 + j);
    o.cu_q.push_back(start + q);
    o.cu_logits.push_back(o.cu_logits.back() + int32_t(drafts.size()) + 1);
    o.seq_lens.push_back(r.computed + q);
    o.rows.push_back(p.requests().find(id));
    o.discard.push_back(r.computed + known < int32_t(r.tokens.size()) ? 1 : 0);
    for (int32_t g = 0; g < G; ++g) {
      const auto& spec = p.requests().group(g);
      const int32_t k = spec.block_size / spec.kernel_block_size;
      Ints row(p.block_table_width(g), 0);
      const int32_t need = (r.computed + q + spec.kernel_block_size - 1) / spec.kernel_block_size;
      for (int32_t e = 0; e < need; ++e) row[e] = r.blocks[g][e / k] * k + e % k;
      o.tables[g].insert(o.tables[g].end(), row.begin(), row.end());
    }
  }
  for (int32_t g = 0; g < G; ++g) o.slots.insert(o.slots.end(), slots[g].begin(), slots[g].end());
  o.b = p.batch();  // counts are checked separately
  return o;
}

}  // namespace

TEST(BatchPacker, RandomStepsMatchTheReference) {
  rt::BatchPackerConfig c = config({group(4), group(8, 2)});
  c.max_num_reqs = 6;
  c.max_num_batched_tokens = 48;
  c.max_model_len = 40;
  rt::BatchPacker p(c);
  std::map<std::string, RefRequest> reqs;
  std::mt19937 rng(3);
  int32_t next_block = 1, next_id = 0;
  const auto ensure_blocks = [&](const std::string& id, int32_t tokens) {
    RefRequest& r = reqs[id];
    std::vector<Ints> add_ids(2);
    for (int32_t g = 0; g < 2; ++g) {
      const int32_t B = g == 0 ? 4 : 8;
      while (int32_t(r.blocks[g].size() + add_ids[g].size()) * B < tokens) {
        add_ids[g].push_back(next_block++ % 1000);
      }
      r.blocks[g].insert(r.blocks[g].end(), add_ids[g].begin(), add_ids[g].end());
    }
    std::vector<rt::Int32Span> spans(add_ids.begin(), add_ids.end());
    rt::RequestUpdate u;
    u.req_id = id;
    u.num_computed_tokens = r.computed;
    u.new_block_ids = spans.data();
    p.requests().update(&u, 1);
  };
  for (int step = 0; step < 400; ++step) {
    // arrivals and departures
    if (reqs.size() < 8 && rng() % 3 == 0) {
      const std::string id = std::string("r").append(std::to_string(next_id++));
      RefRequest r;
      r.tokens = range(int32_t(rng() % 500), 1 + int32_t(rng() % 20));
      r.blocks.resize(2);
      reqs[id] = r;
      add(p, id, r.tokens, 0, {{}, {}});
    }
    if (!reqs.empty() && rng() % 7 == 0) {
      auto it = std::next(reqs.begin(), rng() % reqs.size());
      p.requests().remove(it->first);
      reqs.erase(it);
    }
    // schedule a random subset in random order
    std::vector<std::string> ids;
    for (auto& [id, r] : reqs) ids.push_back(id);
    std::shuffle(ids.begin(), ids.end(), rng);
    std::vector<std::tuple<std::string, int32_t, Ints>> sched;
    int32_t budget = c.max_num_batched_tokens;
    for (const auto& id : ids) {
      if (int32_t(sched.size()) == c.max_num_reqs || rng() % 4 == 0) continue;
      RefRequest& r = reqs[id];
      const int32_t left = int32_t(r.tokens.size()) - r.computed;
      const int32_t room = c.max_model_len - r.computed;
      if (left == 0 || room <= 0) continue;
      Ints drafts;
      if (left == 1 && rng() % 2) {
        for (int32_t d = int32_t(rng() % 3); d > 0 && 1 + int32_t(drafts.size()) < room; --d) {
          drafts.push_back(int32_t(rng() % 1000));
        }
      }
      const int32_t q = std::min({left, 1 + int32_t(rng() % 12), budget}) + int32_t(drafts.size());
      if (q - int32_t(drafts.size()) <= 0 || q > budget || q > room) continue;
      budget -= q;
      ensure_blocks(id, r.computed + q);
      sched.emplace_back(id, q, drafts);
    }
    p.begin_step();
    for (const auto& [id, q, drafts] : sched) p.schedule(id, q, rt::Int32Span(drafts));
    p.pack();
    const Outputs got = outputs(p);
    const Outputs want = reference(p, reqs, sched);
    ASSERT_EQ(got.input_ids, want.input_ids) << "step " << step;
    ASSERT_EQ(got.positions, want.positions) << "step " << step;
    ASSERT_EQ(got.slots, want.slots) << "step " << step;
    ASSERT_EQ(got.tables, want.tables) << "step " << step;
    ASSERT_EQ(got.seq_lens, want.seq_lens);
    ASSERT_EQ(got.cu_q, want.cu_q);
    ASSERT_EQ(got.logits, want.logits);
    ASSERT_EQ(got.cu_logits, want.cu_logits);
    ASSERT_EQ(got.rows, want.rows);
    ASSERT_EQ(got.discard, want.discard);
    // the model computes the scheduled tokens, samples, maybe rejects drafts
    Ints sampled(got.b.num_seqs * 3, -1);
    for (int32_t b = 0; b < got.b.num_seqs; ++b) {
      sampled[b * 3] = int32_t(rng() % 1000);
      if (rng() % 2) sampled[b * 3 + 1] = int32_t(rng() % 1000);
    }
    // keep the reference in step: accepted tokens = leading non-negative entries
    for (int32_t b = 0; b < got.b.num_seqs; ++b) {
      const std::string id = p.requests().row(got.rows[b]).req_id;
      RefRequest& r = reqs[id];
      int32_t q = got.cu_q[b + 1] - got.cu_q[b];
      int32_t nd = got.cu_logits[b + 1] - got.cu_logits[b] - 1;
      int32_t accepted = sampled[b * 3 + 1] >= 0 ? 2 : 1;
      if (accepted > nd + 1) {
        sampled[b * 3 + 1] = -1;
        accepted = 1;
      }
      if (int32_t(r.tokens.size()) + accepted > c.max_model_len) {
        sampled[b * 3] = sampled[b * 3 + 1] = -1;
        accepted = 0;
      }
      if (!got.discard[b]) {
        for (int32_t j = 0; j < accepted; ++j) r.tokens.push_back(sampled[b * 3 + j]);
        r.computed += q - nd + (accepted > 0 ? accepted - 1 : 0);
      } else {
        r.computed += q;
      }
      rt::RequestUpdate u;
      u.req_id = id;
      u.num_computed_tokens = std::min<int32_t>(r.computed, int32_t(r.tokens.size()));
      r.computed = u.num_computed_tokens;
      p.requests().update(&u, 1);
    }
    p.append_sampled(sampled.data(), got.b.num_seqs, 3);
    for (auto& [id, r] : reqs) {
      ASSERT_EQ(p.requests().row(p.requests().row_of(id)).token_ids, r.tokens) << id;
    }
  }
}
