// GGML tensor types as stored in GGUF files: ids, block geometry, names.
//
// Plain C++17, no MLX: shared by the reader (runtime), the CPU kernels and the
// ops. A "block" holds `block_size` weights in `type_size` bytes; the float
// types are blocks of one element.
#pragma once

#include <cstdint>
#include <string>

namespace vllm_metal::gguf {

// Values are the on-disk ids (ggml_type).
enum class GGMLType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ8_1 = 9,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,
  kIQ2_XXS = 16,
  kIQ2_XS = 17,
  kIQ3_XXS = 18,
  kIQ1_S = 19,
  kIQ4_NL = 20,
  kIQ3_S = 21,
  kIQ2_S = 22,
  kIQ4_XS = 23,
  kI8 = 24,
  kI16 = 25,
  kI32 = 26,
  kI64 = 27,
  kF64 = 28,
  kIQ1_M = 29,
  kBF16 = 30,
  kTQ1_0 = 34,
  kTQ2_0 = 35,
  kMXFP4 = 39,
  kNVFP4 = 40,
  kQ1_0 = 41,
};

struct TypeInfo {
  const char* name = nullptr;  // "Q4_K"; null: id unknown
  uint32_t block_size = 0;     // weights per block
  uint32_t type_size = 0;      // bytes per block
  bool supported = false;      // our dequantize / matmul handle it
};

constexpr uint32_t kQK_K = 256;  // weights per K-quant / IQ super-block

// Geometry and name of a type id; `name == nullptr` for ids no GGML version defines.
TypeInfo type_info(uint32_t type_id);
inline TypeInfo type_info(GGMLType t) { return type_info(static_cast<uint32_t>(t)); }

// "Q4_K", or "type 99" for unknown ids.
std::string type_name(uint32_t type_id);
// Lower-case name for kernel host names: "q4_k".
std::string type_kernel_name(GGMLType t);
// Parses "Q4_K" / "q4_k" / "f32" ...; returns false when unknown.
bool parse_type_name(const std::string& name, GGMLType* out);

// "F32, F16, BF16, Q4_0, ..." — the supported types, for error messages.
std::string supported_type_names();

// Bytes of a row of `n` weights; -1 when n is not a multiple of the block size
// or the type is unknown.
int64_t row_bytes(GGMLType t, int64_t n);

}  // namespace vllm_metal::gguf
