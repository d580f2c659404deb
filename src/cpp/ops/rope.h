// rope: rotary position embedding of packed rows, one position per token.
//
//   x          [T, num_heads, head_size], float32/float16/bfloat16, any strides
//              (views are read in place, e.g. q or k sliced out of a fused qkv
//              projection; no copy)
//   positions  int32 or int64 [T]: rows of many requests in one call
//   returns    [T, num_heads, head_size] in x's dtype
//
// For pair i < rotary_dim / 2 with angle a = positions[t] * inv_freq_i:
//   (x1, x2) -> (x1 cos a - x2 sin a, x2 cos a + x1 sin a) * mscale
// pairing (i, i + rotary_dim/2) when is_neox (NeoX / Llama), else (2i, 2i + 1)
// (GPT-J). Dimensions past rotary_dim are copied (partial rotary). inv_freq and
// mscale come from base and the scaling (ops/rope_scaling.h), computed on the
// host in double and cached. cos/sin are float32, accurate to a few 1e-7 at
// any position (angles are reduced exactly; see cpu/rope.h); the rotation is
// float32, rounded once to x's dtype.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/utils.h"
#include "ops/kernel_primitive.h"
#include "ops/rope_scaling.h"

namespace vllm_metal {

struct RopeOptions {
  std::optional<int64_t> rotary_dim;  // default: head_size
  bool is_neox = true;
  double base = 10000.0;
  RopeScaling scaling;
};

mx::array rope(const mx::array& x, const mx::array& positions, const RopeOptions& options,
               mx::StreamOrDevice s = {});

// The kernels' turn table for a frequency set, as an evaluated uint32 array
// [2, rotary_dim / 2] (cpu::rope_turn_table), with its mscale. Cached.
struct RopeTable {
  mx::array table;
  float mscale;
};
RopeTable rope_table(int64_t rotary_dim, double base, const RopeScaling& scaling);

// Plain-data view of one rope problem (planner and CPU kernel input).
struct RopeProblem {
  mx::Dtype dtype = mx::float32;
  mx::Dtype positions_dtype = mx::int64;
  int64_t tokens = 0;
  int64_t heads = 0;
  int64_t head_size = 0;
  int64_t rotary_dim = 0;
  int64_t x_token_stride = 0;  // elements
  int64_t x_head_stride = 0;   // elements
  int64_t x_dim_stride = 1;    // elements
  bool neox = true;
  float mscale = 1.0f;
};

// "rope_{neox|gptj}_{float32|float16|bfloat16}_{int32|int64}"
std::string rope_kernel_name(mx::Dtype dtype, mx::Dtype positions_dtype, bool neox);

// Launches for `p`: one threadgroup per token. Slots: 0 x, 1 positions,
// 2 table, 3 out.
KernelPlan plan_rope(const RopeProblem& p);

class Rope : public KernelPrimitive {
 public:
  Rope(mx::Stream stream, KernelBackend backend, int64_t rotary_dim, bool neox, float mscale)
      : KernelPrimitive(stream, backend), rotary_dim_(rotary_dim), neox_(neox), mscale_(mscale) {}

  KernelPlan plan(const std::vector<mx::array>& inputs,
                  const std::vector<mx::array>& outputs) const override;
  const char* name() const override { return "Rope"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 protected:
  // Rotates in place when x is row-contiguous and nothing else holds it.
  void allocate_outputs(const std::vector<mx::array>& inputs,
                        std::vector<mx::array>& outputs) override;
  void eval_native_cpu(const std::vector<mx::array>& inputs,
                       std::vector<mx::array>& outputs) override;

 private:
  RopeProblem problem(const std::vector<mx::array>& inputs) const;
  int64_t rotary_dim_;
  bool neox_;
  float mscale_;
};

}  // namespace vllm_metal
