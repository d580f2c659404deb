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

constexpr int64_t kQueryTile = 32;  // query rows sharing the keys (converted once a tile)

template <Elt E>
using S = typename EltTraits<E>::Storage;

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

  const auto* qsrc = static_cast<const S<E>*>(p.q);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t head = t.kv_head * groups + g;
      to_floats(E, qsrc + ((start + t.row_begin + r) * p.num_q_heads + head) * d, d,
                q + (r * groups + g) * d);
    }
  }
  std::fill(m, m + pairs, -std::numeric_limits<float>::infinity());
  std::fill(l, l + pairs, 0.0f);
  std::fill(acc, acc + pairs * d, 0.0f);

  const int64_t key_end = p.causal ? t.row_end : len;
  const auto* ksrc = static_cast<const S<E>*>(p.k);
  const auto* vsrc = static_cast<const S<E>*>(p.v);
  for (int64_t j = 0; j < key_end; ++j) {
    const int64_t at = ((start + j) * p.num_kv_heads + t.kv_head) * d;
    // causal: rows before j skip the key (p = 0, rescale = 1); they form a prefix of the tile
    const int64_t first = p.causal ? std::max<int64_t>(0, j - t.row_begin) : 0;
    for (int64_t r = 0; r < first; ++r) {
      std::fill(rescale + r * groups, rescale + (r + 1) * groups, 1.0f);
      std::fill(probs + r * groups, probs + (r + 1) * groups, 0.0f);
    }
    for (int64_t r = first; r < rows; ++r) {
      float* sc = scores + r * groups;
      ops.dot_groups(q + r * groups * d, ksrc + at, sc, static_cast<int>(groups),
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
    for (int64_t r = first; r < rows; ++r) {
      ops.update_groups(acc + r * groups * d, rescale + r * groups, probs + r * groups,
                        vsrc + at, static_cast<int>(groups), static_cast<int>(d));
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
// The AVX2 tile (head_size % 8 == 0): the tile's keys are converted once to a float K^T
// [d][nk8] and V [nk][d]; each (row, q head) pair gets its scores for all keys in
// registers 8 keys at a time (no horizontal sums), an exact softmax over them with a
// vectorized exp, then P . V 8 dims at a time. Same math as attend_tile, other order.
template <Elt E>
VLLM_METAL_AVX2 void attend_tile_avx2(const VarlenAttentionParams& p, const Task& t,
                                      std::vector<float>& work) {
  const int64_t d = p.head_size;
  const int64_t groups = p.num_q_heads / p.num_kv_heads;
  const int64_t start = p.cu_seqlens[t.seq];
  const int64_t nk = p.causal ? t.row_end : p.cu_seqlens[t.seq + 1] - start;
  const int64_t nk8 = (nk + 7) / 8 * 8;
  work.resize(size_t(d * nk8 + nk * d + d + nk8));
  float* kt = work.data();
  float* vf = kt + d * nk8;
  float* q = vf + nk * d;
  float* s = q + d;
  const auto* ksrc = static_cast<const S<E>*>(p.k);
  const auto* vsrc = static_cast<const S<E>*>(p.v);
  for (int64_t j = 0; j < nk; ++j) {
    const int64_t at = ((start + j) * p.num_kv_heads + t.kv_head) * d;
    alignas(32) float tmp[8];
    for (int64_t i = 0; i < d; i += 8) {
      _mm256_store_ps(tmp, load8<E>(ksrc + at + i));
      for (int u = 0; u < 8; ++u) kt[(i + u) * nk8 + j] = tmp[u];
      _mm256_storeu_ps(vf + j * d + i, load8<E>(vsrc + at + i));
    }
  }
  for (int64_t i = 0; i < d; ++i) std::fill(kt + i * nk8 + nk, kt + (i + 1) * nk8, 0.0f);

  const auto* qsrc = static_cast<const S<E>*>(p.q);
  auto* out = static_cast<S<E>*>(p.out);
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t r = t.row_begin; r < t.row_end; ++r) {
    const int64_t visible = p.causal ? r + 1 : nk;  // keys [0, visible) of the sequence
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t head = t.kv_head * groups + g;
      const int64_t row_at = ((start + r) * p.num_q_heads + head) * d;
      const __m256 scale = _mm256_set1_ps(p.scale);
      for (int64_t i = 0; i < d; i += 8) {
        _mm256_storeu_ps(q + i, _mm256_mul_ps(load8<E>(qsrc + row_at + i), scale));
      }
      __m256 vmax = ninf;
      for (int64_t c = 0; c < nk8; c += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; ++i) {
          acc = _mm256_fmadd_ps(_mm256_broadcast_ss(q + i), _mm256_loadu_ps(kt + i * nk8 + c), acc);
        }
        // keys at or past `visible` (padding, causal mask) -> -inf
        const __m256 idx = _mm256_add_ps(lane, _mm256_set1_ps(float(c)));
        acc = _mm256_blendv_ps(acc, ninf, _mm256_cmp_ps(idx, _mm256_set1_ps(float(visible)), _CMP_GE_OQ));
        _mm256_storeu_ps(s + c, acc);
        vmax = _mm256_max_ps(vmax, acc);
      }
      alignas(32) float tmp[8];
      _mm256_store_ps(tmp, vmax);
      const float m = *std::max_element(tmp, tmp + 8);
      const __m256 mv = _mm256_set1_ps(m);
      __m256 vsum = _mm256_setzero_ps();
      for (int64_t c = 0; c < nk8; c += 8) {
        const __m256 x = _mm256_loadu_ps(s + c);
        const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(x, mv)), _mm256_cmp_ps(x, ninf, _CMP_NEQ_OQ));
        _mm256_storeu_ps(s + c, e);
        vsum = _mm256_add_ps(vsum, e);
      }
      _mm256_store_ps(tmp, vsum);
      float l = 0.0f;
      for (float v : tmp) l += v;
      const __m256 inv = _mm256_set1_ps(l > 0.0f ? 1.0f / l : 0.0f);
      for (int64_t i = 0; i < d; i += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t j = 0; j < visible; ++j) {
          acc = _mm256_fmadd_ps(_mm256_broadcast_ss(s + j), _mm256_loadu_ps(vf + j * d + i), acc);
        }
        store8<E>(out + row_at + i, _mm256_mul_ps(acc, inv));
      }
    }
  }
}
#endif

template <Elt E>
void run(const VarlenAttentionParams& p) {
  std::vector<Task> tasks;
  int64_t macs = 0;
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    const int64_t len = p.cu_seqlens[s + 1] - p.cu_seqlens[s];
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      for (int64_t r = 0; r < len; r += kQueryTile) {
        tasks.push_back({s, h, r, std::min(len, r + kQueryTile)});
        macs += (tasks.back().row_end - r) * (p.causal ? tasks.back().row_end : len);
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
