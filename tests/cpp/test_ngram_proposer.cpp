// N-gram (prompt lookup) proposer: hand cases of vLLM's rule (longest n wins,
// earliest occurrence wins, short continuations, max_model_len), random
// sequences against a brute-force reference of the contract, and
// BatchPacker::propose_ngram over a packer's rows.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/batch_packer.h"
#include "runtime/ngram_proposer.h"

namespace rt = vllm_metal::runtime;

namespace {

using Ints = std::vector<int32_t>;

rt::NgramParams params(int32_t min_n, int32_t max_n, int32_t k, int32_t max_model_len = 1 << 20) {
  rt::NgramParams p;
  p.min_n = min_n;
  p.max_n = max_n;
  p.k = k;
  p.max_model_len = max_model_len;
  return p;
}

Ints propose(const Ints& tokens, const rt::NgramParams& p) {
  static std::vector<int32_t> failure;
  Ints out(static_cast<size_t>(p.k), -7);
  const int32_t c = rt::ngram_propose(rt::Int32Span(tokens), p, out.data(), failure);
  EXPECT_GE(c, 0);
  EXPECT_LE(c, p.k);
  for (size_t i = static_cast<size_t>(c); i < out.size(); ++i) EXPECT_EQ(out[i], -7) << "wrote past count";
  out.resize(static_cast<size_t>(c));
  return out;
}

// The contract, brute force: the largest n in [min_n, max_n] whose tail n-gram
// occurs at some start s <= N-1-n, its smallest such s; tokens after it.
Ints reference(const Ints& t, const rt::NgramParams& p) {
  const int64_t n_tok = static_cast<int64_t>(t.size());
  for (int64_t n = p.max_n; n >= p.min_n; --n) {
    for (int64_t s = 0; s + n <= n_tok - 1; ++s) {
      if (std::equal(t.begin() + s, t.begin() + s + n, t.end() - n)) {
        const int64_t c = std::min<int64_t>({p.k, p.max_model_len - n_tok, n_tok - (s + n)});
        if (c <= 0) return {};
        return Ints(t.begin() + s + n, t.begin() + s + n + c);
      }
    }
  }
  return {};
}

void expect_invalid(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected std::invalid_argument containing " << needle;
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(NgramProposer, NoMatchProposesNothing) {
  EXPECT_EQ(propose({1, 2, 3, 4, 5}, params(1, 3, 4)), Ints{});
  EXPECT_EQ(propose({}, params(1, 3, 4)), Ints{});
  EXPECT_EQ(propose({7}, params(1, 3, 4)), Ints{});
  // the tail 2-gram (3, 4) never occurred before; min_n=2 forbids the 1-gram (4)
  EXPECT_EQ(propose({4, 9, 3, 5, 3, 4}, params(2, 3, 4)), Ints{});
  EXPECT_EQ(propose({4, 9, 3, 5, 3, 4}, params(1, 3, 4)), (Ints{9, 3, 5, 3}));
}

TEST(NgramProposer, HistoryShorterThanMinNPlusOne) {
  // (5, 5) needs a (5, 5) followed by a token: [5, 5] has none, [5, 5, 5] has one
  EXPECT_EQ(propose({5, 5}, params(2, 2, 3)), Ints{});
  EXPECT_EQ(propose({5, 5, 5}, params(2, 2, 3)), Ints{5});
  EXPECT_EQ(propose({5, 5}, params(1, 1, 3)), Ints{5});
}

TEST(NgramProposer, LongestNWins) {
  // tail ... 2 3: the 1-gram (3) first occurs at 1 (-> 8), the 2-gram (2, 3) at 5 (-> 6)
  const Ints t = {0, 3, 8, 8, 1, 2, 3, 6, 6, 6, 2, 3};
  EXPECT_EQ(propose(t, params(1, 1, 2)), (Ints{8, 8}));
  EXPECT_EQ(propose(t, params(1, 2, 2)), (Ints{6, 6}));
  EXPECT_EQ(propose(t, params(1, 5, 2)), (Ints{6, 6}));
  EXPECT_EQ(propose(t, params(2, 2, 2)), (Ints{6, 6}));
  EXPECT_EQ(propose(t, params(3, 5, 2)), Ints{});
  // max_n caps the match: a 3-gram (1, 2, 3) exists, max_n=2 looks only for 2-grams
  const Ints u = {2, 3, 4, 1, 2, 3, 5, 1, 2, 3};
  EXPECT_EQ(propose(u, params(1, 2, 1)), Ints{4});  // earliest (2, 3)
  EXPECT_EQ(propose(u, params(1, 3, 1)), Ints{5});  // only (1, 2, 3)
}

TEST(NgramProposer, EarliestOccurrenceWins) {
  // (1, 2) occurs at 0, 3 and 6 before the tail: vLLM takes the earliest
  const Ints t = {1, 2, 10, 1, 2, 20, 1, 2, 30, 1, 2};
  EXPECT_EQ(propose(t, params(2, 2, 1)), Ints{10});
  EXPECT_EQ(propose(t, params(1, 4, 3)), (Ints{10, 1, 2}));
  // the occurrence may overlap the tail: 7 7 7 7 -> (7, 7, 7) at 0, followed by 7
  EXPECT_EQ(propose({7, 7, 7, 7}, params(1, 3, 5)), Ints{7});
  EXPECT_EQ(propose({7, 7, 7, 7}, params(1, 2, 5)), (Ints{7, 7}));
  EXPECT_EQ(propose({7, 7, 7, 7}, params(1, 1, 5)), (Ints{7, 7, 7}));
}

TEST(NgramProposer, ContinuationShorterThanK) {
  // the only earlier (4, 5) is at 3: three tokens follow before the history ends
  EXPECT_EQ(propose({9, 9, 9, 4, 5, 6, 4, 5}, params(2, 2, 5)), (Ints{6, 4, 5}));
  EXPECT_EQ(propose({1, 2, 1, 2}, params(2, 2, 8)), (Ints{1, 2}));
}

TEST(NgramProposer, MaxModelLenClips) {
  const Ints t = {1, 2, 3, 4, 5, 6, 1, 2};  // N = 8, continuation 3 4 5 6 1 2
  EXPECT_EQ(propose(t, params(2, 2, 4, 100)), (Ints{3, 4, 5, 6}));
  EXPECT_EQ(propose(t, params(2, 2, 4, 10)), (Ints{3, 4}));
  EXPECT_EQ(propose(t, params(2, 2, 4, 9)), Ints{3});
  EXPECT_EQ(propose(t, params(2, 2, 4, 8)), Ints{});
  EXPECT_EQ(propose(t, params(2, 2, 4, 5)), Ints{});
}

TEST(NgramProposer, ZeroIsAnOrdinaryToken) {
  EXPECT_EQ(propose({0, 0, 0}, params(1, 2, 3)), Ints{0});
  EXPECT_EQ(propose({0, 5, 0, 0, 6, 0}, params(1, 1, 2)), (Ints{5, 0}));
  EXPECT_EQ(propose({0, 5, 0, 0, 6, 0, 0}, params(1, 2, 2)), (Ints{6, 0}));
  EXPECT_EQ(propose({1, 2, 3}, params(1, 1, 2)), Ints{});  // no implicit zero padding
  EXPECT_EQ(propose({-3, 4, -3}, params(1, 1, 2)), (Ints{4, -3}));
}

TEST(NgramProposer, LongHistories) {
  std::mt19937 gen(7);
  // 200k random tokens over a large vocabulary, then a planted 6-gram repeat
  Ints t(200000);
  for (auto& x : t) x = static_cast<int32_t>(gen() % 50000) + 100;
  const Ints tail = {1, 2, 3, 4, 5, 6};
  std::copy(tail.begin(), tail.end(), t.begin() + 1000);
  t[1006] = 42;
  t[1007] = 43;
  t.insert(t.end(), tail.begin(), tail.end());
  EXPECT_EQ(propose(t, params(3, 8, 2)), (Ints{42, 43}));
  EXPECT_EQ(propose(t, params(3, 8, 2)), reference(t, params(3, 8, 2)));
  // all one token: the longest tail n-gram first occurs at 0
  Ints same(100000, 3);
  EXPECT_EQ(propose(same, params(1, 64, 5)), Ints(5, 3));
  // a periodic sequence: max_n larger than the history's period
  Ints per(50000);
  for (size_t i = 0; i < per.size(); ++i) per[i] = static_cast<int32_t>(i % 37);
  EXPECT_EQ(propose(per, params(1, 100, 10)), reference(per, params(1, 100, 10)));
  EXPECT_EQ(propose(per, params(50, 100, 10)), reference(per, params(50, 100, 10)));
}

TEST(NgramProposer, RandomAgainstReference) {
  std::mt19937 gen(1234);
  for (int trial = 0; trial < 20000; ++trial) {
    const int32_t vocab = 1 + static_cast<int32_t>(gen() % 4);
    const size_t len = gen() % 40;
    Ints t(len);
    for (auto& x : t) x = static_cast<int32_t>(gen() % static_cast<uint32_t>(vocab));
    const int32_t min_n = 1 + static_cast<int32_t>(gen() % 4);
    const int32_t max_n = min_n + static_cast<int32_t>(gen() % 5);
    const int32_t k = 1 + static_cast<int32_t>(gen() % 6);
    const int32_t max_model_len = static_cast<int32_t>(len) + static_cast<int32_t>(gen() % 8) - 1;
    if (max_model_len < 1) continue;
    const auto p = params(min_n, max_n, k, max_model_len);
    ASSERT_EQ(propose(t, p), reference(t, p))
        << "trial " << trial << " len " << len << " min_n " << min_n << " max_n " << max_n;
  }
}

TEST(NgramProposer, BadParams) {
  expect_invalid([] { rt::check_ngram_params(params(0, 2, 1)); }, "[ngram] expected 1 <= min_n");
  expect_invalid([] { rt::check_ngram_params(params(3, 2, 1)); }, "min_n=3 max_n=2");
  expect_invalid([] { rt::check_ngram_params(params(1, 2, 0)); }, "[ngram] expected k >= 1");
  expect_invalid([] { rt::check_ngram_params(params(1, 2, 1, 0)); }, "[ngram] expected max_model_len");
  rt::check_ngram_params(params(2, 2, 1, 1));
}

// ---- BatchPacker::propose_ngram ---------------------------------------------------

namespace {

rt::BatchPackerConfig packer_config() {
  rt::KvGroupSpec g;
  g.block_size = 4;
  rt::BatchPackerConfig c;
  c.max_num_reqs = 8;
  c.max_num_batched_tokens = 64;
  c.max_model_len = 256;
  c.kv_groups = {g};
  return c;
}

int32_t add(rt::BatchPacker& p, const std::string& id, const Ints& tokens) {
  rt::NewRequest r;
  r.req_id = id;
  r.token_ids = rt::Int32Span(tokens);
  return p.requests().add(r);
}

}  // namespace

TEST(NgramProposer, PackerRows) {
  rt::BatchPacker p(packer_config());
  const std::vector<Ints> histories = {
      {1, 2, 10, 1, 2, 20, 1, 2},  // -> 10 1 2
      {5, 6, 7},                   // no match
      {0, 0},                      // placeholder-valued tokens: -> 0
      {3},                         // too short
      {4, 8, 4, 9, 4, 8},          // (4, 8) -> 4 9 4
  };
  Ints rows;
  for (size_t i = 0; i < histories.size(); ++i) {
    std::string id = "r";  // (not "r" + ...: GCC 12 -Wrestrict false positive)
    id += std::to_string(i);
    rows.push_back(add(p, id, histories[i]));
  }
  p.requests().append_tokens("r1", rt::Int32Span(Ints{5, 6}));  // 5 6 7 5 6 -> 7 5 6
  Ints query = {rows[4], rows[0], rows[1], rows[2], rows[3], rows[0]};
  const int32_t k = 3, n = static_cast<int32_t>(query.size());
  Ints drafts(static_cast<size_t>(n * k), 99), counts(static_cast<size_t>(n), 99);
  p.propose_ngram(query.data(), n, 1, 3, k, 256, drafts.data(), counts.data());
  const std::vector<Ints> want = {{4, 9, 4}, {10, 1, 2}, {7, 5, 6}, {0}, {}, {10, 1, 2}};
  for (int32_t i = 0; i < n; ++i) {
    ASSERT_EQ(counts[static_cast<size_t>(i)], static_cast<int32_t>(want[static_cast<size_t>(i)].size())) << i;
    for (int32_t j = 0; j < k; ++j) {
      const size_t w = static_cast<size_t>(i * k + j);
      EXPECT_EQ(drafts[w], j < counts[static_cast<size_t>(i)] ? want[static_cast<size_t>(i)][static_cast<size_t>(j)] : -1)
          << i << "," << j;
    }
  }
  // max_model_len is the caller's: 8 tokens of r0 leave room for one draft at 9
  p.propose_ngram(query.data() + 1, 1, 1, 3, k, 9, drafts.data(), counts.data());
  EXPECT_EQ(counts[0], 1);
  EXPECT_EQ(drafts[0], 10);
  p.propose_ngram(query.data(), 0, 1, 3, k, 9, nullptr, nullptr);  // nothing asked
}

TEST(NgramProposer, PackerBadInputWritesNothing) {
  rt::BatchPacker p(packer_config());
  const int32_t a = add(p, "a", {1, 2, 1, 2});
  const int32_t b = add(p, "b", {3, 3});
  p.requests().remove("b");
  Ints drafts(6, 99), counts(2, 99);
  Ints rows = {a, b};
  expect_invalid([&] { p.propose_ngram(rows.data(), 2, 1, 2, 3, 64, drafts.data(), counts.data()); },
                 std::string("[BatchPacker] propose_ngram: row ").append(std::to_string(b)));
  rows = {a, 1000};
  expect_invalid([&] { p.propose_ngram(rows.data(), 2, 1, 2, 3, 64, drafts.data(), counts.data()); },
                 "row 1000 (entry 1) is not a live request");
  rows = {-1, a};
  expect_invalid([&] { p.propose_ngram(rows.data(), 2, 1, 2, 3, 64, drafts.data(), counts.data()); },
                 "row -1");
  rows = {a, a};
  expect_invalid([&] { p.propose_ngram(rows.data(), 2, 0, 2, 3, 64, drafts.data(), counts.data()); }, "[ngram]");
  expect_invalid([&] { p.propose_ngram(rows.data(), 2, 2, 1, 3, 64, drafts.data(), counts.data()); }, "[ngram]");
  expect_invalid([&] { p.propose_ngram(rows.data(), 2, 1, 2, 0, 64, drafts.data(), counts.data()); }, "[ngram]");
  EXPECT_EQ(drafts, Ints(6, 99));
  EXPECT_EQ(counts, Ints(2, 99));
  p.propose_ngram(rows.data(), 2, 1, 2, 3, 64, drafts.data(), counts.data());
  EXPECT_EQ(counts, (Ints{2, 2}));
  EXPECT_EQ(drafts, (Ints{1, 2, -1, 1, 2, -1}));
}
