#include "cpu/apply_token_bitmask.h"

#include <algorithm>
#include <cstring>

#include "cpu/parallel.h"

namespace vllm_metal::cpu {

namespace {

// B: the dtype's bits; kNegInf: -inf in them.
template <typename B, B kNegInf>
void row(const B* x, B* y, const uint32_t* mask, int64_t vocab) {
  const bool in_place = x == y;
  for (int64_t t0 = 0; t0 < vocab; t0 += 32) {
    const int64_t n = std::min<int64_t>(32, vocab - t0);
    const uint32_t w = mask[t0 / 32];
    if (w == 0xffffffffu) {
      if (!in_place) std::memcpy(y + t0, x + t0, n * sizeof(B));
    } else if (w == 0) {
      std::fill(y + t0, y + t0 + n, kNegInf);
    } else {
      // and/or with an all-ones-or-zero mask per bit: no branch for the predictor to
      // miss on random bits, and it vectorizes (3.4x faster than a select, x86-64 -O3)
      for (int64_t j = 0; j < n; ++j) {
        const B keep = static_cast<B>(B(0) - static_cast<B>((w >> j) & 1u));
        y[t0 + j] = static_cast<B>((x[t0 + j] & keep) | (kNegInf & B(~keep)));
      }
    }
  }
}

template <typename B, B kNegInf>
void run(const TokenBitmaskRows& a) {
  auto* x = static_cast<const B*>(a.logits);
  auto* y = static_cast<B*>(a.out);
  const int64_t n = a.vocab;
  // A fan-out costs ~6 us; below ~128 KB of a row chunk one thread is faster.
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, n));
  parallel_for(a.num_rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int32_t m = a.mask_of_row[r];
      if (m >= 0) {
        row<B, kNegInf>(x + r * n, y + r * n, a.bitmask + m * a.mask_words, n);
      } else if (x != y) {
        std::memcpy(y + r * n, x + r * n, n * sizeof(B));
      }
    }
  });
}

}  // namespace

void apply_token_bitmask_rows(const TokenBitmaskRows& a) {
  switch (a.elt) {
    case Elt::kF32: return run<uint32_t, 0xff800000u>(a);
    case Elt::kF16: return run<uint16_t, 0xfc00u>(a);
    case Elt::kBF16: return run<uint16_t, 0xff80u>(a);
  }
}

}  // namespace vllm_metal::cpu
