// causal_conv1d: the depthwise causal convolution (+ SiLU) in front of the
// gated delta net of Qwen3-Next / Qwen3.5 (mlx-lm's conv1d with groups =
// channels over [conv_state, x]), on packed variable-length rows.
//
//   x           [T, channels] float32/float16/bfloat16 (one dtype for all)
//   weight      [channels, width], width (kernel size K) in [2, 8]
//   bias        optional [channels]
//   conv_state  [num_slots, channels, width - 1]: per slot the last K - 1
//               inputs of the sequence, oldest first (vLLM's layout)
//   cu_seqlens, slots, has_initial_state: see ops/varlen.h
//
// For sequence n with rows [s, e) and in = concat(state[slots[n]] (or zeros),
// x[s:e]) along time:
//   out[s + t, c] = silu(bias[c] + sum_j weight[c, j] * in[t + j, c])
// and the new state[slots[n]] = the last K - 1 entries of in, so a chunk
// shorter than K - 1 keeps part of the old state and chunked prefill equals
// one long prefill. float32 arithmetic, one rounding per output. Returns
// {out [T, channels], the new conv_state}; the old state is copied first
// unless `inplace` (then its buffer is written and the caller must rebind it:
// MLX never donates an input of a two-output primitive).
#pragma once

#include <optional>
#include <vector>

#include "mlx/array.h"
#include "mlx/utils.h"
#include "ops/kernel_primitive.h"

namespace vllm_metal {

std::vector<mx::array> causal_conv1d(const mx::array& x, const mx::array& weight,
                                     const std::optional<mx::array>& bias,
                                     const mx::array& conv_state, const mx::array& cu_seqlens,
                                     const mx::array& slots,
                                     const std::optional<mx::array>& has_initial_state,
                                     bool silu = true, bool inplace = false,
                                     mx::StreamOrDevice s = {});

struct CausalConv1dProblem {
  mx::Dtype dtype = mx::float32;
  int64_t num_seqs = 0;
  int64_t num_slots = 0;
  int64_t channels = 0;
  int64_t width = 0;
  bool has_bias = false;
  bool silu = true;
  bool copy_state = false;
};

std::string causal_conv1d_kernel_name(mx::Dtype dtype);

// Slots: 0 x, 1 bias (x when absent), 2 weight, 3 cu_seqlens, 4 slots,
// 5 has_initial_state, 6 conv_state, 7 out, 8 new conv_state.
KernelPlan plan_causal_conv1d(const CausalConv1dProblem& p);

class CausalConv1d : public KernelPrimitive {
 public:
  CausalConv1d(mx::Stream stream, KernelBackend backend, bool has_bias, bool silu, bool inplace)
      : KernelPrimitive(stream, backend), has_bias_(has_bias), silu_(silu), inplace_(inplace) {}

  KernelPlan plan(const std::vector<mx::array>& inputs,
                  const std::vector<mx::array>& outputs) const override;
  const char* name() const override { return "CausalConv1d"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 protected:
  void allocate_outputs(const std::vector<mx::array>& inputs,
                        std::vector<mx::array>& outputs) override;
  void eval_native_cpu(const std::vector<mx::array>& inputs,
                       std::vector<mx::array>& outputs) override;

 private:
  CausalConv1dProblem problem(const std::vector<mx::array>& inputs,
                              const std::vector<mx::array>& outputs) const;
  bool has_bias_;
  bool silu_;
  bool inplace_;
};

}  // namespace vllm_metal
