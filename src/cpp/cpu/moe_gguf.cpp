#include "cpu/moe_gguf.h"

#include <cmath>
#include <vector>

#include "cpu/gguf_matmul.h"
#include "cpu/moe.h"

namespace vllm_metal::cpu {

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

  const int64_t x_row = h_n * (a.elt == Elt::kF32 ? 4 : 2);
  const int64_t gate_rb = gguf::row_bytes(a.gate_type, h_n);
  const int64_t up_rb = gguf::row_bytes(a.up_type, h_n);
  const int64_t down_rb = gguf::row_bytes(a.down_type, i_n);
  std::vector<float> acc(t_n * h_n, 0.0f);
  std::vector<float> xe, g, u, d;
  for (int64_t e = 0; e < e_n; ++e) {
    const auto& list = by_expert[e];
    const int64_t m = static_cast<int64_t>(list.size());
    if (m == 0) continue;
    xe.resize(m * h_n);
    g.resize(m * i_n);
    u.resize(m * i_n);
    d.resize(m * h_n);
    for (int64_t r = 0; r < m; ++r) {
      to_floats(a.elt, static_cast<const char*>(a.x) + (list[r] / k) * x_row, h_n,
                xe.data() + r * h_n);
    }
    // gate and up share x: one pool job over both matrices' rows (gguf_matmul_group)
    GgufMatmul mats[2];
    mats[0] = {a.gate_type, a.w_gate + e * i_n * gate_rb, i_n, h_n, Elt::kF32, xe.data(), m,
               g.data(), a.exact};
    mats[1] = {a.up_type, a.w_up + e * i_n * up_rb, i_n, h_n, Elt::kF32, xe.data(), m, u.data(),
               a.exact};
    gguf_matmul_group(mats, 2);
    const MoeExtras& x = a.extras;
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t c = 0; c < i_n; ++c) {
        float gv = g[r * i_n + c], uv = u[r * i_n + c];
        if (x.b_gate) gv += x.b_gate[e * i_n + c];
        if (x.b_up) uv += x.b_up[e * i_n + c];
        g[r * i_n + c] = moe_act(gv, uv, x.oai_act);
      }
    }
    GgufMatmul down{a.down_type, a.w_down + e * h_n * down_rb, h_n, i_n, Elt::kF32, g.data(), m,
                    d.data(), a.exact};
    gguf_matmul(down);
    for (int64_t r = 0; r < m; ++r) {
      const int64_t s = list[r];
      float* dst = acc.data() + (s / k) * h_n;
      const float w = a.weights[s];
      const float* bd = x.b_down ? x.b_down + e * h_n : nullptr;
      for (int64_t h = 0; h < h_n; ++h) dst[h] += w * (d[r * h_n + h] + (bd ? bd[h] : 0.0f));
    }
  }
  for (int64_t t = 0; t < t_n; ++t) {
    from_floats(a.elt, acc.data() + t * h_n, h_n, static_cast<char*>(a.out) + t * x_row);
  }
}

}  // namespace vllm_metal::cpu
