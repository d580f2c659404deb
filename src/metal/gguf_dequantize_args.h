// Arguments of the gguf_dequantize kernels, shared by the host (C++) and the shader.
#pragma once

#ifdef __METAL_VERSION__
#include <metal_stdlib>
#else
#include <cstdint>
#endif

struct GgufDequantizeArgs {
  uint64_t rows;       // weight rows
  uint64_t row_bytes;  // bytes of one encoded row
  uint32_t cols;       // weights per row
  uint32_t chunks;     // 16-weight chunks per row: ceil(cols / 16)
};

#ifndef __METAL_VERSION__
static_assert(sizeof(GgufDequantizeArgs) == 24, "GgufDequantizeArgs layout must match the shader");
static_assert(offsetof(GgufDequantizeArgs, cols) == 16, "GgufDequantizeArgs layout must match the shader");
#endif
