// Fused kernels of one decoder layer for small batches (up to 8 rows per
// threadgroup; grid y walks groups of 8 rows). With paged attention's decode
// kernel, a llama-family layer is 5 dispatches and a gemma3 layer 6:
//
//   layer_qkv       x -> input RMSNorm -> q, k, v (+ bias) -> q/k norm -> rope;
//                   q to q_out, k and v into the caches at slot_mapping
//   paged_attention (its own plan; split-KV without its reduce when the o
//                   projection can fold it in)
//   layer_matvec    o projection: h = x + o (gemma: o alone); split-KV: combines
//                   the partitions as paged_attention_reduce does while staging x
//   layer_gate_up   [gemma: h = x + attn_out_norm(o)] -> RMSNorm -> gate, up ->
//                   act(gate) * up (SiLU, or gemma's tanh GELU)
//   layer_matvec    down projection: out = h + down (gemma: down alone)
//   layer_add_norm  gemma only: out = h + mlp_out_norm(down)
//
// Every value is rounded to T where the per-op kernels round it (the projections'
// outputs, the bias and residual sums, each norm's output, rope's output), every
// row's RMS is summed in rms_norm.metal's order (the first `norm_threads` threads
// stride over the row, simd_sum, then the simdgroups' sums in order) and every
// mat-vec row by gguf_matvec's own loop (gguf_matvec_core.h, with the host's shape
// for k: lanes per row, rows per lane, piece), in its order. So the fused layer
// gives the per-op Metal path's bits, except the MLP activation, which is
// computed in float32 and rounded once, as the CPU's fused layer does. Each
// threadgroup recomputes its rows' RMS (a few KB at decode sizes) instead of
// reading a normalised copy, and (fc_staged, when they fit) keeps its normalised
// rows in threadgroup memory for all its weight rows; otherwise every weight row
// normalises x again on the fly. Weight types are function constants (GGML ids).
#include <metal_stdlib>
#include "decoder_layer_common.h"
#include "paged_attention_split.h"
#include "rope_turns.h"

using namespace metal;

// layer_qkv's mat-vec part: tile[i][r] = T(norm(x_i) . W row (h d + r)) (+ bias).
template <typename T>
inline void layer_project_head(device const T* x, device const T* input_norm,
                               device const uchar* w, uint type, ulong row_bytes,
                               device const T* bias, uint h, uint d, uint rows, uint x0,
                               constant DecoderLayerArgs& args, threadgroup float* tile,
                               threadgroup T* xs, threadgroup float* red, uint tid, uint ntg,
                               uint nsg, uint sg, uint lane) {
  LayerRows<T> raw;
  raw.x = x + ulong(x0) * args.k;
  raw.stride = args.k;
  LayerNormed<T, LayerRows<T>> xn;
  xn.src = raw;
  xn.w = input_norm;
  layer_inv_rms(raw, args.k, rows, args.norm_threads, args.eps, tid, red, nsg, sg, lane, xn.inv);
  if (fc_staged) {
    layer_stage(xn, xs, args.k, rows, tid, ntg);
  }
  // each simdgroup takes blocks of sg_rows of the head's d weight rows in turn
  const uint sg_rows = (32 / args.lanes_per_row) * args.rows_per_lane;
  for (uint b = sg * sg_rows; b < d; b += nsg * sg_rows) {  // uniform over the simdgroup
    GgufMvLane l = gguf_mv_lane(b, d, args.lanes_per_row, args.rows_per_lane, lane);
    GgufMvRowsTyped wr = layer_rows(type, w, row_bytes, h * d + l.row0, args.k);
    float acc[kGgufMvMaxRowsPerLane][kGgufMvMaxX];
    gguf_mv_clear(acc);
    layer_mv_partial(wr, l.rows, xn, xs, rows, args, l.piece, acc);
    gguf_mv_reduce(acc, args.rows_per_lane, rows, args.lanes_per_row);
    for (uint r = 0; r < l.rows; ++r) {
      const uint row = l.row0 + r;
      for (uint i = 0; i < rows; ++i) {
        T y = T(acc[r][i]);
        if (fc_bias) {
          y = T(float(y) + float(bias[h * d + row]));
        }
        if (l.piece == 0) {  // one lane of each group
          tile[i * d + row] = float(y);
        }
      }
    }
  }
}

// layer_qkv after the projection: per-head q/k norm, rope, q out, k and v into the caches.
template <typename T>
inline void layer_head_epilogue(uint kind, uint h, uint d, uint rows, uint x0,
                                device const T* q_norm, device const T* k_norm,
                                device const int* positions, device const uint* table,
                                device const int64_t* slot_mapping, device T* q_out,
                                device T* key_cache, device T* value_cache,
                                constant DecoderLayerArgs& args, threadgroup float* tile,
                                threadgroup float* red, uint tid, uint ntg, uint nsg, uint sg,
                                uint lane) {
  const uint hq = args.num_heads;
  const uint hkv = args.num_kv_heads;
  if (fc_qk_norm && kind < 2u) {  // uniform over the threadgroup
    device const T* nw = kind == 0u ? q_norm : k_norm;
    float part[kLayerMaxRows];
    for (uint i = 0; i < kLayerMaxRows; ++i) {
      part[i] = 0.0f;
    }
    if (tid < args.head_norm_threads) {
      for (uint j = tid; j < d; j += args.head_norm_threads) {
        for (uint i = 0; i < rows; ++i) {
          float v = tile[i * d + j];
          part[i] += v * v;
        }
      }
    }
    float total[kLayerMaxRows];
    layer_row_sums(part, rows, red, nsg, sg, lane, total);
    for (uint i = 0; i < rows; ++i) {
      float inv = rsqrt(total[i] / float(d) + args.qk_eps);
      for (uint j = tid; j < d; j += ntg) {
        tile[i * d + j] = float(T(tile[i * d + j] * inv * float(nw[j])));
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  const uint half_rot = args.rotary_half;
  for (uint i = 0; i < rows; ++i) {
    const uint t = x0 + i;
    device T* dst;
    if (kind == 0u) {
      dst = q_out + (ulong(t) * hq + h) * d;
    } else {
      const int64_t slot = slot_mapping[t];
      if (slot < 0 || slot >= args.num_slots) {
        continue;  // padding token (or a slot the host refused): nothing written
      }
      dst = (kind == 1u ? key_cache : value_cache) + (ulong(slot) * hkv + h) * d;
    }
    threadgroup const float* src = tile + i * d;
    uint copy_from = 0;
    if (kind < 2u) {
      const long pos = long(positions[t]);
      const uint pl = uint(pos);
      const uint ph = uint(pos >> 32);
      for (uint p = tid; p < half_rot; p += ntg) {
        float2 cs = rope_cos_sin(pl, ph, table[p], table[half_rot + p], args.mscale);
        uint i1 = fc_neox ? p : 2u * p;
        uint i2 = fc_neox ? p + half_rot : 2u * p + 1u;
        float a = src[i1];
        float b = src[i2];
        dst[i1] = T(a * cs.x - b * cs.y);
        dst[i2] = T(b * cs.x + a * cs.y);
      }
      copy_from = 2u * half_rot;  // partial rotary: the rest passes through
    }
    for (uint j = copy_from + tid; j < d; j += ntg) {
      dst[j] = T(src[j]);
    }
  }
}

// One threadgroup per (head of q, k or v; group of 8 rows).
template <typename T>
kernel void layer_qkv(
    device const T* x [[buffer(0)]],
    device const T* input_norm [[buffer(1)]],
    device const uchar* wq [[buffer(2)]],
    device const uchar* wk [[buffer(3)]],
    device const uchar* wv [[buffer(4)]],
    device const T* q_bias [[buffer(5)]],
    device const T* k_bias [[buffer(6)]],
    device const T* v_bias [[buffer(7)]],
    device const T* q_norm [[buffer(8)]],
    device const T* k_norm [[buffer(9)]],
    device const int* positions [[buffer(10)]],
    device const uint* table [[buffer(11)]],
    device const int64_t* slot_mapping [[buffer(12)]],
    device T* q_out [[buffer(13)]],
    device T* key_cache [[buffer(14)]],
    device T* value_cache [[buffer(15)]],
    constant DecoderLayerArgs& args [[buffer(16)]],
    device const T* q_projected [[buffer(17)]],  // fc_projected: [rows, Hq * D], bias not added
    device const T* k_projected [[buffer(18)]],
    device const T* v_projected [[buffer(19)]],
    threadgroup float* tile [[threadgroup(0)]],  // [rows][head_dim] of this head
    threadgroup T* xs [[threadgroup(1)]],        // fc_staged: [rows][k] normalised x
    uint2 tgp [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint ntg [[threads_per_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float red[kLayerMaxRows * kLayerMaxSimdgroups];
  const uint nsg = (ntg + 31) / 32;
  const uint x0 = tgp.y * kLayerMaxRows;
  const uint rows = min(kLayerMaxRows, args.rows - x0);
  const uint d = args.head_dim;
  const uint hq = args.num_heads;
  const uint hkv = args.num_kv_heads;
  const uint kind = tgp.x < hq ? 0u : (tgp.x < hq + hkv ? 1u : 2u);  // q, k, v
  const uint h = kind == 0u ? tgp.x : (kind == 1u ? tgp.x - hq : tgp.x - hq - hkv);
  const uint type = kind == 0u ? fc_type0 : (kind == 1u ? fc_type1 : fc_type2);
  device const uchar* w = kind == 0u ? wq : (kind == 1u ? wk : wv);
  const ulong row_bytes =
      kind == 0u ? args.w0_row_bytes : (kind == 1u ? args.w1_row_bytes : args.w2_row_bytes);
  device const T* bias = kind == 0u ? q_bias : (kind == 1u ? k_bias : v_bias);

  if (fc_projected) {  // long batches: the tiled mat-mul projected (normalised) x already
    device const T* projected = kind == 0u ? q_projected : (kind == 1u ? k_projected : v_projected);
    const uint width = (kind == 0u ? hq : hkv) * d;
    for (uint r = tid; r < d; r += ntg) {
      for (uint i = 0; i < rows; ++i) {
        T y = projected[(ulong(x0) + i) * width + h * d + r];
        if (fc_bias) {
          y = T(float(y) + float(bias[h * d + r]));
        }
        tile[i * d + r] = float(y);
      }
    }
  } else {
    layer_project_head(x, input_norm, w, type, row_bytes, bias, h, d, rows, x0, args, tile, xs,
                       red, tid, ntg, nsg, sg, lane);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  layer_head_epilogue(kind, h, d, rows, x0, q_norm, k_norm, positions, table, slot_mapping, q_out,
                      key_cache, value_cache, args, tile, red, tid, ntg, nsg, sg, lane);
}

// act(gate) * up: each simdgroup a block of intermediate rows (gguf_matvec's rows per
// simdgroup for k, rows_per_lane halved: gate and up each), 8 rows of x at a time.
template <typename T>
kernel void layer_gate_up(
    device const T* x [[buffer(0)]],
    device const T* residual [[buffer(1)]],
    device const T* attn_out_norm [[buffer(2)]],
    device const T* norm [[buffer(3)]],
    device const uchar* w_gate [[buffer(4)]],
    device const uchar* w_up [[buffer(5)]],
    device T* out [[buffer(6)]],
    device T* h_out [[buffer(7)]],
    constant DecoderLayerArgs& args [[buffer(8)]],
    threadgroup T* xs [[threadgroup(0)]],  // fc_staged: [rows][k] normalised residual stream
    uint2 tgp [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint ntg [[threads_per_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float red[kLayerMaxRows * kLayerMaxSimdgroups];
  const uint nsg = (ntg + 31) / 32;
  const uint x0 = tgp.y * kLayerMaxRows;
  const uint rows = min(kLayerMaxRows, args.rows - x0);
  const ulong base = ulong(x0) * args.k;

  LayerRows<T> raw;
  raw.x = x + base;
  raw.stride = args.k;
  LayerResidual<T> hs;
  hs.x = x + base;
  hs.res = residual + base;
  hs.wa = attn_out_norm;
  hs.stride = args.k;
  layer_inv_rms(raw, args.k, rows, args.norm_threads, args.eps, tid, red, nsg, sg, lane,
                hs.inv_x);
  LayerNormed<T, LayerResidual<T>> xn;
  xn.src = hs;
  xn.w = norm;
  if (fc_sandwich) {  // uniform: the residual stream is x + attn_out_norm(x)
    layer_inv_rms(hs, args.k, rows, args.norm_threads, args.eps, tid, red, nsg, sg, lane, xn.inv);
    if (tgp.x == 0) {  // one threadgroup per row group writes it for the down projection
      for (uint j = tid; j < args.k; j += ntg) {
        for (uint i = 0; i < rows; ++i) {
          h_out[base + i * args.k + j] = T(hs.at(i, j));
        }
      }
    }
  } else {
    for (uint i = 0; i < kLayerMaxRows; ++i) {
      xn.inv[i] = hs.inv_x[i];
    }
  }
  if (fc_staged) {
    layer_stage(xn, xs, args.k, rows, tid, ntg);
  }

  // a lane decodes rows_per_lane rows of gate and as many of up, interleaved
  const uint sg_rows = (32 / args.lanes_per_row) * args.rows_per_lane;
  const uint sg_row0 = (tgp.x * nsg + sg) * sg_rows;
  if (sg_row0 >= args.n) {
    return;  // whole simdgroup; no barrier follows
  }
  GgufMvLane l = gguf_mv_lane(sg_row0, args.n, args.lanes_per_row, args.rows_per_lane, lane);
  GgufMvRowsPair<GgufMvRowsTyped, GgufMvRowsTyped> wr;
  wr.a = layer_rows(fc_type0, w_gate, args.w0_row_bytes, l.row0, args.k);
  wr.b = layer_rows(fc_type1, w_up, args.w1_row_bytes, l.row0, args.k);
  float acc[kGgufMvMaxRowsPerLane][kGgufMvMaxX];
  gguf_mv_clear(acc);
  layer_mv_partial(wr, 2 * l.rows, xn, xs, rows, args, l.piece, acc);
  gguf_mv_reduce(acc, 2 * args.rows_per_lane, rows, args.lanes_per_row);
  for (uint r = 0; r < l.rows; ++r) {
    for (uint i = 0; i < rows; ++i) {
      float g = float(T(acc[2 * r][i]));
      float u = float(T(acc[2 * r + 1][i]));
      if (l.piece == 0) {
        out[(ulong(x0) + i) * args.n + l.row0 + r] = T(layer_gated(g, u));
      }
    }
  }
}

// Stages attention's output rows [rows][Hq * D] in xs, combining split-KV partitions
// (fc_combine) in paged_attention_reduce's order and rounding (paged_attention_split.h):
// per (row, head) the partitions' max and 1 / sum into `stats` first, then each value
// T(sum_p partial_out * rescale * (1 / sum)); rows the decode kernel wrote directly (one
// partition, prefill tokens) are copied from x. All threads, then a barrier.
template <typename T>
inline void layer_stage_combined(device const T* x, device const float* partial_out,
                                 device const float* partial_max,
                                 device const float* partial_sum, device const int* seq_lens,
                                 device const int* cu_seqlens_q, constant DecoderLayerArgs& args,
                                 uint x0, uint rows, threadgroup float* stats,
                                 threadgroup T* xs, uint tid, uint ntg) {
  constant PagedAttentionArgs& pa = args.attention;
  const uint hq = args.num_heads;
  const uint d = args.head_dim;
  // [rows] partitions of each row; 0: attention wrote it directly
  threadgroup uint* row_parts = (threadgroup uint*)(stats + 2 * rows * hq);
  for (uint c = tid; c < rows * hq; c += ntg) {
    const uint i = c / hq;
    const uint head = c % hq;
    const uint parts = paged_split_parts(seq_lens, cu_seqlens_q, pa, x0 + i);
    float2 scale = float2(0.0f, 0.0f);
    if (parts != 0) {
      scale = paged_split_scale(partial_max, partial_sum, paged_split_cell(x0 + i, head, pa), parts);
    }
    stats[2 * c] = scale.x;
    stats[2 * c + 1] = scale.y;
    if (head == 0) {
      row_parts[i] = parts;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint j = tid; j < args.k; j += ntg) {
    const uint head = j / d;
    for (uint i = 0; i < rows; ++i) {
      const uint parts = row_parts[i];
      T v;
      if (parts == 0) {
        v = x[(ulong(x0) + i) * args.k + j];
      } else {
        const uint c = i * hq + head;
        const float o = paged_split_value(partial_out, partial_max,
                                          paged_split_cell(x0 + i, head, pa), parts, d, j - head * d,
                                          stats[2 * c]);
        v = T(o * stats[2 * c + 1]);
      }
      xs[i * args.k + j] = v;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// y = [residual +] T(W x [+ bias]): each simdgroup gguf_matvec's block of weight rows for
// k, 8 rows of x at a time. fc_combine (o after split-KV attention): x is staged from the
// partitions (layer_stage_combined), the reduce's dispatch folded in.
template <typename T>
kernel void layer_matvec(
    device const T* x [[buffer(0)]],
    device const uchar* w [[buffer(1)]],
    device const T* bias [[buffer(2)]],
    device const T* residual [[buffer(3)]],
    device T* y [[buffer(4)]],
    constant DecoderLayerArgs& args [[buffer(5)]],
    device const float* partial_out [[buffer(6)]],  // fc_combine: paged attention's scratch
    device const float* partial_max [[buffer(7)]],
    device const float* partial_sum [[buffer(8)]],
    device const int* seq_lens [[buffer(9)]],
    device const int* cu_seqlens_q [[buffer(10)]],
    // fc_staged: [rows][k] copy of x; fc_combine: after args.staged_offset elements of
    // float (max, 1 / sum) per (row, head) and the rows' partition counts
    threadgroup T* staged_mem [[threadgroup(0)]],
    uint2 tgp [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint ntg [[threads_per_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  const uint nsg = (ntg + 31) / 32;
  const uint sg_rows = (32 / args.lanes_per_row) * args.rows_per_lane;
  const uint sg_row0 = (tgp.x * nsg + sg) * sg_rows;
  const uint x0 = tgp.y * kLayerMaxRows;
  const uint rows = min(kLayerMaxRows, args.rows - x0);
  LayerRows<T> xs;
  xs.x = x + ulong(x0) * args.k;
  xs.stride = args.k;
  threadgroup T* staged = staged_mem;
  if (fc_combine) {
    staged = staged_mem + args.staged_offset;
    layer_stage_combined(x, partial_out, partial_max, partial_sum, seq_lens, cu_seqlens_q, args,
                         x0, rows, (threadgroup float*)staged_mem, staged, tid, ntg);
  } else if (fc_staged) {
    layer_stage(xs, staged, args.k, rows, tid, ntg);
  }
  if (sg_row0 >= args.n) {
    return;  // whole simdgroup; no barrier follows
  }
  GgufMvLane l = gguf_mv_lane(sg_row0, args.n, args.lanes_per_row, args.rows_per_lane, lane);
  GgufMvRowsTyped wr = layer_rows(fc_type0, w, args.w0_row_bytes, l.row0, args.k);
  float acc[kGgufMvMaxRowsPerLane][kGgufMvMaxX];
  gguf_mv_clear(acc);
  layer_mv_partial(wr, l.rows, xs, staged, rows, args, l.piece, acc);
  gguf_mv_reduce(acc, args.rows_per_lane, rows, args.lanes_per_row);
  for (uint r = 0; r < l.rows; ++r) {
    for (uint i = 0; i < rows; ++i) {
      const ulong at = (ulong(x0) + i) * args.n + l.row0 + r;
      T v = T(acc[r][i]);
      if (fc_bias) {
        v = T(float(v) + float(bias[l.row0 + r]));
      }
      if (fc_residual) {
        v = T(float(residual[at]) + float(v));
      }
      if (l.piece == 0) {  // one lane of each group
        y[at] = v;
      }
    }
  }
}

// out = T(residual + y'), one threadgroup per row (norm_threads threads, rms_norm's
// count): y' = T(mlp_out_norm(y)) (fc_sandwich: gemma's output norms), else y (+ bias)
// rounded, as `residual + o_proj(x)` adds the bias first.
template <typename T>
kernel void layer_add_norm(
    device const T* y [[buffer(0)]],
    device const T* residual [[buffer(1)]],
    device const T* w [[buffer(2)]],  // the norm weight (fc_sandwich) or the bias (fc_bias)
    device T* out [[buffer(3)]],
    constant DecoderLayerArgs& args [[buffer(4)]],
    uint row [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint ntg [[threads_per_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float red[kLayerMaxRows * kLayerMaxSimdgroups];
  const uint nsg = (ntg + 31) / 32;
  const ulong base = ulong(row) * args.k;
  LayerRows<T> ys;
  ys.x = y + base;
  ys.stride = args.k;
  float inv[kLayerMaxRows];
  if (fc_sandwich) {
    layer_inv_rms(ys, args.k, 1u, args.norm_threads, args.eps, tid, red, nsg, sg, lane, inv);
  }
  for (uint j = tid; j < args.k; j += ntg) {
    T v = y[base + j];
    if (fc_sandwich) {
      v = T(float(v) * inv[0] * float(w[j]));
    } else if (fc_bias) {
      v = T(float(v) + float(w[j]));
    }
    out[base + j] = T(float(residual[base + j]) + float(v));
  }
}

// act[t, j] = T(act(gate[t, j]) * up[t, j]) over [rows, n], one thread an element (long
// batches: gate and up come from the tiled mat-mul).
template <typename T>
kernel void layer_act(
    device const T* gate [[buffer(0)]],
    device const T* up [[buffer(1)]],
    device T* out [[buffer(2)]],
    constant DecoderLayerArgs& args [[buffer(3)]],
    uint e [[thread_position_in_grid]]) {
  if (e >= args.rows * args.n) {
    return;
  }
  out[e] = T(layer_gated(float(gate[e]), float(up[e])));
}

// out[e] = float(in[e]) over [rows, n]: an MoE layer's router logits, rounded to T as the
// router's mat-mul wrote them, for the routing kernel's float32 input.
template <typename T>
kernel void layer_to_float(
    device const T* in [[buffer(0)]],
    device float* out [[buffer(1)]],
    constant DecoderLayerArgs& args [[buffer(2)]],
    uint e [[thread_position_in_grid]]) {
  if (e >= args.rows * args.n) {
    return;
  }
  out[e] = float(in[e]);
}

#define instantiate_decoder_layer(tname, T)                                                  \
  template [[host_name("layer_qkv_" #tname)]] kernel decltype(layer_qkv<T>) layer_qkv<T>;    \
  template [[host_name("layer_gate_up_" #tname)]] kernel decltype(layer_gate_up<T>)          \
      layer_gate_up<T>;                                                                      \
  template [[host_name("layer_matvec_" #tname)]] kernel decltype(layer_matvec<T>)            \
      layer_matvec<T>;                                                                       \
  template [[host_name("layer_add_norm_" #tname)]] kernel decltype(layer_add_norm<T>)        \
      layer_add_norm<T>;                                                                     \
  template [[host_name("layer_act_" #tname)]] kernel decltype(layer_act<T>) layer_act<T>;    \
  template [[host_name("layer_to_float_" #tname)]] kernel decltype(layer_to_float<T>)        \
      layer_to_float<T>;

instantiate_decoder_layer(float32, float)
instantiate_decoder_layer(float16, half)
instantiate_decoder_layer(bfloat16, bfloat)
