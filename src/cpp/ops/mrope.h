// mrope: multimodal rotary position embedding of Qwen2/2.5-VL (sectioned),
// Qwen3-VL and Qwen3.5 (interleaved), for all rows of a packed batch at once.
//
//   x          [T, num_heads, head_size] float32/float16/bfloat16
//   positions  int32/int64 [3, T]: temporal, height and width positions (all
//              three equal for text tokens, where mrope is plain rope)
//   sections   (s0, s1, s2) rotary pairs per stream, s0 + s1 + s2 = rotary_dim / 2
//   returns    [T, num_heads, head_size] in x's dtype
//
// NeoX pairs (i, i + rotary_dim/2) rotated by positions[axis(i), t] * inv_freq_i
// (inv_freq_i = base^(-2i / rotary_dim)); dimensions past rotary_dim (partial
// rotary, e.g. Qwen3.5's 0.25) are copied. axis(i):
//   sectioned   (HF Qwen2-VL: cos.split(sections * 2) chunk j takes stream j % 3):
//               0 for i < s0, 1 for i < s0 + s1, else 2
//   interleaved (HF Qwen3-VL apply_interleaved_mrope):
//               1 if i % 3 == 1 and i < 3 s1, 2 if i % 3 == 2 and i < 3 s2, else 0
// cos/sin are exact modulo one turn as in rope (ops/rope.h).
#pragma once

#include <array>
#include <optional>
#include <string>

#include "mlx/array.h"
#include "mlx/utils.h"
#include "ops/kernel_primitive.h"

namespace vllm_metal {

struct MropeOptions {
  std::array<int64_t, 3> sections{0, 0, 0};
  bool interleaved = false;
  std::optional<int64_t> rotary_dim;  // default head_size
  double base = 10000.0;
};

mx::array mrope(const mx::array& x, const mx::array& positions, const MropeOptions& options,
                mx::StreamOrDevice s = {});

struct MropeProblem {
  mx::Dtype dtype = mx::float32;
  mx::Dtype positions_dtype = mx::int64;
  int64_t tokens = 0;
  int64_t heads = 0;
  int64_t head_size = 0;
  int64_t rotary_dim = 0;
  std::array<int64_t, 3> sections{0, 0, 0};
  bool interleaved = false;
};

// "mrope_{float32|float16|bfloat16}_{int32|int64}"
std::string mrope_kernel_name(mx::Dtype dtype, mx::Dtype positions_dtype);

// One threadgroup per token. Slots: 0 x, 1 positions, 2 table, 3 out.
KernelPlan plan_mrope(const MropeProblem& p);

class Mrope : public KernelPrimitive {
 public:
  Mrope(mx::Stream stream, KernelBackend backend, int64_t rotary_dim,
        std::array<int64_t, 3> sections, bool interleaved)
      : KernelPrimitive(stream, backend),
        rotary_dim_(rotary_dim),
        sections_(sections),
        interleaved_(interleaved) {}

  KernelPlan plan(const std::vector<mx::array>& inputs,
                  const std::vector<mx::array>& outputs) const override;
  const char* name() const override { return "Mrope"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 protected:
  void allocate_outputs(const std::vector<mx::array>& inputs,
                        std::vector<mx::array>& outputs) override;
  void eval_native_cpu(const std::vector<mx::array>& inputs,
                       std::vector<mx::array>& outputs) override;

 private:
  MropeProblem problem(const std::vector<mx::array>& inputs) const;
  int64_t rotary_dim_;
  std::array<int64_t, 3> sections_;
  bool interleaved_;
};

}  // namespace vllm_metal
