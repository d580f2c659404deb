// fused_moe_gguf: fused_moe (ops/moe.h) with the expert weights in GGUF block form,
// as llama.cpp stores them (ffn_gate_exps / ffn_up_exps [E, I, H], ffn_down_exps
// [E, H, I]): uint8 arrays of the tensors' bytes, each expert's rows contiguous. Any
// type gguf_matmul takes, per tensor. The CPU runs each active expert's rows through
// gguf_matmul's kernels (so `exact` has gguf_matmul's meaning); the Metal kernels decode
// with the GGUF mat-vec core and always sum in float32.
#pragma once

#include <string>

#include "mlx/array.h"
#include "mlx/utils.h"
#include "ops/kernel_primitive.h"
#include "ops/moe.h"
#include "runtime/gguf_types.h"

namespace vllm_metal {

struct MoeGgufWeights {
  mx::array gate, up, down;
  gguf::GGMLType gate_type, up_type, down_type;
  int inter;  // I
};

mx::array fused_moe_gguf(const mx::array& hidden, const mx::array& router_logits,
                         const MoeGgufWeights& w, int top_k, bool renormalize,
                         const std::string& scoring, bool exact = false,
                         const MoeOptions& options = {}, mx::StreamOrDevice s = {});

struct MoeGgufProblem {
  mx::Dtype dtype = mx::float32;
  gguf::GGMLType gate_type = gguf::GGMLType::kF32, up_type = gguf::GGMLType::kF32,
                 down_type = gguf::GGMLType::kF32;
  int64_t num_tokens = 0, hidden = 0, num_experts = 0, inter = 0, top_k = 1;
  bool renormalize = false, sigmoid = false;
  bool topk_softmax = false, oai_act = false, bias = false;  // MoeOptions (ops/moe.h)
};

// Array slots as plan_fused_moe's (ops/moe.h), inputs 2-4 holding blocks.
KernelPlan plan_fused_moe_gguf(const MoeGgufProblem& p);

class FusedMoeGguf : public KernelPrimitive {
 public:
  FusedMoeGguf(mx::Stream stream, KernelBackend backend, MoeGgufProblem shape, bool exact)
      : KernelPrimitive(stream, backend), shape_(shape), exact_(exact) {}

  KernelPlan plan(const std::vector<mx::array>& inputs,
                  const std::vector<mx::array>& outputs) const override;
  const char* name() const override { return "FusedMoeGguf"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 protected:
  void eval_native_cpu(const std::vector<mx::array>& inputs,
                       std::vector<mx::array>& outputs) override;

 private:
  MoeGgufProblem problem(const std::vector<mx::array>& inputs) const;
  MoeGgufProblem shape_;  // types, experts, inter, top_k and routing (the rest from inputs)
  bool exact_;
};

}  // namespace vllm_metal
