#include "cpu/moe_gguf.h"

#include <cmath>
#include <vector>

#include "cpu/gguf_matmul.h"
#include "cpu/moe.h"
#include "cpu/parallel.h"

namespace vllm_metal::cpu {

namespace {
// Experts with up to this many rows in a call run batched (decode sizes).
constexpr size_t kBatchedExpertRows = 8;
}  // namespace

void fused_moe_gguf_rows(const MoeGgufRows& a) {
  const int64_t t_n = a.num_tokens, h_n = a.hidden, e_n = a.num_experts, i_n = a.inter,
                k = a.top_k;
  const int64_t slots = t_n * k;
  for (int64_t t = 0; t < t_n; ++t) {
    moe_route_token(a.logits + t * e_n, e_n, k, a.sigmoid, a.renormalize, a.ids + t * k,
                    a.weights + t * k, a.extras.topk_softmax);
  }
  std::vector<std::vector<int64_t>> by_expert(e_n);
  for (int64_t s = 0; s < slots; ++s) by_expert[a.ids[s]].push_back(s);

  // An expert's slots' x rows, its gate / up / act and down results (float32). Experts of a
  // few rows (decode steps) run together: their gate and up mat-muls as one pool job
  // (gguf_matmul_batch), then their down mat-muls as another, where a pool job per expert
  // would leave the threads mostly waiting. Experts of more rows fill the pool alone, one
  // after the other in the same buffers. Tokens sum their experts in expert order either way.
  const int64_t x_row = h_n * (a.elt == Elt::kF32 ? 4 : 2);
  const int64_t gate_rb = gguf::row_bytes(a.gate_type, h_n);
  const int64_t up_rb = gguf::row_bytes(a.up_type, h_n);
  const int64_t down_rb = gguf::row_bytes(a.down_type, i_n);
  const MoeExtras& x = a.extras;
  struct Expert {
    std::vector<float> xe, g, u, d;
    GgufMatmul gate, up, down;
  };
  auto prepare = [&](Expert& ex, int64_t e) {
    const auto& list = by_expert[e];
    const int64_t m = static_cast<int64_t>(list.size());
    ex.xe.resize(m * h_n);
    ex.g.resize(m * i_n);
    ex.u.resize(m * i_n);
    ex.d.resize(m * h_n);
    for (int64_t r = 0; r < m; ++r) {
      to_floats(a.elt, static_cast<const char*>(a.x) + (list[r] / k) * x_row, h_n,
                ex.xe.data() + r * h_n);
    }
    ex.gate = {a.gate_type, a.w_gate + e * i_n * gate_rb, i_n, h_n, Elt::kF32, ex.xe.data(), m,
               ex.g.data(), a.exact};
    ex.up = {a.up_type, a.w_up + e * i_n * up_rb, i_n, h_n, Elt::kF32, ex.xe.data(), m,
             ex.u.data(), a.exact};
    ex.down = {a.down_type, a.w_down + e * h_n * down_rb, h_n, i_n, Elt::kF32, ex.g.data(), m,
               ex.d.data(), a.exact};
  };
  // act = SwiGLU(gate, up) of rows [r0, r1), in place of gate
  auto activate_rows = [&](Expert& ex, int64_t e, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c = 0; c < i_n; ++c) {
        float gv = ex.g[r * i_n + c], uv = ex.u[r * i_n + c];
        if (x.b_gate) gv += x.b_gate[e * i_n + c];
        if (x.b_up) uv += x.b_up[e * i_n + c];
        ex.g[r * i_n + c] = moe_act(gv, uv, x.oai_act);
      }
    }
  };
  std::vector<float> acc(t_n * h_n, 0.0f);
  auto accumulate = [&](const Expert& ex, int64_t e) {
    const auto& list = by_expert[e];
    const float* bd = x.b_down ? x.b_down + e * h_n : nullptr;
    for (size_t r = 0; r < list.size(); ++r) {
      const int64_t s = list[r];
      float* dst = acc.data() + (s / k) * h_n;
      const float w = a.weights[s];
      const float* dr = ex.d.data() + r * h_n;
      for (int64_t h = 0; h < h_n; ++h) dst[h] += w * (dr[h] + (bd ? bd[h] : 0.0f));
    }
  };

  std::vector<Expert> small(e_n);  // indexed by expert; used by the small ones only
  std::vector<GgufMatmul> gate_up, down;
  for (int64_t e = 0; e < e_n; ++e) {
    const size_t m = by_expert[e].size();
    if (m == 0 || m > kBatchedExpertRows) continue;
    prepare(small[e], e);
    gate_up.push_back(small[e].gate);
    gate_up.push_back(small[e].up);
    down.push_back(small[e].down);
  }
  gguf_matmul_batch(gate_up.data(), static_cast<int>(gate_up.size()));
  for (int64_t e = 0; e < e_n; ++e) {
    const int64_t m = static_cast<int64_t>(by_expert[e].size());
    if (m > 0 && m <= static_cast<int64_t>(kBatchedExpertRows)) activate_rows(small[e], e, 0, m);
  }
  gguf_matmul_batch(down.data(), static_cast<int>(down.size()));

  Expert large;
  for (int64_t e = 0; e < e_n; ++e) {
    const size_t m = by_expert[e].size();
    if (m == 0) continue;
    if (m <= kBatchedExpertRows) {
      accumulate(small[e], e);
      continue;
    }
    prepare(large, e);
    GgufMatmul gu[2] = {large.gate, large.up};  // gate and up share x: one pool job
    gguf_matmul_group(gu, 2);
    // prefill sizes: the exponentials of many rows across the pool
    parallel_for(static_cast<int64_t>(m), 16, [&](int64_t r0, int64_t r1) {
      activate_rows(large, e, r0, r1);
    });
    gguf_matmul(large.down);
    accumulate(large, e);
  }
  for (int64_t t = 0; t < t_n; ++t) {
    from_floats(a.elt, acc.data() + t * h_n, h_n, static_cast<char*>(a.out) + t * x_row);
  }
}

}  // namespace vllm_metal::cpu
