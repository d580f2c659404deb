// y = x @ W^T with W in GGUF block form, on the CPU (no MLX).
//
// Activations of the integer-capable types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
// Q5_K, Q6_K) are rounded to 8-bit blocks of 32, llama.cpp's scheme (results
// differ from float32 by that rounding, see docs/gguf.md) — for every row
// count. The kernels that serve a call change with its row count and sum in
// different orders, so a row's last bits depend on the batch it is in, unless
// batch-invariant mode (cpu/batch_invariant.h) fixes one path per type. Decode rows
// (m <= kGgufMatvecMaxRows) then dot every weight block with them in integers,
// straight from its packed bytes; more rows (x86) decode panels of 8 weight rows
// once into bytes laid out for the integer dot instructions and multiply them
// with every row. F32 / F16 / BF16 weights are dotted with float x directly; the
// other types are decoded to float32 in cache first. Larger m without panels: a
// panel of weight rows is decoded to float32 once and multiplied with all
// (rounded) x rows by a register-blocked kernel (float32 sums).
// Threaded over weight rows; kernels for AVX-512 VNNI, AVX2, NEON (with and
// without dotprod) and scalar, picked at run time (gguf_kernels.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cpu/vec.h"
#include "runtime/gguf_types.h"

namespace vllm_metal::cpu {

constexpr int64_t kGgufMatvecMaxRows = 8;  // rows per pass of the mat-vec kernels
// Up to this many rows, the integer path runs mat-vec passes over cached weight rows
// (cheaper than decoding the weights to float for the tiles; benchmarks/gguf_bench.py).
constexpr int64_t kGgufInt8MaxRows = 256;

// What the matmul does to each output before storing it (its epilogue): y = act(x W^T + b).
// Saves a pass over y per step (a separate bias add and GELU each read and write all of
// it; MLX's CPU elementwise ops run on one thread).
enum class GgufActivation : int { kNone = 0, kGelu = 1, kGeluTanh = 2 };

struct GgufMatmul {
  gguf::GGMLType type = gguf::GGMLType::kF32;
  const void* w = nullptr;  // [n, row_bytes(type, k)]
  int64_t n = 0;            // output features (weight rows)
  int64_t k = 0;            // input features, a multiple of the block size
  Elt elt = Elt::kF32;      // of x and y
  const void* x = nullptr;  // [m, k]
  int64_t m = 0;
  void* y = nullptr;        // [m, n]
  // true: float32 sums of the exact x on every path (no 8-bit activations);
  // for parity tests against dense references, at the float path's speed.
  bool exact = false;
  const void* bias = nullptr;  // [n] in elt, or null: added to every row in float32
  GgufActivation activation = GgufActivation::kNone;  // after the bias (cpu/gelu.h formulas)
};

void gguf_matmul(const GgufMatmul& a);

// Several weights times the same x (a layer's q/k/v, or gate/up): the matrices must share
// x, m, k and elt. Decode rows run as one pool job over every matrix's rows, x rounded
// once; larger m runs the calls one after the other. Results equal gguf_matmul's.
void gguf_matmul_group(const GgufMatmul* mats, int count);

// Independent calls, each with its own x and m (a MoE layer's experts): the calls of
// decode rows run as one pool job over all their weight rows, larger ones one after the
// other. Results equal gguf_matmul's, call by call.
void gguf_matmul_batch(const GgufMatmul* mats, int count);

// True when gguf_matmul rounds this type's activations to 8 bits (unless `exact`).
bool gguf_matmul_int8_activations(gguf::GGMLType type);

// The kernel variants this CPU runs, best first: "avx512", "avx2", "scalar" on
// x86-64; "neon_dot", "neon", "scalar" on arm64. gguf_matmul uses the first;
// tests and benchmarks select others (process-wide, not thread-safe against
// running matmuls); "" selects the best again. Unknown or unsupported names
// throw std::invalid_argument.
std::vector<std::string> gguf_matmul_isas();
void gguf_matmul_set_isa(const std::string& name);
std::string gguf_matmul_isa();

}  // namespace vllm_metal::cpu
