#include "cpu/paged_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/attention_vec.h"
#include "cpu/batch_invariant.h"
#include "cpu/paged_attention_blocked.h"
#include "cpu/parallel.h"

namespace vllm_metal::cpu {

std::string check_paged_metadata(const int32_t* block_tables, const int32_t* seq_lens,
                                 const int32_t* cu_seqlens_q, int64_t num_seqs,
                                 int64_t max_blocks, int64_t num_blocks, int64_t block_size,
                                 int64_t num_tokens) {
  auto at = [](const char* what, int64_t i) {
    return std::string(what) + "[" + std::to_string(i) + "]";
  };
  if (cu_seqlens_q[0] != 0) return "cu_seqlens_q[0] must be 0, got " + std::to_string(cu_seqlens_q[0]);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = int64_t(cu_seqlens_q[s + 1]) - cu_seqlens_q[s];
    const int64_t ctx = seq_lens[s];
    if (q_len < 0) return "cu_seqlens_q must not decrease (at " + at("cu_seqlens_q", s + 1) + ")";
    if (ctx < q_len) {
      return at("seq_lens", s) + " = " + std::to_string(ctx) + " is shorter than its " +
          std::to_string(q_len) + " new tokens";
    }
    if (ctx > max_blocks * block_size) {
      return at("seq_lens", s) + " = " + std::to_string(ctx) + " is beyond the block table (" +
          std::to_string(max_blocks) + " blocks of " + std::to_string(block_size) + ")";
    }
    const int64_t used = (ctx + block_size - 1) / block_size;
    for (int64_t b = 0; b < used; ++b) {
      const int64_t id = block_tables[s * max_blocks + b];
      if (id < 0 || id >= num_blocks) {
        return "block_tables[" + std::to_string(s) + ", " + std::to_string(b) + "] = " +
            std::to_string(id) + " is outside the cache's " + std::to_string(num_blocks) +
            " blocks";
      }
    }
  }
  if (cu_seqlens_q[num_seqs] != num_tokens) {
    return "cu_seqlens_q[-1] must equal the number of query tokens " + std::to_string(num_tokens) +
        ", got " + std::to_string(cu_seqlens_q[num_seqs]);
  }
  return "";
}

namespace {

constexpr int64_t kQueryTile = 8;  // query rows sharing one pass over the keys

template <Elt E>
using S = typename EltTraits<E>::Storage;

// One (sequence, kv head, query tile): every query row of the tile times every
// q head of the kv head's group, against the keys the rows can see.
template <Elt E>
void attend_tile(const PagedAttentionParams& p, const AttentionVecOps<E>& ops, int64_t seq,
                 int64_t kv_head, int64_t row_begin, int64_t row_end, std::vector<float>& work) {
  const int64_t d = p.head_size;
  const int64_t groups = p.num_q_heads / p.num_kv_heads;
  const int64_t q_start = p.cu_seqlens_q[seq];
  const int64_t q_len = p.cu_seqlens_q[seq + 1] - q_start;
  const int64_t ctx = p.seq_lens[seq];
  const int64_t rows = row_end - row_begin;
  const int64_t pairs = rows * groups;
  const float neg_inf = -std::numeric_limits<float>::infinity();

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
      const int64_t head = kv_head * groups + g;
      const S<E>* src = qsrc + (q_start + row_begin + r) * p.q_token_stride + head * p.q_head_stride;
      float* dst = q + (r * groups + g) * d;
      to_floats(E, src, d, dst);
      // a sink is one more logit whose value row is zero
      const int64_t pair = r * groups + g;
      m[pair] = p.sinks ? p.sinks[head] : neg_inf;
      l[pair] = p.sinks ? 1.0f : 0.0f;
    }
  }
  std::fill(acc, acc + pairs * d, 0.0f);

  // positions of the tile's first and last query; keys beyond the last are masked for all
  const int64_t first_pos = ctx - q_len + row_begin;
  const int64_t last_pos = ctx - q_len + row_end - 1;
  int64_t key_begin = 0;
  if (p.sliding_window > 0) key_begin = std::max<int64_t>(0, first_pos - p.sliding_window + 1);
  const int64_t key_end = last_pos + 1;

  const auto* kc = static_cast<const S<E>*>(p.key_cache);
  const auto* vc = static_cast<const S<E>*>(p.value_cache);
  const int32_t* table = p.block_tables + seq * p.max_blocks;
  for (int64_t j = key_begin; j < key_end; ++j) {
    const int64_t at = cache_row_offset(p, table, kv_head, j);
    const S<E>* k = kc + at;
    const S<E>* v = vc + at;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = first_pos + r;
      float* rs = rescale + r * groups;
      float* pr = probs + r * groups;
      const bool visible = j <= pos && (p.sliding_window <= 0 || j > pos - p.sliding_window);
      if (!visible) {
        for (int64_t g = 0; g < groups; ++g) {
          rs[g] = 1.0f;
          pr[g] = 0.0f;
        }
        continue;
      }
      float* sc = scores + r * groups;
      ops.dot_groups(q + r * groups * d, k, sc, static_cast<int>(groups), static_cast<int>(d));
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t pair = r * groups + g;
        float s = sc[g] * p.scale;
        if (p.softcap > 0.0f) s = p.softcap * std::tanh(s / p.softcap);
        const float m_new = std::max(m[pair], s);
        rs[g] = std::exp(m[pair] - m_new);  // exp(-inf) = 0 on the first key
        pr[g] = std::exp(s - m_new);
        l[pair] = l[pair] * rs[g] + pr[g];
        m[pair] = m_new;
      }
    }
    // rows whose tile entries are all masked still run through update (p = 0, rescale = 1)
    for (int64_t r = 0; r < rows; ++r) {
      ops.update_groups(acc + r * groups * d, rescale + r * groups, probs + r * groups, v,
                        static_cast<int>(groups), static_cast<int>(d));
    }
  }

  auto* out = static_cast<S<E>*>(p.out);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t pair = r * groups + g;
      const float inv = l[pair] > 0.0f ? 1.0f / l[pair] : 0.0f;
      S<E>* dst = out + ((q_start + row_begin + r) * p.num_q_heads + kv_head * groups + g) * d;
      for (int64_t i = 0; i < d; ++i) EltTraits<E>::store(dst + i, acc[pair * d + i] * inv);
    }
  }
}

struct Task {
  int64_t seq, kv_head, row_begin, row_end;
};

template <Elt E>
void run(const PagedAttentionParams& p) {
  const bool blocked = blocked_attention_available(p.head_size);
  // The blocked kernel sums a one-row tile (decode) differently from a wider one, so in
  // batch-invariant mode every row is its own tile: a token gets the same result whether
  // it decodes, ends a prefill chunk or is recomputed after preemption. The per-key kernel
  // treats each row alike in any tile.
  const int64_t tile = !blocked ? kQueryTile : batch_invariant() ? 1 : kBlockedQueryTile;
  std::vector<Task> tasks;
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    const int64_t q_len = p.cu_seqlens_q[s + 1] - p.cu_seqlens_q[s];
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      for (int64_t r = 0; r < q_len; r += tile) {
        tasks.push_back({s, h, r, std::min(q_len, r + tile)});
      }
    }
  }
  // A fan-out to the pool costs ~6 us (far more on a loaded machine), more than a decode
  // step's few keys take: chunks get at least kMinTaskMacs multiply-adds.
  constexpr int64_t kMinTaskMacs = 256 << 10;
  const int64_t groups = p.num_q_heads / p.num_kv_heads;
  int64_t macs = 0;
  for (const Task& t : tasks) macs += (t.row_end - t.row_begin) * groups * p.seq_lens[t.seq];
  macs *= 2 * p.head_size;  // q.k and p.v
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  const int64_t grain =
      std::max<int64_t>(1, kMinTaskMacs * num_tasks / std::max<int64_t>(1, macs));
  const auto ops = attention_vec_ops<E>(static_cast<int>(p.head_size));
  parallel_for(num_tasks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> work;
    for (int64_t i = begin; i < end; ++i) {
      const Task& t = tasks[i];
      if (blocked) {
        attend_tile_blocked<E>(p, t.seq, t.kv_head, t.row_begin, t.row_end, work);
      } else {
        attend_tile<E>(p, ops, t.seq, t.kv_head, t.row_begin, t.row_end, work);
      }
    }
  });
}

}  // namespace

void paged_attention(const PagedAttentionParams& p) {
  switch (p.elt) {
    case Elt::kF32: return run<Elt::kF32>(p);
    case Elt::kF16: return run<Elt::kF16>(p);
    case Elt::kBF16: return run<Elt::kBF16>(p);
  }
}

}  // namespace vllm_metal::cpu
