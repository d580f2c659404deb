#include "cpu/apply_token_bitmask.h"

#include <algorithm>
#include <cstring>

#include "cpu/parallel.h"

namespace vllm_metal::cpu {

namespace {

// B: the dtype's bits; kNegInf: -inf in them.
template <typename B, B kNegInf>
void row(const B* x, B* y, const uint32_t* mask, int64_t len) {  // one piece of a row
  const bool in_place = x == y;
  for (int64_t t0 = 0; t0 < len; t0 += 32) {
    const int64_t n = std::min<int64_t>(32, len - t0);
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

// Tasks are pieces of kPiece tokens of a row, so one masked row of a large vocab
// (a decode step with one structured-output request) still spreads over the cores.
constexpr int64_t kPiece = 16384;  // a multiple of 32: pieces start at a mask word

template <typename B, B kNegInf>
void run(const TokenBitmaskRows& a) {
  auto* x = static_cast<const B*>(a.logits);
  auto* y = static_cast<B*>(a.out);
  const int64_t n = a.vocab;
  const int64_t pieces = (n + kPiece - 1) / kPiece;
  // A fan-out costs ~6 us; a task gets at least ~32 K tokens.
  const int64_t grain = std::max<int64_t>(1, 32768 / std::min(n, kPiece));
  parallel_for(a.num_rows * pieces, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / pieces;
      const int64_t t0 = (task % pieces) * kPiece;
      const int64_t len = std::min(kPiece, n - t0);
      const B* xr = x + r * n + t0;
      B* yr = y + r * n + t0;
      const int32_t m = a.mask_of_row[r];
      if (m >= 0) {
        row<B, kNegInf>(xr, yr, a.bitmask + m * a.mask_words + t0 / 32, len);
      } else if (x != y) {
        std::memcpy(yr, xr, len * sizeof(B));
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
