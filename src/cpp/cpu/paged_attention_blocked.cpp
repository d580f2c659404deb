#include "cpu/paged_attention_blocked.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "cpu/vec_exp.h"

namespace vllm_metal::cpu {

#if defined(__x86_64__)

namespace {

template <Elt E>
using S = typename EltTraits<E>::Storage;

constexpr int64_t KB = kAttentionKeyBlock;
constexpr int kLanes = 8;
constexpr int kKeyVecs = KB / kLanes;  // score vectors per query row and block

VLLM_METAL_AVX2 inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// The block's keys as kt [d][KB] (transposed: a row of 8 keys per vector) and its
// values as vb [KB][d], in float; keys past nk are zero.
template <Elt E>
VLLM_METAL_AVX2 void load_block(const PagedAttentionParams& p, const int32_t* table,
                                int64_t kv_head, int64_t j0, int64_t nk, float* kt, float* vb) {
  const int64_t d = p.head_size;
  const auto* kc = static_cast<const S<E>*>(p.key_cache);
  const auto* vc = static_cast<const S<E>*>(p.value_cache);
  if (nk < KB) std::fill(kt, kt + d * KB, 0.0f);
  alignas(32) float tmp[kLanes];
  for (int64_t jj = 0; jj < nk; ++jj) {
    const int64_t j = j0 + jj;
    const int64_t at = cache_row_offset(p, table, kv_head, j);
    const S<E>* k = kc + at;
    const S<E>* v = vc + at;
    for (int64_t i = 0; i < d; i += kLanes) {
      _mm256_store_ps(tmp, load8<E>(k + i));
      for (int t = 0; t < kLanes; ++t) kt[(i + t) * KB + jj] = tmp[t];
      _mm256_storeu_ps(vb + jj * d + i, load8<E>(v + i));
    }
  }
}

// The softmax state of one query row for the q heads of kv_head's group: q [groups, d] in
// float, acc [groups, d] zero, and m, l [groups] empty (a sink is one more logit whose
// value row is zero: m = sink, l = 1).
template <Elt E>
VLLM_METAL_AVX2 void start_row(const PagedAttentionParams& p, int64_t token, int64_t kv_head,
                               float* q, float* acc, float* m, float* l) {
  const int64_t d = p.head_size, groups = p.num_q_heads / p.num_kv_heads;
  const auto* qsrc = static_cast<const S<E>*>(p.q) + token * p.q_token_stride;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t head = kv_head * groups + g;
    const S<E>* src = qsrc + head * p.q_head_stride;
    for (int64_t i = 0; i < d; i += kLanes) _mm256_storeu_ps(q + g * d + i, load8<E>(src + i));
    m[g] = p.sinks ? p.sinks[head] : -std::numeric_limits<float>::infinity();
    l[g] = p.sinks ? 1.0f : 0.0f;
  }
  std::fill(acc, acc + groups * d, 0.0f);
}

// out[token, head] = acc / l for the q heads of kv_head's group (acc [groups, d], l [groups]).
template <Elt E>
VLLM_METAL_AVX2 void store_row(const PagedAttentionParams& p, int64_t token, int64_t kv_head,
                               const float* acc, const float* l) {
  const int64_t d = p.head_size, groups = p.num_q_heads / p.num_kv_heads;
  S<E>* out = static_cast<S<E>*>(p.out) + (token * p.num_q_heads + kv_head * groups) * d;
  for (int64_t g = 0; g < groups; ++g) {
    const __m256 inv = _mm256_set1_ps(l[g] > 0.0f ? 1.0f / l[g] : 0.0f);
    for (int64_t i = 0; i < d; i += kLanes) {
      store8<E>(out + g * d + i, _mm256_mul_ps(_mm256_loadu_ps(acc + g * d + i), inv));
    }
  }
}

// acc [d] = acc * rescale + sum_jj probs[jj] * vb[jj], 64 dims at a time in registers.
VLLM_METAL_AVX2 void accumulate(float* acc, float rescale, const float* probs, const float* vb,
                                int64_t nk, int64_t d) {
  const __m256 r = _mm256_set1_ps(rescale);
  for (int64_t c0 = 0; c0 < d; c0 += 64) {
    const int nv = static_cast<int>(std::min<int64_t>(64, d - c0) / kLanes);
    __m256 a[8];
    for (int c = 0; c < nv; ++c) a[c] = _mm256_mul_ps(_mm256_loadu_ps(acc + c0 + c * kLanes), r);
    for (int64_t jj = 0; jj < nk; ++jj) {
      const __m256 pj = _mm256_set1_ps(probs[jj]);
      const float* v = vb + jj * d + c0;
      for (int c = 0; c < nv; ++c) a[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + c * kLanes), a[c]);
    }
    for (int c = 0; c < nv; ++c) _mm256_storeu_ps(acc + c0 + c * kLanes, a[c]);
  }
}

template <Elt E>
VLLM_METAL_AVX2 void tile_avx2(const PagedAttentionParams& p, int64_t seq, int64_t kv_head,
                               int64_t row_begin, int64_t row_end, std::vector<float>& work) {
  const int64_t d = p.head_size;
  const int64_t groups = p.num_q_heads / p.num_kv_heads;
  const int64_t q_start = p.cu_seqlens_q[seq];
  const int64_t q_len = p.cu_seqlens_q[seq + 1] - q_start;
  const int64_t ctx = p.seq_lens[seq];
  const int64_t rows = row_end - row_begin;
  const int64_t pairs = rows * groups;  // (query row, q head) pairs, row-major
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // work: q [pairs, d] | acc [pairs, d] | m, l [pairs] | kt [d, KB] | vb [KB, d] | probs [KB]
  work.resize(size_t(pairs) * (2 * d + 2) + 2 * d * KB + KB + kLanes);
  float* q = work.data();
  float* acc = q + pairs * d;
  float* m = acc + pairs * d;
  float* l = m + pairs;
  float* kt = l + pairs;
  float* vb = kt + d * KB;
  float* probs = vb + KB * d;

  for (int64_t r = 0; r < rows; ++r) {
    const int64_t at = r * groups;
    start_row<E>(p, q_start + row_begin + r, kv_head, q + at * d, acc + at * d, m + at, l + at);
  }

  const int64_t first_pos = ctx - q_len + row_begin;
  const int64_t last_pos = ctx - q_len + row_end - 1;
  int64_t key_begin = 0;
  if (p.sliding_window > 0) key_begin = std::max<int64_t>(0, first_pos - p.sliding_window + 1);
  const int64_t key_end = last_pos + 1;
  const int32_t* table = p.block_tables + seq * p.max_blocks;
  const __m256 scale = _mm256_set1_ps(p.scale), ninf = _mm256_set1_ps(neg_inf);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);

  for (int64_t j0 = key_begin; j0 < key_end; j0 += KB) {
    const int64_t nk = std::min(KB, key_end - j0);
    load_block<E>(p, table, kv_head, j0, nk, kt, vb);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = first_pos + r;
      // keys j of the block this row sees: j <= pos, j > pos - window, j < j0 + nk
      const int64_t hi = std::min(pos, j0 + nk - 1);
      const int64_t lo = p.sliding_window > 0 ? std::max(j0, pos - p.sliding_window + 1) : j0;
      if (hi < lo) continue;  // nothing visible: p = 0, rescale = 1 leaves the row as is
      const __m256i vlo = _mm256_set1_epi32(static_cast<int>(lo - j0));
      const __m256i vhi = _mm256_set1_epi32(static_cast<int>(hi - j0));
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t pair = r * groups + g;
        const float* qp = q + pair * d;
        // two chains over the head dimension (even and odd i): half the FMA latency
        // chain, and float sums half as long
        __m256 s[kKeyVecs], s2[kKeyVecs];
        for (int c = 0; c < kKeyVecs; ++c) s[c] = s2[c] = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 2) {
          const __m256 qi = _mm256_broadcast_ss(qp + i), qj = _mm256_broadcast_ss(qp + i + 1);
          const float* krow = kt + i * KB;
          for (int c = 0; c < kKeyVecs; ++c) {
            s[c] = _mm256_fmadd_ps(qi, _mm256_loadu_ps(krow + c * kLanes), s[c]);
            s2[c] = _mm256_fmadd_ps(qj, _mm256_loadu_ps(krow + KB + c * kLanes), s2[c]);
          }
        }
        for (int c = 0; c < kKeyVecs; ++c) s[c] = _mm256_add_ps(s[c], s2[c]);
        __m256 bmax = ninf;
        __m256 visible[kKeyVecs];
        for (int c = 0; c < kKeyVecs; ++c) {
          s[c] = _mm256_mul_ps(s[c], scale);
          if (p.softcap > 0.0f) {
            alignas(32) float t[kLanes];
            _mm256_store_ps(t, s[c]);
            for (float& v : t) v = p.softcap * std::tanh(v / p.softcap);
            s[c] = _mm256_load_ps(t);
          }
          const __m256i jj = _mm256_add_epi32(lane, _mm256_set1_epi32(c * kLanes));
          const __m256i out = _mm256_or_si256(_mm256_cmpgt_epi32(vlo, jj), _mm256_cmpgt_epi32(jj, vhi));
          visible[c] = _mm256_castsi256_ps(_mm256_xor_si256(out, _mm256_set1_epi32(-1)));
          s[c] = _mm256_blendv_ps(ninf, s[c], visible[c]);
          bmax = _mm256_max_ps(bmax, s[c]);
        }
        const float m_new = std::max(m[pair], hmax8(bmax));
        const float rescale = std::exp(m[pair] - m_new);  // exp(-inf) = 0 on the first keys
        const __m256 mn = _mm256_set1_ps(m_new);
        __m256 sum = _mm256_setzero_ps();
        for (int c = 0; c < kKeyVecs; ++c) {
          // masked lanes are exactly 0 (exp8 clamps, so its -inf would be ~1e-38)
          const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(s[c], mn)), visible[c]);
          sum = _mm256_add_ps(sum, e);
          _mm256_storeu_ps(probs + c * kLanes, e);
        }
        l[pair] = l[pair] * rescale + hsum8(sum);
        m[pair] = m_new;
        accumulate(acc + pair * d, rescale, probs, vb, nk, d);
      }
    }
  }

  for (int64_t r = 0; r < rows; ++r) {
    store_row<E>(p, q_start + row_begin + r, kv_head, acc + r * groups * d, l + r * groups);
  }
}

// Scores of one key against G heads of q [G][d], the key converted once per 8 lanes.
// G is a template argument so the accumulators stay in registers.
template <Elt E, int G>
VLLM_METAL_AVX2 void key_scores(const S<E>* k, const float* q, int64_t d, float scale,
                                float* out, int64_t out_stride) {
  __m256 a[G];
  for (int g = 0; g < G; ++g) a[g] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += kLanes) {
    const __m256 kv = load8<E>(k + i);
    for (int g = 0; g < G; ++g) a[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * d + i), kv, a[g]);
  }
  for (int g = 0; g < G; ++g) out[g * out_stride] = hsum8(a[g]) * scale;
}

// acc [G][d] = acc * rescale[g] + sum_j probs[g][j] v_j over nk value rows, 32 dims at a
// time: each value vector is converted once for all G heads.
template <Elt E, int G>
VLLM_METAL_AVX2 void accumulate_values(const S<E>* const* vrows, int64_t nk, const float* probs,
                                       const float* rescale, int64_t d, float* acc) {
  constexpr int kV = 4;  // 4 x 8 dims: G * 4 accumulators + 4 values in 16 registers (G <= 2)
  for (int64_t c0 = 0; c0 < d; c0 += kV * kLanes) {
    const int nv = static_cast<int>(std::min<int64_t>(kV * kLanes, d - c0) / kLanes);
    __m256 av[G][kV];
    for (int g = 0; g < G; ++g) {
      const __m256 r = _mm256_set1_ps(rescale[g]);
      for (int c = 0; c < kV; ++c) {
        av[g][c] = c < nv ? _mm256_mul_ps(_mm256_loadu_ps(acc + g * d + c0 + c * kLanes), r)
                          : _mm256_setzero_ps();
      }
    }
    for (int64_t j = 0; j < nk; ++j) {
      __m256 v[kV];
      for (int c = 0; c < kV; ++c) v[c] = c < nv ? load8<E>(vrows[j] + c0 + c * kLanes) : _mm256_setzero_ps();
      for (int g = 0; g < G; ++g) {
        const __m256 pj = _mm256_set1_ps(probs[g * KB + j]);
        for (int c = 0; c < kV; ++c) av[g][c] = _mm256_fmadd_ps(pj, v[c], av[g][c]);
      }
    }
    for (int g = 0; g < G; ++g) {
      for (int c = 0; c < nv; ++c) _mm256_storeu_ps(acc + g * d + c0 + c * kLanes, av[g][c]);
    }
  }
}

// How far ahead of the key being dotted a decode row fetches keys and values.
constexpr int64_t kPrefetchKeys = 16;

// One query row (a decode row), every q head of the group: the block's scores come from
// dots against the cached keys where they lie (no staging: one row cannot amortize the
// transpose), then one softmax update per block with a vectorized exp, and P . V reads the
// cached values directly.
template <Elt E>
VLLM_METAL_AVX2 void row_avx2(const PagedAttentionParams& p, int64_t seq, int64_t kv_head,
                              int64_t row, std::vector<float>& work) {
  const int64_t d = p.head_size;
  const int64_t groups = p.num_q_heads / p.num_kv_heads;
  const int64_t q_start = p.cu_seqlens_q[seq];
  const int64_t q_len = p.cu_seqlens_q[seq + 1] - q_start;
  const int64_t pos = p.seq_lens[seq] - q_len + row;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // work: q [groups, d] | acc [groups, d] | scores [groups, KB] | m, l, rescale [groups]
  work.resize(size_t(groups) * (2 * d + KB + 3) + kLanes);
  float* q = work.data();
  float* acc = q + groups * d;
  float* scores = acc + groups * d;
  float* m = scores + KB * groups;
  float* l = m + groups;
  float* rescale = l + groups;
  start_row<E>(p, q_start + row, kv_head, q, acc, m, l);
  const int64_t key_begin =
      p.sliding_window > 0 ? std::max<int64_t>(0, pos - p.sliding_window + 1) : 0;
  const int32_t* table = p.block_tables + seq * p.max_blocks;
  const auto* kc = static_cast<const S<E>*>(p.key_cache);
  const auto* vc = static_cast<const S<E>*>(p.value_cache);
  const S<E>* vrows[KB];
  using ScoresFn = void (*)(const S<E>*, const float*, int64_t, float, float*, int64_t);
  static constexpr ScoresFn kScores[] = {key_scores<E, 1>, key_scores<E, 2>, key_scores<E, 3>,
                                         key_scores<E, 4>};
  for (int64_t j0 = key_begin; j0 <= pos; j0 += KB) {
    const int64_t nk = std::min(KB, pos + 1 - j0);
    for (int64_t jj = 0; jj < nk; ++jj) {
      const int64_t j = j0 + jj;
      const int64_t at = cache_row_offset(p, table, kv_head, j);
      const S<E>* k = kc + at;
      vrows[jj] = vc + at;
      // A decode batch's caches outgrow the L3 and one key's dots are too long a loop
      // for the core to run ahead to the next keys' loads: fetch the key and value rows
      // kPrefetchKeys on early.
      if (j + kPrefetchKeys <= pos) {
        const int64_t ahead = cache_row_offset(p, table, kv_head, j + kPrefetchKeys);
        prefetch_bytes(kc + ahead, d * sizeof(S<E>));
        prefetch_bytes(vc + ahead, d * sizeof(S<E>));
      }
      // the key dotted with every head of the group, up to 4 heads per pass
      for (int64_t g0 = 0; g0 < groups; g0 += 4) {
        kScores[std::min<int64_t>(4, groups - g0) - 1](k, q + g0 * d, d, p.scale,
                                                       scores + g0 * KB + jj, KB);
      }
    }
    // per head: the block's probabilities (in place of its scores) and the rescale
    for (int64_t g = 0; g < groups; ++g) {
      float* sg = scores + g * KB;
      float bmax = neg_inf;
      for (int64_t jj = 0; jj < nk; ++jj) {
        if (p.softcap > 0.0f) sg[jj] = p.softcap * std::tanh(sg[jj] / p.softcap);
        bmax = std::max(bmax, sg[jj]);
      }
      const float m_new = std::max(m[g], bmax);
      rescale[g] = std::exp(m[g] - m_new);  // exp(-inf) = 0 on the first keys
      const __m256 mn = _mm256_set1_ps(m_new);
      float sum = 0.0f;
      int64_t jj = 0;
      for (; jj + kLanes <= nk; jj += kLanes) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + jj), mn));
        _mm256_storeu_ps(sg + jj, e);
        sum += hsum8(e);
      }
      for (; jj < nk; ++jj) {
        sg[jj] = std::exp(sg[jj] - m_new);
        sum += sg[jj];
      }
      l[g] = l[g] * rescale[g] + sum;
      m[g] = m_new;
    }
    for (int64_t g0 = 0; g0 < groups; g0 += 2) {
      const int64_t ng = std::min<int64_t>(2, groups - g0);
      (ng == 2 ? accumulate_values<E, 2> : accumulate_values<E, 1>)(
          vrows, nk, scores + g0 * KB, rescale + g0, d, acc + g0 * d);
    }
  }
  store_row<E>(p, q_start + row, kv_head, acc, l);
}

}  // namespace

bool blocked_attention_available(int64_t head_size) {
  return head_size % kLanes == 0 && has_avx2_fma();
}

template <Elt E>
void attend_tile_blocked(const PagedAttentionParams& p, int64_t seq, int64_t kv_head,
                         int64_t row_begin, int64_t row_end, std::vector<float>& work) {
  if (row_end - row_begin == 1) return row_avx2<E>(p, seq, kv_head, row_begin, work);
  tile_avx2<E>(p, seq, kv_head, row_begin, row_end, work);
}

template void attend_tile_blocked<Elt::kF32>(const PagedAttentionParams&, int64_t, int64_t,
                                             int64_t, int64_t, std::vector<float>&);
template void attend_tile_blocked<Elt::kF16>(const PagedAttentionParams&, int64_t, int64_t,
                                             int64_t, int64_t, std::vector<float>&);
template void attend_tile_blocked<Elt::kBF16>(const PagedAttentionParams&, int64_t, int64_t,
                                              int64_t, int64_t, std::vector<float>&);

#else  // not x86-64: the per-key kernel serves every head size

bool blocked_attention_available(int64_t) { return false; }

template <Elt E>
void attend_tile_blocked(const PagedAttentionParams&, int64_t, int64_t, int64_t, int64_t,
                         std::vector<float>&) {}

template void attend_tile_blocked<Elt::kF32>(const PagedAttentionParams&, int64_t, int64_t,
                                             int64_t, int64_t, std::vector<float>&);
template void attend_tile_blocked<Elt::kF16>(const PagedAttentionParams&, int64_t, int64_t,
                                             int64_t, int64_t, std::vector<float>&);
template void attend_tile_blocked<Elt::kBF16>(const PagedAttentionParams&, int64_t, int64_t,
                                              int64_t, int64_t, std::vector<float>&);

#endif

}  // namespace vllm_metal::cpu
