#include "cpu/moe.h"

#include <algorithm>
#include <cmath>

#include "cpu/moe_gguf.h"

namespace vllm_metal::cpu {

void moe_route_token(const float* logits, int64_t num_experts, int64_t top_k, bool sigmoid,
                     bool renormalize, int32_t* ids, float* weights, bool topk_softmax) {
  float mx = -INFINITY;
  for (int64_t e = 0; e < num_experts; ++e) mx = std::max(mx, logits[e]);
  float denom = 0.0f;
  if (!sigmoid) {
    for (int64_t e = 0; e < num_experts; ++e) denom += std::exp(logits[e] - mx);
  }
  // k passes of selection in the order (larger logit, then lower id), as the Metal kernel
  float pv = INFINITY;
  int64_t pi = 0;
  float total = 0.0f, first = 0.0f;
  for (int64_t j = 0; j < top_k; ++j) {
    float best = -INFINITY;
    int64_t bi = num_experts;
    for (int64_t e = 0; e < num_experts; ++e) {
      const float v = logits[e];
      const bool ok = j == 0 || v < pv || (v == pv && e > pi);
      if (ok && (bi == num_experts || v > best)) {
        best = v;
        bi = e;
      }
    }
    pv = best;
    pi = bi;
    if (j == 0) first = best;
    // top-k softmax: the first pick is the largest logit, so exp(best - first) <= 1
    const float w = topk_softmax ? std::exp(best - first)
                    : sigmoid    ? 1.0f / (1.0f + std::exp(-best))
                                 : std::exp(best - mx) / denom;
    ids[j] = static_cast<int32_t>(bi);
    weights[j] = w;
    total += w;
  }
  if ((renormalize || topk_softmax) && total > 0.0f) {
    for (int64_t j = 0; j < top_k; ++j) weights[j] /= total;
  }
}

void fused_moe_rows(const MoeRows& a) {
  // Dense experts are GGUF tensors of type F32 / F16 / BF16 (block size 1): the GGUF
  // path's per-expert gguf_matmul runs them with float32 x (no 8-bit rounding).
  MoeGgufRows g;
  g.elt = a.elt;
  g.x = a.x;
  g.logits = a.logits;
  g.w_gate = static_cast<const uint8_t*>(a.w_gate);
  g.w_up = static_cast<const uint8_t*>(a.w_up);
  g.w_down = static_cast<const uint8_t*>(a.w_down);
  const gguf::GGMLType type = a.w_elt == Elt::kF32   ? gguf::GGMLType::kF32
                              : a.w_elt == Elt::kF16 ? gguf::GGMLType::kF16
                                                     : gguf::GGMLType::kBF16;
  g.gate_type = g.up_type = g.down_type = type;
  g.out = a.out;
  g.ids = a.ids;
  g.weights = a.weights;
  g.num_tokens = a.num_tokens;
  g.hidden = a.hidden;
  g.num_experts = a.num_experts;
  g.inter = a.inter;
  g.top_k = a.top_k;
  g.renormalize = a.renormalize;
  g.sigmoid = a.sigmoid;
  g.exact = true;
  g.extras = a.extras;
  fused_moe_gguf_rows(g);
}

}  // namespace vllm_metal::cpu
