#include "cpu/varlen_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/attention_vec.h"
#include "cpu/parallel.h"
#include "cpu/vec_exp.h"

namespace vllm_metal::cpu {

namespace {

// Query rows sharing the keys (converted once a tile). Bidirectional: 128 (at 512 keys the
// float K^T / V of a 32-row tile took a third of its time: 15 -> 25 GMAC/s, one core).
// Causal / windowed: 32, as a tile computes (and masks) every key its last row sees.
constexpr int64_t kQueryTile = 128;
constexpr int64_t kQueryTileMasked = 32;

template <Elt E>
using S = typename EltTraits<E>::Storage;

// Keys [first, end) of a sequence of `len` rows that row `row` sees.
int64_t first_key(const VarlenAttentionParams& p, int64_t row) {
  return p.window > 0 ? std::max<int64_t>(0, row - p.window + 1) : 0;
}
int64_t end_key(const VarlenAttentionParams& p, int64_t row, int64_t len) {
  const int64_t end = p.causal ? row + 1 : len;
  return p.window > 0 ? std::min(end, row + p.window) : end;
}

// Elements from one token's row to the next in q, k and v (the params' 0 means dense).
struct RowStrides {
  int64_t q, k, v;
  explicit RowStrides(const VarlenAttentionParams& p)
      : q(p.q_stride ? p.q_stride : p.num_q_heads * p.head_size),
        k(p.k_stride ? p.k_stride : p.num_kv_heads * p.head_size),
        v(p.v_stride ? p.v_stride : p.num_kv_heads * p.head_size) {}
};

struct Task {
  int64_t seq, kv_head, row_begin, row_end;  // rows relative to the sequence's start
};

template <Elt E>
void attend_tile(const VarlenAttentionParams& p, const AttentionVecOps<E>& ops, const Task& t,
                 std::vector<float>& work) {
  const int64_t d = p.head_size;
  const int64_t groups = p.num_q_heads / p.num_kv_heads;
  const int64_t start = p.cu_seqlens[t.seq];
  const int64_t len = p.cu_seqlens[t.seq + 1] - start;
  const int64_t rows = t.row_end - t.row_begin;
  const int64_t pairs = rows * groups;  // (row, q head of the group)

  // work: q [pairs, d] | acc [pairs, d] | m, l, scores, rescale, probs [pairs]
  work.resize(size_t(pairs) * (2 * d + 5));
  float* q = work.data();
  float* acc = q + pairs * d;
  float* m = acc + pairs * d;
  float* l = m + pairs;
  float* scores = l + pairs;
  float* rescale = scores + pairs;
  float* probs = rescale + pairs;

  const RowStrides stride(p);
  const auto* qsrc = static_cast<const S<E>*>(p.q);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t head = t.kv_head * groups + g;
      to_floats(E, qsrc + (start + t.row_begin + r) * stride.q + head * d, d,
                q + (r * groups + g) * d);
    }
  }
  std::fill(m, m + pairs, -std::numeric_limits<float>::infinity());
  std::fill(l, l + pairs, 0.0f);
  std::fill(acc, acc + pairs * d, 0.0f);

  // the tile's keys: from the first row's first to the last row's end
  const int64_t key_begin = first_key(p, t.row_begin);
  const int64_t key_end = end_key(p, t.row_end - 1, len);
  const auto* ksrc = static_cast<const S<E>*>(p.k);
  const auto* vsrc = static_cast<const S<E>*>(p.v);
  for (int64_t j = key_begin; j < key_end; ++j) {
    const int64_t k_at = (start + j) * stride.k + t.kv_head * d;
    const int64_t v_at = (start + j) * stride.v + t.kv_head * d;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = t.row_begin + r;
      if (j < first_key(p, row) || j >= end_key(p, row, len)) {
        // a key the row does not see (causal, window): p = 0, rescale = 1
        std::fill(rescale + r * groups, rescale + (r + 1) * groups, 1.0f);
        std::fill(probs + r * groups, probs + (r + 1) * groups, 0.0f);
        continue;
      }
      float* sc = scores + r * groups;
      ops.dot_groups(q + r * groups * d, ksrc + k_at, sc, static_cast<int>(groups),
                     static_cast<int>(d));
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t pair = r * groups + g;
        const float s = sc[g] * p.scale;
        const float m_new = std::max(m[pair], s);
        rescale[pair] = std::exp(m[pair] - m_new);  // exp(-inf) = 0 on the first key
        probs[pair] = std::exp(s - m_new);
        l[pair] = l[pair] * rescale[pair] + probs[pair];
        m[pair] = m_new;
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      ops.update_groups(acc + r * groups * d, rescale + r * groups, probs + r * groups,
                        vsrc + v_at, static_cast<int>(groups), static_cast<int>(d));
    }
  }

  auto* out = static_cast<S<E>*>(p.out);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t pair = r * groups + g;
      const float inv = l[pair] > 0.0f ? 1.0f / l[pair] : 0.0f;
      S<E>* dst = out + ((start + t.row_begin + r) * p.num_q_heads + t.kv_head * groups + g) * d;
      for (int64_t i = 0; i < d; ++i) EltTraits<E>::store(dst + i, acc[pair * d + i] * inv);
    }
  }
}

#if defined(__x86_64__)
// (row, q head) pairs sharing each K^T / V load: 6 fill 12 of the 16 ymm registers with sums
// (4 -> 6: 8.3 -> 7.3 ms at 256 x 16 tokens, 58.9 -> 56.7 ms at 8 x 512; one core, CPU time)
constexpr int kPairs = 6;
constexpr int64_t kKeyBlock = 16;  // keys per score block: two vectors

// Scores, softmax and P . V of up to kPairs (row, q head) pairs at once. Scores take 16
// keys (two K^T vectors) and P . V 16 dims (two V vectors) per step, so each step runs
// 2 NP independent FMA chains: with one vector per pair (4 chains) the FMA latency, not
// the units, bounded the kernel (12.7 against torch's 32.9 GMAC/s at 512 keys, one core).
// q [kPairs][d] (scaled), s [kPairs][nk16] scratch; pair pr sees keys
// [first[pr], visible[pr]); kt is [d][nk16] with zero keys after the last.
template <Elt E, int NP>
VLLM_METAL_AVX2 void attend_pairs(const float* kt, const float* vf, int64_t d, int64_t nk16,
                                  const float* q, float* s, const int64_t* first,
                                  const int64_t* visible,
                                  typename EltTraits<E>::Storage* const* dst) {
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 vmax[NP];
  for (int pr = 0; pr < NP; ++pr) vmax[pr] = ninf;
  // keys [lo, hi) every pair sees: no mask there (all of them in bidirectional attention
  // but the zero keys after the last; the masks cost ~15% of a 512-key tile)
  int64_t lo = 0, hi = nk16;
  for (int pr = 0; pr < NP; ++pr) {
    lo = std::max(lo, first[pr]);
    hi = std::min(hi, visible[pr]);
  }
  for (int64_t c = 0; c < nk16; c += kKeyBlock) {
    __m256 acc[NP][2];
    for (int pr = 0; pr < NP; ++pr) acc[pr][0] = acc[pr][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; ++i) {
      const __m256 k0 = _mm256_loadu_ps(kt + i * nk16 + c);
      const __m256 k1 = _mm256_loadu_ps(kt + i * nk16 + c + 8);
      for (int pr = 0; pr < NP; ++pr) {
        const __m256 qv = _mm256_broadcast_ss(q + pr * d + i);
        acc[pr][0] = _mm256_fmadd_ps(qv, k0, acc[pr][0]);
        acc[pr][1] = _mm256_fmadd_ps(qv, k1, acc[pr][1]);
      }
    }
    if (c >= lo && c + kKeyBlock <= hi) {
      for (int pr = 0; pr < NP; ++pr) {
        _mm256_storeu_ps(s + pr * nk16 + c, acc[pr][0]);
        _mm256_storeu_ps(s + pr * nk16 + c + 8, acc[pr][1]);
        vmax[pr] = _mm256_max_ps(vmax[pr], _mm256_max_ps(acc[pr][0], acc[pr][1]));
      }
      continue;
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 idx = _mm256_add_ps(lane, _mm256_set1_ps(float(c + 8 * h)));
      for (int pr = 0; pr < NP; ++pr) {
        // keys at or past `visible` (padding, causal mask) or before `first` (window) -> -inf
        const __m256 hidden = _mm256_or_ps(
            _mm256_cmp_ps(idx, _mm256_set1_ps(float(visible[pr])), _CMP_GE_OQ),
            _mm256_cmp_ps(idx, _mm256_set1_ps(float(first[pr])), _CMP_LT_OQ));
        const __m256 x = _mm256_blendv_ps(acc[pr][h], ninf, hidden);
        _mm256_storeu_ps(s + pr * nk16 + c + 8 * h, x);
        vmax[pr] = _mm256_max_ps(vmax[pr], x);
      }
    }
  }
  float inv[NP];
  int64_t most = 0;
  for (int pr = 0; pr < NP; ++pr) {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, vmax[pr]);
    const __m256 mv = _mm256_set1_ps(*std::max_element(tmp, tmp + 8));
    __m256 vsum = _mm256_setzero_ps();
    float* sp = s + pr * nk16;
    for (int64_t c = 0; c < nk16; c += 8) {
      const __m256 x = _mm256_loadu_ps(sp + c);
      // masked keys get exactly 0 (exp8 clamps, it never returns 0 itself)
      const __m256 e = c >= lo && c + 8 <= hi ? exp8(_mm256_sub_ps(x, mv))
          : _mm256_and_ps(exp8(_mm256_sub_ps(x, mv)), _mm256_cmp_ps(x, ninf, _CMP_NEQ_OQ));
      _mm256_storeu_ps(sp + c, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    _mm256_store_ps(tmp, vsum);
    float l = 0.0f;
    for (float v : tmp) l += v;
    inv[pr] = l > 0.0f ? 1.0f / l : 0.0f;
    most = std::max(most, visible[pr]);
  }
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    __m256 acc[NP][2];
    for (int pr = 0; pr < NP; ++pr) acc[pr][0] = acc[pr][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < most; ++j) {  // a pair's keys past its `visible` have p = 0
      const __m256 v0 = _mm256_loadu_ps(vf + j * d + i);
      const __m256 v1 = _mm256_loadu_ps(vf + j * d + i + 8);
      for (int pr = 0; pr < NP; ++pr) {
        const __m256 pv = _mm256_broadcast_ss(s + pr * nk16 + j);
        acc[pr][0] = _mm256_fmadd_ps(pv, v0, acc[pr][0]);
        acc[pr][1] = _mm256_fmadd_ps(pv, v1, acc[pr][1]);
      }
    }
    for (int pr = 0; pr < NP; ++pr) {
      const __m256 sc = _mm256_set1_ps(inv[pr]);
      store8<E>(dst[pr] + i, _mm256_mul_ps(acc[pr][0], sc));
      store8<E>(dst[pr] + i + 8, _mm256_mul_ps(acc[pr][1], sc));
    }
  }
  if (i < d) {  // head_size % 16 == 8: the last 8 dims
    __m256 acc[NP];
    for (int pr = 0; pr < NP; ++pr) acc[pr] = _mm256_setzero_ps();
    for (int64_t j = 0; j < most; ++j) {
      const __m256 vv = _mm256_loadu_ps(vf + j * d + i);
      for (int pr = 0; pr < NP; ++pr) {
        acc[pr] = _mm256_fmadd_ps(_mm256_broadcast_ss(s + pr * nk16 + j), vv, acc[pr]);
      }
    }
    for (int pr = 0; pr < NP; ++pr) {
      store8<E>(dst[pr] + i, _mm256_mul_ps(acc[pr], _mm256_set1_ps(inv[pr])));
    }
  }
}

// The AVX2 tile (head_size % 8 == 0): the tile's keys are converted once to a float K^T
// [d][nk16] and V [nk][d]; (row, q head) pairs then go kPairs at a time through
// attend_pairs: scores 16 keys a step (no horizontal sums), an exact softmax with the
// AVX2 exp, P . V 16 dims a step. Same math as attend_tile, other summation order.
template <Elt E>
VLLM_METAL_AVX2 void attend_tile_avx2(const VarlenAttentionParams& p, const Task& t,
                                      std::vector<float>& work) {
  const int64_t d = p.head_size;
  const int64_t groups = p.num_q_heads / p.num_kv_heads;
  const int64_t start = p.cu_seqlens[t.seq];
  const int64_t len = p.cu_seqlens[t.seq + 1] - start;
  // the tile's keys [k0, k0 + nk): from the first row's first to the last row's end
  const int64_t k0 = first_key(p, t.row_begin);
  const int64_t nk = end_key(p, t.row_end - 1, len) - k0;
  const int64_t nk16 = (nk + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
  work.resize(size_t(d * nk16 + nk * d + kPairs * (d + nk16)));
  float* kt = work.data();
  float* vf = kt + d * nk16;
  float* q = vf + nk * d;
  float* s = q + kPairs * d;
  const RowStrides stride(p);
  const auto* ksrc = static_cast<const S<E>*>(p.k);
  const auto* vsrc = static_cast<const S<E>*>(p.v);
  for (int64_t j = 0; j < nk; ++j) {
    const S<E>* krow = ksrc + (start + k0 + j) * stride.k + t.kv_head * d;
    const S<E>* vrow = vsrc + (start + k0 + j) * stride.v + t.kv_head * d;
    alignas(32) float tmp[8];
    for (int64_t i = 0; i < d; i += 8) {
      _mm256_store_ps(tmp, load8<E>(krow + i));
      for (int u = 0; u < 8; ++u) kt[(i + u) * nk16 + j] = tmp[u];
      _mm256_storeu_ps(vf + j * d + i, load8<E>(vrow + i));
    }
  }
  for (int64_t i = 0; i < d; ++i) std::fill(kt + i * nk16 + nk, kt + (i + 1) * nk16, 0.0f);

  const auto* qsrc = static_cast<const S<E>*>(p.q);
  auto* out = static_cast<S<E>*>(p.out);
  const __m256 scale = _mm256_set1_ps(p.scale);
  const int64_t pairs = (t.row_end - t.row_begin) * groups;
  for (int64_t p0 = 0; p0 < pairs; p0 += kPairs) {
    const int np = static_cast<int>(std::min<int64_t>(kPairs, pairs - p0));
    int64_t first[kPairs];
    int64_t visible[kPairs];
    S<E>* dst[kPairs];
    for (int pr = 0; pr < np; ++pr) {
      const int64_t r = t.row_begin + (p0 + pr) / groups;
      const int64_t head = t.kv_head * groups + (p0 + pr) % groups;
      const S<E>* qrow = qsrc + (start + r) * stride.q + head * d;
      for (int64_t i = 0; i < d; i += 8) {
        _mm256_storeu_ps(q + pr * d + i, _mm256_mul_ps(load8<E>(qrow + i), scale));
      }
      first[pr] = first_key(p, r) - k0;
      visible[pr] = end_key(p, r, len) - k0;
      dst[pr] = out + ((start + r) * p.num_q_heads + head) * d;
    }
    switch (np) {
      case 6: attend_pairs<E, 6>(kt, vf, d, nk16, q, s, first, visible, dst); break;
      case 5: attend_pairs<E, 5>(kt, vf, d, nk16, q, s, first, visible, dst); break;
      case 4: attend_pairs<E, 4>(kt, vf, d, nk16, q, s, first, visible, dst); break;
      case 3: attend_pairs<E, 3>(kt, vf, d, nk16, q, s, first, visible, dst); break;
      case 2: attend_pairs<E, 2>(kt, vf, d, nk16, q, s, first, visible, dst); break;
      default: attend_pairs<E, 1>(kt, vf, d, nk16, q, s, first, visible, dst); break;
    }
  }
}
#endif

template <Elt E>
void run(const VarlenAttentionParams& p) {
  std::vector<Task> tasks;
  int64_t macs = 0;
  const int64_t tile = p.causal || p.window > 0 ? kQueryTileMasked : kQueryTile;
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    const int64_t len = p.cu_seqlens[s + 1] - p.cu_seqlens[s];
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      for (int64_t r = 0; r < len; r += tile) {
        tasks.push_back({s, h, r, std::min(len, r + tile)});
        const int64_t row_end = tasks.back().row_end;
        macs += (row_end - r) * (end_key(p, row_end - 1, len) - first_key(p, r));
      }
    }
  }
  // chunks of at least kMinTaskMacs multiply-adds: a fan-out to the pool costs microseconds
  constexpr int64_t kMinTaskMacs = 256 << 10;
  const int64_t groups = p.num_q_heads / p.num_kv_heads;
  macs *= 2 * groups * p.head_size;
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  const int64_t grain =
      std::max<int64_t>(1, kMinTaskMacs * num_tasks / std::max<int64_t>(1, macs));
  const auto ops = attention_vec_ops<E>(static_cast<int>(p.head_size));
  bool avx2 = false;
#if defined(__x86_64__)
  avx2 = has_avx2_fma() && p.head_size % 8 == 0;
#endif
  parallel_for(num_tasks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> work;
    for (int64_t i = begin; i < end; ++i) {
#if defined(__x86_64__)
      if (avx2) {
        attend_tile_avx2<E>(p, tasks[i], work);
        continue;
      }
#endif
      attend_tile<E>(p, ops, tasks[i], work);
    }
  });
}

}  // namespace

void varlen_attention(const VarlenAttentionParams& p) {
  switch (p.elt) {
    case Elt::kF32: return run<Elt::kF32>(p);
    case Elt::kF16: return run<Elt::kF16>(p);
    case Elt::kBF16: return run<Elt::kBF16>(p);
  }
}

}  // namespace vllm_metal::cpu
