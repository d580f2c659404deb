// Decoding GGUF weight blocks to float32 on the CPU (no MLX).
//
// Every decoder reproduces the arithmetic of the reference dequantizer (the
// `gguf` package's NumPy code) operation for operation, in float32 and without
// fused multiply-adds, so dequantized values are bit-exact.
#pragma once

#include <cstdint>

#include "cpu/vec.h"
#include "runtime/gguf_types.h"

namespace vllm_metal::cpu {

// Decodes one block of a quantized type (block_size weights) to float32.
using GgufBlockDecoder = void (*)(const uint8_t* block, float* out);

// The decoder of a supported quantized type; null for the float types (block
// size 1) and unsupported types.
GgufBlockDecoder gguf_block_decoder(gguf::GGMLType type);

// Decodes `n` consecutive weights (a multiple of the block size) starting at
// `src` to float32: works for every supported type, float ones included.
void gguf_decode_row(gguf::GGMLType type, const uint8_t* src, int64_t n, float* out);

struct GgufDequantizeRows {
  gguf::GGMLType type = gguf::GGMLType::kF32;
  const void* blocks = nullptr;  // rows * row_bytes(type, cols) bytes
  int64_t rows = 0;
  int64_t cols = 0;              // multiple of the block size
  Elt out_elt = Elt::kF32;
  void* out = nullptr;           // [rows, cols]
};

// Threaded across rows.
void gguf_dequantize_rows(const GgufDequantizeRows& a);

}  // namespace vllm_metal::cpu
