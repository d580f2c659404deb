// RequestTable: the packer's persistent per-request state and its id index.
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/request_table.h"

namespace rt = vllm_metal::runtime;

namespace {

rt::RequestTableConfig config(int32_t max_model_len = 64, std::vector<int32_t> block_sizes = {4},
                              int64_t num_blocks = 100) {
  rt::RequestTableConfig c;
  c.max_model_len = max_model_len;
  for (int32_t b : block_sizes) {
    rt::KvGroupSpec g;
    g.block_size = b;
    g.num_blocks = num_blocks;
    c.kv_groups.push_back(g);
  }
  return c;
}

// Holds the storage a NewRequest points to.
struct Req {
  std::string id;
  std::vector<int32_t> tokens;
  std::vector<std::vector<int32_t>> blocks;
  std::vector<rt::Int32Span> spans;
  int32_t computed = 0;

  rt::NewRequest get() {
    spans.assign(blocks.begin(), blocks.end());
    rt::NewRequest r;
    r.req_id = id;
    r.token_ids = rt::Int32Span(tokens);
    r.num_computed_tokens = computed;
    r.block_ids = spans.data();
    return r;
  }
};

Req make(std::string id, int32_t n, std::vector<int32_t> blocks) {
  Req r;
  r.id = std::move(id);
  for (int32_t i = 0; i < n; ++i) r.tokens.push_back(100 + i);
  r.blocks = {std::move(blocks)};
  return r;
}

// A value snapshot of one request (for "state unchanged" checks).
struct Snapshot {
  std::vector<int32_t> tokens;
  std::vector<std::vector<int32_t>> blocks;
  int32_t computed, prompt_len;
  uint32_t generation;
  bool operator==(const Snapshot& o) const {
    return tokens == o.tokens && blocks == o.blocks && computed == o.computed &&
           prompt_len == o.prompt_len && generation == o.generation;
  }
};

Snapshot snap(const rt::RequestTable& t, const std::string& id) {
  const int32_t row = t.row_of(id);
  const rt::RequestRow& r = t.row(row);
  const rt::RowState& st = t.state(row);
  EXPECT_EQ(st.num_tokens, static_cast<int32_t>(r.token_ids.size()));
  if (!r.token_ids.empty()) {
    EXPECT_EQ(st.last_token, r.token_ids.back());
  }
  return {r.token_ids, t.block_id_lists(row), st.num_computed_tokens, st.prompt_len, st.generation};
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

}  // namespace

TEST(RequestTable, AddFindRemoveAndRowReuse) {
  rt::RequestTable t(config());
  auto a = make("a", 5, {1, 2});
  auto b = make("b", 3, {3});
  const int32_t ra = t.add(a.get());
  const int32_t rb = t.add(b.get());
  EXPECT_NE(ra, rb);
  EXPECT_EQ(t.find("a"), ra);
  EXPECT_EQ(t.find("b"), rb);
  EXPECT_EQ(t.find("c"), -1);
  EXPECT_EQ(t.num_requests(), 2);
  EXPECT_EQ(t.row(ra).token_ids, a.tokens);
  EXPECT_EQ(t.state(ra).prompt_len, 5);
  EXPECT_EQ(t.block_id_lists(ra)[0], (std::vector<int32_t>{1, 2}));
  const uint32_t gen = t.state(ra).generation;
  EXPECT_TRUE(t.remove("a"));
  EXPECT_FALSE(t.remove("a"));  // vLLM sends ids the worker never saw
  EXPECT_EQ(t.find("a"), -1);
  EXPECT_EQ(t.num_requests(), 1);
  auto c = make("c", 2, {});
  EXPECT_EQ(t.add(c.get()), ra);  // the freed row is reused ...
  EXPECT_NE(t.state(ra).generation, gen);  // ... under a new generation
  EXPECT_EQ(t.request_ids(), (std::vector<std::string>{"c", "b"}));
}

TEST(RequestTable, IndexSurvivesManyInsertsAndRemoves) {
  rt::RequestTable t(config(8));
  std::map<std::string, int32_t> model;
  std::mt19937 rng(7);
  // short ids, ids that just fit the inline key (63 bytes), and longer ones
  const auto make_id = [](uint32_t k) {
    const std::string base = "cmpl-" + std::to_string(k) + "-";
    const size_t len = k % 3 == 0 ? base.size() : k % 3 == 1 ? 63 : 90;
    return base + std::string(len - base.size(), 'x');
  };
  for (int step = 0; step < 20000; ++step) {
    const std::string id = make_id(rng() % 700);
    if (model.count(id) && rng() % 2) {
      EXPECT_TRUE(t.remove(id));
      model.erase(id);
    } else if (!model.count(id)) {
      auto r = make(id, 1, {});
      model[id] = t.add(r.get());
    }
    if (step % 997 == 0) {
      for (const auto& [k, row] : model) ASSERT_EQ(t.find(k), row) << k;
    }
  }
  EXPECT_EQ(t.num_requests(), static_cast<int32_t>(model.size()));
  for (const auto& [k, row] : model) EXPECT_EQ(t.find(k), row);
  EXPECT_LE(t.num_rows(), 700);
  // find_many agrees with find, unknown ids included
  std::vector<std::string> ids;
  for (uint32_t k = 0; k < 800; ++k) ids.push_back(make_id(k));
  std::vector<std::string_view> views(ids.begin(), ids.end());
  std::vector<int32_t> rows(ids.size());
  t.find_many(views.data(), views.size(), rows.data());
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_EQ(rows[i], model.count(ids[i]) ? model[ids[i]] : -1) << ids[i];
  }
}

TEST(RequestTable, DuplicateIdNeedsReplace) {
  rt::RequestTable t(config());
  auto a = make("a", 5, {1, 2});
  t.add(a.get());
  const Snapshot before = snap(t, "a");
  auto a2 = make("a", 3, {7});
  expect_error([&] { t.add(a2.get()); }, "already in the table");
  EXPECT_EQ(snap(t, "a"), before);
  t.add(a2.get(), /*replace=*/true);
  EXPECT_EQ(t.num_requests(), 1);
  EXPECT_EQ(t.row(t.row_of("a")).token_ids, a2.tokens);
  EXPECT_EQ(t.block_id_lists(t.row_of("a"))[0], (std::vector<int32_t>{7}));
}

TEST(RequestTable, BadAddsChangeNothing) {
  rt::RequestTable t(config(/*max_model_len=*/16, {4}, /*num_blocks=*/10));
  auto keep = make("keep", 3, {1});
  t.add(keep.get());
  const Snapshot before = snap(t, "keep");

  auto too_long = make("x", 17, {});
  expect_error([&] { t.add(too_long.get()); }, "exceed max_model_len 16");
  auto too_many_blocks = make("x", 4, {1, 2, 3, 4, 5});
  expect_error([&] { t.add(too_many_blocks.get()); }, "room for 4");
  auto outside = make("x", 4, {10});
  expect_error([&] { t.add(outside.get()); }, "block id 10 in KV group 0 is outside the pool [0, 10)");
  auto negative = make("x", 4, {-1});
  expect_error([&] { t.add(negative.get()); }, "block id -1");
  auto computed = make("x", 4, {1});
  computed.computed = 5;
  expect_error([&] { t.add(computed.get()); }, "num_computed_tokens must be in [0, 4], got 5");
  auto prompt = make("x", 4, {1});
  auto r = prompt.get();
  r.prompt_len = 5;
  expect_error([&] { t.add(r); }, "prompt_len");
  auto mrope = make("x", 4, {1});
  std::vector<int32_t> pos{0, 1, 2};
  r = mrope.get();
  r.mrope_positions = rt::Int32Span(pos);
  expect_error([&] { t.add(r); }, "mrope_num_dims=0");

  EXPECT_EQ(t.num_requests(), 1);
  EXPECT_EQ(t.find("x"), -1);
  EXPECT_EQ(snap(t, "keep"), before);
}

TEST(RequestTable, UpdatesAppendReplaceAndRollBack) {
  rt::RequestTable t(config(32, {4, 8}));
  auto a = make("a", 6, {});
  a.blocks = {{1, 2}, {9}};
  t.add(a.get());
  auto b = make("b", 4, {});
  b.blocks = {{3}, {4}};
  t.add(b.get());
  t.append_tokens("a", rt::Int32Span(std::vector<int32_t>{7, 8, 9}));

  std::vector<int32_t> g0{5}, g1{};
  rt::Int32Span add_a[2] = {rt::Int32Span(g0), rt::Int32Span(g1)};
  std::vector<int32_t> r0{11, 12}, r1{13};
  rt::Int32Span resume_b[2] = {rt::Int32Span(r0), rt::Int32Span(r1)};
  rt::RequestUpdate u[2];
  u[0].req_id = "a";
  u[0].num_computed_tokens = 6;
  u[0].new_block_ids = add_a;
  u[0].num_output_tokens = 1;  // drops 2 of the 3 outputs
  u[1].req_id = "b";
  u[1].num_computed_tokens = 0;
  u[1].new_block_ids = resume_b;
  u[1].replace_block_ids = true;
  const uint32_t version = t.state(t.row_of("b")).block_ids_version;
  t.update(u, 2);

  const Snapshot sa = snap(t, "a");
  EXPECT_EQ(sa.computed, 6);
  EXPECT_EQ(sa.tokens, (std::vector<int32_t>{100, 101, 102, 103, 104, 105, 7}));
  EXPECT_EQ(sa.blocks, (std::vector<std::vector<int32_t>>{{1, 2, 5}, {9}}));
  EXPECT_EQ(snap(t, "b").blocks, (std::vector<std::vector<int32_t>>{{11, 12}, {13}}));
  EXPECT_NE(t.state(t.row_of("b")).block_ids_version, version);

  // all of a request's tokens (V1's all_token_ids)
  std::vector<int32_t> all{100, 101, 102, 103, 50, 51};
  rt::Int32Span all_span(all);
  rt::RequestUpdate v;
  v.req_id = "b";
  v.num_computed_tokens = 4;
  v.token_ids = &all_span;
  t.update(&v, 1);
  EXPECT_EQ(snap(t, "b").tokens, all);
}

TEST(RequestTable, BadUpdatesChangeNothing) {
  rt::RequestTable t(config(16, {4}, 20));
  auto a = make("a", 6, {1, 2});
  auto b = make("b", 6, {3, 4});
  t.add(a.get());
  t.add(b.get());
  const Snapshot sa = snap(t, "a"), sb = snap(t, "b");

  std::vector<int32_t> one{5};
  rt::Int32Span add_one[1] = {rt::Int32Span(one)};
  std::vector<int32_t> three{5, 6, 7};
  rt::Int32Span add_three[1] = {rt::Int32Span(three)};
  std::vector<int32_t> bad{20};
  rt::Int32Span add_bad[1] = {rt::Int32Span(bad)};

  const auto two = [&](const char* second_id, const rt::Int32Span* second_blocks, int32_t computed) {
    rt::RequestUpdate u[2];
    u[0].req_id = "a";
    u[0].num_computed_tokens = 3;
    u[0].new_block_ids = add_one;  // valid on its own
    u[1].req_id = second_id;
    u[1].num_computed_tokens = computed;
    u[1].new_block_ids = second_blocks;
    t.update(u, 2);
  };
  expect_error([&] { two("nope", nullptr, 0); }, "unknown request id 'nope'");
  expect_error([&] { two("b", add_three, 0); }, "would hold 5 blocks, the block table has room for 4");
  expect_error([&] { two("b", add_bad, 0); }, "block id 20");
  expect_error([&] { two("b", nullptr, 17); }, "num_computed_tokens must be in [0, 16], got 17");
  expect_error([&] { two("a", nullptr, 0); }, "appears twice");
  rt::RequestUpdate resumed;
  resumed.req_id = "b";
  resumed.replace_block_ids = true;
  expect_error([&] { t.update(&resumed, 1); }, "no block ids came");
  expect_error([&] { t.append_tokens("a", rt::Int32Span(std::vector<int32_t>(11, 1))); },
               "exceeds max_model_len 16");
  expect_error([&] { t.append_tokens("zz", rt::Int32Span()); }, "unknown request id 'zz'");

  EXPECT_EQ(snap(t, "a"), sa);
  EXPECT_EQ(snap(t, "b"), sb);
}

TEST(RequestTable, RejectsBadConfigs) {
  expect_error([] { rt::RequestTable t(config(0)); }, "max_model_len must be positive");
  expect_error([] { rt::RequestTable t(config(16, {})); }, "at least one KV-cache group");
  rt::RequestTableConfig c = config(16, {16});
  c.kv_groups[0].kernel_block_size = 5;
  expect_error([&] { rt::RequestTable t(c); }, "kernel_block_size must divide block_size 16, got 5");
  c.kv_groups[0].kernel_block_size = 8;
  rt::RequestTable ok(c);
  EXPECT_EQ(ok.max_blocks(0), 1);
  EXPECT_EQ(ok.group(0).kernel_block_size, 8);
}
