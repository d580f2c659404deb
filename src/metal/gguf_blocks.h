// GGUF block decoders for the Metal kernels (MSL only).
//
// Each format is a struct with kBlock (weights per block), kBytes (bytes per
// block) and decode<N>(row, chunk, j0, k, v): weights 16 chunk + j0 + [0, N)
// of one encoded row (N = 16, j0 = 0; or N = 8, j0 = 0 or 8), as float, into v
// (GgufDecoders: decode16, decode8). The float formats zero-fill past k, so
// rows of any length work; quantized rows are whole blocks. The arithmetic
// mirrors the reference dequantizer: one rounding per product, no fused
// multiply-add written out (statements kept apart).
#pragma once

#include <metal_stdlib>
#include "gguf_tables.h"

using namespace metal;

inline float gguf_half(device const uchar* p) {
  return float(as_type<half>(ushort(ushort(p[0]) | (ushort(p[1]) << 8))));
}
inline uint gguf_u32(device const uchar* p) {
  return uint(p[0]) | (uint(p[1]) << 8) | (uint(p[2]) << 16) | (uint(p[3]) << 24);
}

// Start of the block holding chunk `chunk`, and the chunk's index inside it.
template <typename Q>
inline device const uchar* gguf_block_of(device const uchar* row, uint chunk, thread uint& il) {
  uint first = chunk * 16;
  il = (first % Q::kBlock) / 16;
  return row + (first / Q::kBlock) * Q::kBytes;
}

// decode16(row, chunk, k, v): weights [16 chunk, 16 chunk + 16) into v; decode8(row,
// piece, k, v): weights [8 piece, 8 piece + 8). Both from the format's decode<N>(row,
// chunk, j0, k, v): weights 16 chunk + j0 + [0, N) of one 16-weight chunk.
template <typename Q>
struct GgufDecoders {
  static void decode16(device const uchar* row, uint chunk, uint k, thread float* v) {
    Q::template decode<16>(row, chunk, 0, k, v);
  }
  static void decode8(device const uchar* row, uint piece, uint k, thread float* v) {
    Q::template decode<8>(row, piece >> 1, 8 * (piece & 1), k, v);
  }
};

// ---- float formats ------------------------------------------------------------

struct GgufF32 : GgufDecoders<GgufF32> {
  enum { kBlock = 1, kBytes = 4 };
  template <uint N>
  static void decode(device const uchar* row, uint chunk, uint j0, uint k, thread float* v) {
    device const float* p = (device const float*)row;
    for (uint e = 0; e < N; ++e) {
      uint i = chunk * 16 + j0 + e;
      v[e] = i < k ? p[i] : 0.0f;
    }
  }
};

struct GgufF16 : GgufDecoders<GgufF16> {
  enum { kBlock = 1, kBytes = 2 };
  template <uint N>
  static void decode(device const uchar* row, uint chunk, uint j0, uint k, thread float* v) {
    device const half* p = (device const half*)row;
    for (uint e = 0; e < N; ++e) {
      uint i = chunk * 16 + j0 + e;
      v[e] = i < k ? float(p[i]) : 0.0f;
    }
  }
};

struct GgufBF16 : GgufDecoders<GgufBF16> {
  enum { kBlock = 1, kBytes = 2 };
  template <uint N>
  static void decode(device const uchar* row, uint chunk, uint j0, uint k, thread float* v) {
    device const ushort* p = (device const ushort*)row;
    for (uint e = 0; e < N; ++e) {
      uint i = chunk * 16 + j0 + e;
      v[e] = i < k ? as_type<float>(uint(p[i]) << 16) : 0.0f;
    }
  }
};

// ---- legacy 32-weight blocks: weight j < 16 is the low nibble of qs[j] -------

struct GgufQ4_0 : GgufDecoders<GgufQ4_0> {
  enum { kBlock = 32, kBytes = 18 };
  template <uint N>
  static void decode(device const uchar* row, uint chunk, uint j0, uint k, thread float* v) {
    uint il;
    device const uchar* b = gguf_block_of<GgufQ4_0>(row, chunk, il);
    float d = gguf_half(b);
    for (uint e = 0; e < N; ++e) {
      uint j = j0 + e;
      int q = il == 0 ? (b[2 + j] & 0xF) : (b[2 + j] >> 4);
      v[e] = d * float(q - 8);
    }
  }
};

struct GgufQ4_1 : GgufDecoders<GgufQ4_1> {
  enum { kBlock = 32, kBytes = 20 };
  template <uint N>
  static void decode(device const uchar* row, uint chunk, uint j0, uint k, thread float* v) {
    uint il;
    device const uchar* b = gguf_block_of<GgufQ4_1>(row, chunk, il);
    float d = gguf_half(b);
    float m = gguf_half(b + 2);
    for (uint e = 0; e < N; ++e) {
      uint j = j0 + e;
      int q = il == 0 ? (b[4 + j] & 0xF) : (b[4 + j] >> 4);
      float t = d * float(q);
      v[e] = t + m;
    }
  }
};

struct GgufQ5_0 : GgufDecoders<GgufQ5_0> {
  enum { kBlock = 32, kBytes = 22 };
  template <uint N>
  static void decode(device const uchar* row, uint chunk, uint j0, uint k, thread float* v) {
    uint il;
    device const uchar* b = gguf_block_of<GgufQ5_0>(row, chunk, il);
    float d = gguf_half(b);
    uint qh = gguf_u32(b + 2) >> (16 * il);
    for (uint e = 0; e < N; ++e) {
      uint j = j0 + e;
      int lo = il == 0 ? (b[6 + j] & 0xF) : (b[6 + j] >> 4);
      int q = lo | int(((qh >> j) & 1) << 4);
      v[e] = d * float(q - 16);
    }
  }
};

struct GgufQ5_1 : GgufDecoders<GgufQ5_1> {
  enum { kBlock = 32, kBytes = 24 };
  template <uint N>
  static void decode(device const uchar* row, uint chunk, uint j0, uint k, thread float* v) {
    uint il;
    device const uchar* b = gguf_block_of<GgufQ5_1>(row, chunk, il);
    float d = gguf_half(b);
    float m = gguf_half(b + 2);
    uint qh = gguf_u32(b + 4) >> (16 * il);
    for (uint e = 0; e < N; ++e) {
      uint j = j0 + e;
      int lo = il == 0 ? (b[8 + j] & 0xF) : (b[8 + j] >> 4);
      int q = lo | int(((qh >> j) & 1) << 4);
      float t = d * float(q);
      v[e] = t + m;
    }
  }
};

struct GgufQ8_0 : GgufDecoders<GgufQ8_0> {
  enum { kBlock = 32, kBytes = 34 };
  template <uint N>
  static void decode(device const uchar* row, uint chunk, uint j0, uint k, thread float* v) {
    uint il;
    device const uchar* b = gguf_block_of<GgufQ8_0>(row, chunk, il);
    float d = gguf_half(b);
    device const char* qs = (device const char*)(b + 2 + 16 * il);
    for (uint e = 0; e < N; ++e) {
      uint j = j0 + e;
      v[e] = float(qs[j]) * d;
    }
  }
};

struct GgufIQ4_NL : GgufDecoders<GgufIQ4_NL> {
  enum { kBlock = 32, kBytes = 18 };
  template <uint N>
  static void decode(device const uchar* row, uint chunk, uint j0, uint k, thread float* v) {
    uint il;
    device const uchar* b = gguf_block_of<GgufIQ4_NL>(row, chunk, il);
    float d = gguf_half(b);
    for (uint e = 0; e < N; ++e) {
      uint j = j0 + e;
      uint q = il == 0 ? (b[2 + j] & 0xF) : (b[2 + j] >> 4);
      v[e] = d * float(kGgufIq4nlValues[q]);
    }
  }
};

// MXFP4: E8M0 exponent byte, 16 bytes of E2M1 nibbles (chunk 0 low, chunk 1 high)
struct GgufMXFP4 : GgufDecoders<GgufMXFP4> {
  enum { kBlock = 32, kBytes = 17 };
  template <uint N>
  static void decode(device const uchar* row, uint chunk, uint j0, uint k, thread float* v) {
    uint il;
    device const uchar* b = gguf_block_of<GgufMXFP4>(row, chunk, il);
    // 2^(e - 128) built from its bits: 2^-128 and 2^-127 are float32 subnormals
    const uint e = b[0];
    const float d = as_type<float>(e < 2u ? (0x00200000u << e) : ((e - 1u) << 23));
    for (uint i = 0; i < N; ++i) {
      uint j = j0 + i;
      uint q = il == 0 ? (b[1 + j] & 0xF) : (b[1 + j] >> 4);
      v[i] = d * float(kGgufMxfp4Values[q]);
    }
  }
};

// ---- K quants: 256-weight super-blocks; chunk il covers weights 16 il + j ----

struct GgufQ2_K : GgufDecoders<GgufQ2_K> {
  enum { kBlock = 256, kBytes = 84 };
  template <uint N>
  static void decode(device const uchar* row, uint chunk, uint j0, uint k, thread float* v) {
    uint il;
    device const uchar* b = gguf_block_of<GgufQ2_K>(row, chunk, il);
    float d = gguf_half(b + 80);
    float dmin = gguf_half(b + 82);
    uint sc = b[il];
    float dl = d * float(sc & 0xF);
    float ml = dmin * float(sc >> 4);
    for (uint e = 0; e < N; ++e) {
      uint j = j0 + e;
      uint i = 16 * il + j;
      uint q = (b[16 + 32 * (i >> 7) + (i & 31)] >> (2 * ((i >> 5) & 3))) & 3;
      float t = dl * float(q);
      v[e] = t - ml;
    }
  }
};

struct GgufQ3_K : GgufDecoders<GgufQ3_K> {
  enum { kBlock = 256, kBytes = 110 };
  template <uint N>
  static void decode(device const uchar* row, uint chunk, uint j0, uint k, thread float* v) {
    uint il;
    device const uchar* b = gguf_block_of<GgufQ3_K>(row, chunk, il);
    float d = gguf_half(b + 108);
    int lo = (il < 8 ? b[96 + il] : (b[96 + il - 8] >> 4)) & 0xF;
    int hi = (b[104 + (il & 3)] >> (2 * (il >> 2))) & 3;
    float dl = d * float((lo | (hi << 4)) - 32);
    for (uint e = 0; e < N; ++e) {
      uint j = j0 + e;
      uint i = 16 * il + j;
      int ql = (b[32 + 32 * (i >> 7) + (i & 31)] >> (2 * ((i >> 5) & 3))) & 3;
      int hb = (b[i & 31] >> (i >> 5)) & 1;
      v[e] = dl * float(ql - (hb != 0 ? 0 : 4));
    }
  }
};

// The six-bit (scale, min) pair j of Q4_K / Q5_K. Only the addresses and shifts depend
// on j < 4, never whether a byte is loaded: lanes decoding different sub-blocks of a
// super-block issue the same loads (a select between loaded values becomes a branch).
inline void gguf_k_scale_min(device const uchar* s, uint j, thread int& sc, thread int& mn) {
  uint hi = j < 4 ? 0 : 1;
  uint sc_lo = s[j + 4 * hi];  // j < 4: all 6 bits; else the low 4
  uint sc_hi = s[j & 3];       // j < 4: all 6 bits; else the top 2, at bits 6..7
  uint mn_lo = s[j + 4];       // j < 4: all 6 bits; else the low 4, at bits 4..7
  uint mn_hi = s[(j & 3) + 4]; // j < 4: all 6 bits; else the top 2, at bits 6..7
  sc = int((sc_lo & 0xF) | ((sc_hi >> (2 * hi)) & 0x30));
  mn = int(((mn_lo >> (4 * hi)) & 0xF) | ((mn_hi >> (2 * hi)) & 0x30));
}

struct GgufQ4_K : GgufDecoders<GgufQ4_K> {
  enum { kBlock = 256, kBytes = 144 };
  template <uint N>
  static void decode(device const uchar* row, uint chunk, uint j0, uint k, thread float* v) {
    uint il;
    device const uchar* b = gguf_block_of<GgufQ4_K>(row, chunk, il);
    float d = gguf_half(b);
    float dmin = gguf_half(b + 2);
    uint sub = il >> 1;  // 32-weight sub-block
    int sc, mn;
    gguf_k_scale_min(b + 4, sub, sc, mn);
    float dj = d * float(sc);
    float mj = dmin * float(mn);
    device const uchar* qs = b + 16 + 32 * (sub >> 1) + 16 * (il & 1);
    uint sh = 4 * (sub & 1);
    for (uint e = 0; e < N; ++e) {
      uint j = j0 + e;
      float t = dj * float((qs[j] >> sh) & 0xF);
      v[e] = t - mj;
    }
  }
};

struct GgufQ5_K : GgufDecoders<GgufQ5_K> {
  enum { kBlock = 256, kBytes = 176 };
  template <uint N>
  static void decode(device const uchar* row, uint chunk, uint j0, uint k, thread float* v) {
    uint il;
    device const uchar* b = gguf_block_of<GgufQ5_K>(row, chunk, il);
    float d = gguf_half(b);
    float dmin = gguf_half(b + 2);
    uint sub = il >> 1;
    int sc, mn;
    gguf_k_scale_min(b + 4, sub, sc, mn);
    float dj = d * float(sc);
    float mj = dmin * float(mn);
    device const uchar* qh = b + 16 + 16 * (il & 1);
    device const uchar* qs = b + 48 + 32 * (sub >> 1) + 16 * (il & 1);
    uint sh = 4 * (sub & 1);
    for (uint e = 0; e < N; ++e) {
      uint j = j0 + e;
      int q = ((qs[j] >> sh) & 0xF) | (((qh[j] >> sub) & 1) << 4);
      float t = dj * float(q);
      v[e] = t - mj;
    }
  }
};

struct GgufQ6_K : GgufDecoders<GgufQ6_K> {
  enum { kBlock = 256, kBytes = 210 };
  template <uint N>
  static void decode(device const uchar* row, uint chunk, uint j0, uint k, thread float* v) {
    uint il;
    device const uchar* b = gguf_block_of<GgufQ6_K>(row, chunk, il);
    float d = gguf_half(b + 208);
    float ds = d * float(((device const char*)(b + 192))[il]);
    for (uint e = 0; e < N; ++e) {
      uint j = j0 + e;
      uint i = 16 * il + j;
      uint h = i >> 7, s = (i >> 5) & 3, l = i & 31;
      int lo = (b[64 * h + 32 * (s & 1) + l] >> (4 * (s >> 1))) & 0xF;
      int hi = (b[128 + 32 * h + l] >> (2 * s)) & 3;
      v[e] = ds * float((lo | (hi << 4)) - 32);
    }
  }
};

// ---- IQ quants -----------------------------------------------------------------

struct GgufIQ4_XS : GgufDecoders<GgufIQ4_XS> {
  enum { kBlock = 256, kBytes = 136 };
  template <uint N>
  static void decode(device const uchar* row, uint chunk, uint j0, uint k, thread float* v) {
    uint il;
    device const uchar* b = gguf_block_of<GgufIQ4_XS>(row, chunk, il);
    float d = gguf_half(b);
    uint ib = il >> 1;
    uint sh = uint(b[2]) | (uint(b[3]) << 8);
    int lo = (b[4 + (ib >> 1)] >> (4 * (ib & 1))) & 0xF;
    int hi = (sh >> (2 * ib)) & 3;
    float dl = d * float((lo | (hi << 4)) - 32);
    device const uchar* qs = b + 8 + 16 * ib;
    for (uint e = 0; e < N; ++e) {
      uint j = j0 + e;
      uint q = (il & 1) == 0 ? (qs[j] & 0xF) : (qs[j] >> 4);
      v[e] = dl * float(kGgufIq4nlValues[q]);
    }
  }
};

struct GgufIQ3_XXS : GgufDecoders<GgufIQ3_XXS> {
  enum { kBlock = 256, kBytes = 98 };
  template <uint N>
  static void decode(device const uchar* row, uint chunk, uint j0, uint k, thread float* v) {
    uint il;
    device const uchar* b = gguf_block_of<GgufIQ3_XXS>(row, chunk, il);
    float d = gguf_half(b);
    uint ib = il >> 1;
    uint aux = gguf_u32(b + 66 + 4 * ib);
    float t = d * (0.5f + float(aux >> 28));
    float db = t * 0.5f;
    for (uint e = 0; e < N; ++e) {
      uint j = j0 + e;
      uint w = 16 * (il & 1) + j;  // weight inside the 32-weight sub-block
      uint g = 8 * (w >> 3);       // group of 8 -> 7 sign bits
      uint s7 = (aux >> (7 * (w >> 3))) & 127;
      uint signs = s7 | ((popcount(s7) & 1) << 7);
      uint grid = kGgufIq3xxsGrid[b[2 + 8 * ib + (w >> 2)]];
      float m = db * float((grid >> (8 * (w & 3))) & 0xFF);
      v[e] = ((signs >> (w - g)) & 1) != 0 ? -m : m;
    }
  }
};

struct GgufIQ3_S : GgufDecoders<GgufIQ3_S> {
  enum { kBlock = 256, kBytes = 110 };
  template <uint N>
  static void decode(device const uchar* row, uint chunk, uint j0, uint k, thread float* v) {
    uint il;
    device const uchar* b = gguf_block_of<GgufIQ3_S>(row, chunk, il);
    float d = gguf_half(b);
    uint ib = il >> 1;
    int sc = (b[106 + (ib >> 1)] >> (4 * (ib & 1))) & 0xF;
    float db = d * float(1 + 2 * sc);
    for (uint e = 0; e < N; ++e) {
      uint j = j0 + e;
      uint i = 16 * il + j;
      uint g = i >> 2;
      uint idx = uint(b[2 + g]) | (((uint(b[66 + (g >> 3)]) >> (g & 7)) & 1) << 8);
      float m = db * float((kGgufIq3sGrid[idx] >> (8 * (i & 3))) & 0xFF);
      v[e] = ((b[74 + (i >> 3)] >> (i & 7)) & 1) != 0 ? -m : m;
    }
  }
};

// Instantiates macro(type_name, Q) for every format.
#define GGUF_FOR_EACH_FORMAT(macro, ...) \
  macro(f32, GgufF32, __VA_ARGS__)       \
  macro(f16, GgufF16, __VA_ARGS__)       \
  macro(bf16, GgufBF16, __VA_ARGS__)     \
  macro(q4_0, GgufQ4_0, __VA_ARGS__)     \
  macro(q4_1, GgufQ4_1, __VA_ARGS__)     \
  macro(q5_0, GgufQ5_0, __VA_ARGS__)     \
  macro(q5_1, GgufQ5_1, __VA_ARGS__)     \
  macro(q8_0, GgufQ8_0, __VA_ARGS__)     \
  macro(q2_k, GgufQ2_K, __VA_ARGS__)     \
  macro(q3_k, GgufQ3_K, __VA_ARGS__)     \
  macro(q4_k, GgufQ4_K, __VA_ARGS__)     \
  macro(q5_k, GgufQ5_K, __VA_ARGS__)     \
  macro(q6_k, GgufQ6_K, __VA_ARGS__)     \
  macro(iq4_nl, GgufIQ4_NL, __VA_ARGS__) \
  macro(mxfp4, GgufMXFP4, __VA_ARGS__)   \
  macro(iq4_xs, GgufIQ4_XS, __VA_ARGS__) \
  macro(iq3_xxs, GgufIQ3_XXS, __VA_ARGS__) \
  macro(iq3_s, GgufIQ3_S, __VA_ARGS__)
