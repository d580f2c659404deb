// Ops on GGUF weights kept in block form (see runtime/gguf_types.h).
//
//   gguf_dequantize(blocks, type, shape, out_dtype) -> dense [shape] weights
//   gguf_matmul(x, blocks, type, shape)             -> x @ W^T, W = [N, K] = shape
//
// `blocks` is a uint8 array holding the tensor's bytes exactly as stored in the
// file (rows of K weights, row-major). F32, F16 and BF16 weights take the same
// path (block size 1), so dense checkpoints use our CPU GEMM too.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/utils.h"
#include "cpu/gguf_matmul.h"
#include "ops/kernel_primitive.h"
#include "runtime/gguf_types.h"

namespace vllm_metal {

mx::array gguf_dequantize(const mx::array& blocks, gguf::GGMLType type, const mx::Shape& shape,
                          mx::Dtype out_dtype = mx::float32, mx::StreamOrDevice s = {});

// x: [..., K] float32/float16/bfloat16; returns [..., N] in x's dtype.
// exact = false: the CPU rounds x to 8-bit blocks for the integer-capable types
// (llama.cpp's scheme, fastest); true: float32 sums of x as given (cpu/gguf_matmul.h).
// Metal kernels always sum in float.
// Epilogue: bias [N] (x's dtype) added to the float32 sums, then `activation` (GELU, erf or
// tanh form: ops/gelu.h), before the one rounding to x's dtype: act(x @ W^T + bias).
mx::array gguf_matmul(const mx::array& x, const mx::array& blocks, gguf::GGMLType type,
                      const mx::Shape& shape, bool exact = false,
                      const std::optional<mx::array>& bias = std::nullopt,
                      cpu::GgufActivation activation = cpu::GgufActivation::kNone,
                      mx::StreamOrDevice s = {});

// "none" | "gelu" | "gelu_tanh"; anything else throws std::invalid_argument.
cpu::GgufActivation parse_gguf_activation(const std::string& name);

// Throws std::invalid_argument "[op] type Q2_XXS is not supported ..." for
// types our kernels do not decode.
void check_gguf_type(const char* op, gguf::GGMLType type);

// ---- planners -------------------------------------------------------------------

struct GgufDequantizeProblem {
  gguf::GGMLType type = gguf::GGMLType::kF32;
  mx::Dtype dtype = mx::float32;  // of the output
  int64_t rows = 0;
  int64_t cols = 0;
};

constexpr int64_t kGgufMetalMatvecMaxRows = 8;  // gguf_matvec_core.h kGgufMvMaxX

// How the mat-vec kernel spreads a weight row over a simdgroup (gguf_matvec_core.h):
// lanes_per_row lanes share a row, each taking every lanes_per_row-th piece of `piece`
// weights (lanes_per_row divides the piece count, so no lane idles); each lane decodes
// rows_per_lane rows (each x value loaded once for all of them).
struct GgufMatvecShape {
  uint32_t lanes_per_row = 32;
  uint32_t rows_per_lane = 4;
  uint32_t piece = 16;
  uint32_t rows_per_simdgroup() const { return 32 / lanes_per_row * rows_per_lane; }
};
GgufMatvecShape gguf_matvec_shape(int64_t k);

struct GgufMatmulProblem {
  gguf::GGMLType type = gguf::GGMLType::kF32;
  mx::Dtype dtype = mx::float32;  // of x and y
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
  bool bias = false;  // the epilogue (gguf_matmul): a bias array at slot 2, y moves to slot 3
  cpu::GgufActivation activation = cpu::GgufActivation::kNone;
};

// "gguf_dequantize_q4_k_float16"
std::string gguf_dequantize_kernel_name(gguf::GGMLType type, mx::Dtype dtype);
// "gguf_matvec_q4_k_float32" (m <= kGgufMetalMatvecMaxRows, or any m in batch-invariant
// mode) or "gguf_matmul_..."
std::string gguf_matmul_kernel_name(gguf::GGMLType type, mx::Dtype dtype, bool matvec);

// Slots: 0 blocks, 1 out. One thread per 16-weight chunk.
KernelPlan plan_gguf_dequantize(const GgufDequantizeProblem& p);
// Slots: 0 x, 1 blocks, 2 y; with p.bias: 0 x, 1 blocks, 2 bias, 3 y.
KernelPlan plan_gguf_matmul(const GgufMatmulProblem& p);

class GgufDequantize : public KernelPrimitive {
 public:
  GgufDequantize(mx::Stream stream, KernelBackend backend, gguf::GGMLType type, int64_t rows,
                 int64_t cols)
      : KernelPrimitive(stream, backend), type_(type), rows_(rows), cols_(cols) {}

  KernelPlan plan(const std::vector<mx::array>& inputs,
                  const std::vector<mx::array>& outputs) const override;
  const char* name() const override { return "GgufDequantize"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 protected:
  void eval_native_cpu(const std::vector<mx::array>& inputs,
                       std::vector<mx::array>& outputs) override;

 private:
  gguf::GGMLType type_;
  int64_t rows_;
  int64_t cols_;
};

class GgufMatmul : public KernelPrimitive {
 public:
  GgufMatmul(mx::Stream stream, KernelBackend backend, gguf::GGMLType type, int64_t n, int64_t k,
             bool exact, bool bias = false,
             cpu::GgufActivation activation = cpu::GgufActivation::kNone)
      : KernelPrimitive(stream, backend), type_(type), n_(n), k_(k), exact_(exact), bias_(bias),
        activation_(activation) {}

  KernelPlan plan(const std::vector<mx::array>& inputs,
                  const std::vector<mx::array>& outputs) const override;
  const char* name() const override { return "GgufMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 protected:
  void eval_native_cpu(const std::vector<mx::array>& inputs,
                       std::vector<mx::array>& outputs) override;

 private:
  GgufMatmulProblem problem(const std::vector<mx::array>& inputs) const;
  gguf::GGMLType type_;
  int64_t n_;
  int64_t k_;
  bool exact_;
  bool bias_;
  cpu::GgufActivation activation_;
};

}  // namespace vllm_metal
