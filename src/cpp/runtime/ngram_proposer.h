// N-gram (prompt lookup) proposer: draft tokens for speculative decoding,
// copied from what followed an earlier occurrence of the sequence's tail.
//
// Contract (vLLM 0.33's NgramProposer, vllm/v1/spec_decode/ngram_proposer.py):
//   tokens t[0:N] (prompt + output), n in [min_n, max_n].
//   - n* = the largest n <= max_n such that the last n tokens t[N-n:N] also
//     occur at some start s <= N-1-n (an earlier occurrence; it may overlap
//     the tail, but must be followed by at least one token).
//   - none, or n* < min_n: no drafts.
//   - several starts s: the earliest (smallest s) wins.
//   - drafts = t[s+n* : s+n*+c], c = min(k, max_model_len - N, N - (s+n*)):
//     fewer than k when the history ends first, none when N >= max_model_len.
//   Token values are opaque (0, the packer's placeholder, is an ordinary token).
//
// Algorithm: KMP over the reversed sequence. The pattern is the tail read
// backwards (its first max_n tokens), the text is the rest read backwards;
// the matcher state after text position i is the longest tail n-gram ending
// there. O(N + max_n) time, a max_n-entry failure table as reusable scratch.
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/request_table.h"

namespace vllm_metal::runtime {

struct NgramParams {
  int32_t min_n = 1;          // vLLM's prompt_lookup_min (>= 1)
  int32_t max_n = 1;          // prompt_lookup_max (>= min_n)
  int32_t k = 1;              // num_speculative_tokens (>= 1)
  int32_t max_model_len = 0;  // drafts never take a sequence past this (>= 1)
};

// Throws std::invalid_argument "[ngram] ..." unless 1 <= min_n <= max_n,
// k >= 1 and max_model_len >= 1.
void check_ngram_params(const NgramParams& p);

// Writes up to p.k drafts for `tokens` to `drafts` [p.k] and returns how many.
// `failure` is scratch (grown to max_n once, then reused: no allocation per
// call). Parameters are assumed valid (check_ngram_params).
int32_t ngram_propose(Int32Span tokens, const NgramParams& p, int32_t* drafts,
                      std::vector<int32_t>& failure);

}  // namespace vllm_metal::runtime
