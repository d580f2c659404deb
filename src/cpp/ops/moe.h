// fused_moe: the sparse mixture-of-experts MLP of Qwen3-MoE / OLMoE-style models
// in one op: routing, then per expert a SwiGLU MLP over the tokens routed to it.
//
//   hidden         [T, H] float32/float16/bfloat16
//   router_logits  [T, E] any float dtype (computed on in float32)
//   w_gate, w_up   [E, I, H] one float dtype (may differ from hidden's)
//   w_down         [E, H, I] same dtype as w_gate
//   top_k          1 <= top_k <= E
//   scoring        "softmax": p = softmax(logits) over all E experts;
//                  "sigmoid": p = sigmoid(logits)
//                  "softmax_topk": p = softmax over the k chosen logits (gpt-oss)
//   renormalize    divide the top-k p by their sum (Qwen3-MoE's norm_topk_prob)
//   options        gpt-oss's variations (MoeOptions): per-expert biases b_gate, b_up
//                  [E, I] and b_down [E, H] (all or none, any float dtype, used in
//                  float32), activation "swiglu_oai":
//                    g = min(gate + b_gate, 7), u = clamp(up + b_up, -7, 7),
//                    act = (u + 1) * g * sigmoid(1.702 g)
//                  and out[t] = sum_j p_j (W_down[e_j] act + b_down[e_j])
//
// Experts are the top_k largest logits (ties to the lower expert id), and
//   out[t] = sum_j p[t, e_j] * W_down[e_j] (silu(W_gate[e_j] x_t) * (W_up[e_j] x_t))
// in float32, rounded once to hidden's dtype. Tokens are grouped by expert, so
// each expert's weights are read once per call whatever the number of tokens.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/utils.h"
#include "ops/kernel_primitive.h"

namespace vllm_metal {

struct MoeOptions {
  std::string activation = "silu";  // or "swiglu_oai"
  std::optional<mx::array> b_gate, b_up, b_down;
};

mx::array fused_moe(const mx::array& hidden, const mx::array& router_logits,
                    const mx::array& w_gate, const mx::array& w_up, const mx::array& w_down,
                    int top_k, bool renormalize, const std::string& scoring,
                    const MoeOptions& options = {}, mx::StreamOrDevice s = {});

// Shared by fused_moe and fused_moe_gguf: checks scoring / options (errors name `op`)
// and returns the bias inputs (none, or b_gate, b_up, b_down as float32 contiguous).
void check_moe_scoring(const char* op, const std::string& scoring);
std::vector<mx::array> moe_bias_inputs(const char* op, const MoeOptions& o, int e, int i, int h,
                                       mx::StreamOrDevice s);

struct MoeProblem {
  mx::Dtype dtype = mx::float32;    // hidden / out
  mx::Dtype w_dtype = mx::float32;  // expert weights
  int64_t num_tokens = 0;
  int64_t hidden = 0;
  int64_t num_experts = 0;
  int64_t inter = 0;
  int64_t top_k = 1;
  bool renormalize = false;
  bool sigmoid = false;
  bool topk_softmax = false;  // gpt-oss's variations (MoeOptions)
  bool oai_act = false;
  bool bias = false;
};

// Array slots: inputs 0 hidden, 1 logits (float32), 2 w_gate, 3 w_up, 4 w_down;
// outputs 5 out, 6 ids int32 [T, k], 7 weights float32 [T, k], 8 act float32
// [T * k, I], 9 y float32 [T * k, H] (8 and 9 are the Metal path's scratch).
// With biases, inputs 5 b_gate, 6 b_up, 7 b_down and the outputs from 8 on.
KernelPlan plan_fused_moe(const MoeProblem& p);

class FusedMoe : public KernelPrimitive {
 public:
  FusedMoe(mx::Stream stream, KernelBackend backend, int top_k, bool renormalize, bool sigmoid,
           bool topk_softmax = false, bool oai_act = false)
      : KernelPrimitive(stream, backend),
        top_k_(top_k),
        renormalize_(renormalize),
        sigmoid_(sigmoid),
        topk_softmax_(topk_softmax),
        oai_act_(oai_act) {}

  KernelPlan plan(const std::vector<mx::array>& inputs,
                  const std::vector<mx::array>& outputs) const override;
  const char* name() const override { return "FusedMoe"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 protected:
  void eval_native_cpu(const std::vector<mx::array>& inputs,
                       std::vector<mx::array>& outputs) override;

 private:
  MoeProblem problem(const std::vector<mx::array>& inputs) const;
  int top_k_;
  bool renormalize_;
  bool sigmoid_;
  bool topk_softmax_;
  bool oai_act_;
};

}  // namespace vllm_metal
