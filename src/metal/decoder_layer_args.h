// Arguments of the fused decoder-layer kernels (decoder_layer.metal), shared by
// the host (C++) and the shader. One struct for all five kernels; each reads the
// fields it needs.
#pragma once

#ifdef __METAL_VERSION__
#include <metal_stdlib>
#else
#include <cstddef>
#include <cstdint>
#endif

#include "paged_attention_args.h"

struct DecoderLayerArgs {
  uint64_t w0_row_bytes;       // bytes of one encoded row: q / gate / the mat-vec's weight
  uint64_t w1_row_bytes;       // k / up
  uint64_t w2_row_bytes;       // v
  int64_t num_slots;           // cache slots: num_blocks * block_size
  uint32_t rows;               // activation rows (tokens), all of them
  uint32_t k;                  // input width of the projections
  uint32_t n;                  // outputs per row (rows of the weight)
  uint32_t chunks;             // 16-weight chunks per weight row: ceil(k / 16)
  uint32_t num_heads;
  uint32_t num_kv_heads;
  uint32_t head_dim;
  uint32_t rotary_half;        // rotary_dim / 2
  uint32_t norm_threads;       // threads that sum an input row's squares (rms_norm's count)
  uint32_t head_norm_threads;  // the same for a q / k head (q_norm, k_norm)
  float eps;                   // the layer norms' eps
  float qk_eps;                // q_norm / k_norm eps
  float mscale;                // rope: multiplies cos and sin
  // the mat-vec core's shape (gguf_matvec_core.h; the host's gguf_matvec_shape(k)):
  uint32_t lanes_per_row;      // lanes sharing a weight row (a power of two dividing 32)
  uint32_t rows_per_lane;      // weight rows each lane decodes (layer_gate_up: of gate and of up)
  uint32_t piece;              // weights per piece: 16 or 8
  // layer_matvec with fc_combine (the o projection folds split-KV attention's reduce):
  uint32_t staged_offset;      // T elements of threadgroup(0) before the staged rows: the
                               // partitions' (max, 1 / sum) per (row, head), parts per row
  uint32_t pad0;
  PagedAttentionArgs attention;  // the split decode launch's arguments
};

#ifndef __METAL_VERSION__
static_assert(sizeof(DecoderLayerArgs) == 184, "DecoderLayerArgs layout must match the shader");
static_assert(offsetof(DecoderLayerArgs, rows) == 32, "DecoderLayerArgs layout must match the shader");
static_assert(offsetof(DecoderLayerArgs, norm_threads) == 64,
              "DecoderLayerArgs layout must match the shader");
static_assert(offsetof(DecoderLayerArgs, mscale) == 80, "DecoderLayerArgs layout must match the shader");
static_assert(offsetof(DecoderLayerArgs, piece) == 92, "DecoderLayerArgs layout must match the shader");
static_assert(offsetof(DecoderLayerArgs, attention) == 104,
              "DecoderLayerArgs layout must match the shader");
#endif
