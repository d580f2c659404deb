#include "runtime/ngram_proposer.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace vllm_metal::runtime {

void check_ngram_params(const NgramParams& p) {
  if (p.min_n < 1 || p.max_n < p.min_n) {
    throw std::invalid_argument("[ngram] expected 1 <= min_n <= max_n, got min_n=" +
                                std::to_string(p.min_n) + " max_n=" + std::to_string(p.max_n));
  }
  if (p.k < 1) {
    throw std::invalid_argument("[ngram] expected k >= 1 draft tokens, got " + std::to_string(p.k));
  }
  if (p.max_model_len < 1) {
    throw std::invalid_argument("[ngram] expected max_model_len >= 1, got " +
                                std::to_string(p.max_model_len));
  }
}

int32_t ngram_propose(Int32Span tokens, const NgramParams& p, int32_t* drafts,
                      std::vector<int32_t>& failure) {
  const int64_t n_tok = static_cast<int64_t>(tokens.size);
  // An occurrence of a min_n-gram that is followed by a token needs min_n + 1 tokens.
  if (n_tok < static_cast<int64_t>(p.min_n) + 1) return 0;
  const int64_t room = static_cast<int64_t>(p.max_model_len) - n_tok;
  const int64_t budget = std::min<int64_t>(p.k, room);
  if (budget <= 0) return 0;

  // rev[j] = tokens[n_tok - 1 - j]: the sequence read from its end.
  const int32_t* last = tokens.data + (n_tok - 1);
  const auto rev = [last](int64_t j) { return last[-j]; };

  // Pattern: rev[0:m], the tail read backwards. A match of length L ending at
  // text position i >= 1 (rev[i-L+1..i] == rev[0:L]) is the tail L-gram at
  // start s = n_tok - 1 - i; L <= i holds since the text starts at 1.
  const int64_t m = std::min<int64_t>(p.max_n, n_tok - 1);
  if (failure.size() < static_cast<size_t>(m)) failure.resize(static_cast<size_t>(m));
  int32_t* fail = failure.data();  // fail[q] = longest proper border of rev[0..q]
  fail[0] = 0;
  for (int64_t q = 1, b = 0; q < m; ++q) {
    while (b > 0 && rev(q) != rev(b)) b = fail[b - 1];
    if (rev(q) == rev(b)) ++b;
    fail[q] = static_cast<int32_t>(b);
  }

  // Scan the text rev[1:n_tok]. Larger i is an earlier start s, so ">="
  // keeps the earliest occurrence among the longest.
  int64_t best_len = 0, best_i = 0;
  for (int64_t i = 1, q = 0; i < n_tok; ++i) {
    const int32_t c = rev(i);
    while (q > 0 && rev(q) != c) q = fail[q - 1];
    if (rev(q) == c) ++q;
    if (q > 0 && q >= best_len) {
      best_len = q;
      best_i = i;
    }
    if (q == m) q = fail[m - 1];  // the whole pattern matched: fall back before extending
  }
  if (best_len < p.min_n) return 0;

  const int64_t start = n_tok - 1 - best_i + best_len;  // first token after the match
  const int64_t count = std::min<int64_t>(budget, n_tok - start);
  std::copy(tokens.data + start, tokens.data + start + count, drafts);
  return static_cast<int32_t>(count);
}

}  // namespace vllm_metal::runtime
