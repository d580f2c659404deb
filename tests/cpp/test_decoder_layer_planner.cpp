// plan_decoder_layer: the fused kernels around paged attention, tested with no device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <set>

#include "decoder_layer_args.h"
#include "ops/decoder_layer_plan.h"
#include "ops/gguf_ops.h"

namespace vm = vllm_metal;
namespace mx = mlx::core;
using vllm_metal::gguf::GGMLType;

namespace {

vm::DecoderLayerProblem smollm2_decode(int64_t rows, bool gemma) {
  vm::DecoderLayerProblem p;
  auto& s = p.spec;
  s.hidden = 576;
  s.num_heads = 9;
  s.num_kv_heads = 3;
  s.head_dim = 64;
  s.intermediate = 1536;
  s.rotary_dim = 64;
  s.sandwich = s.gelu = s.qk_norm = gemma;
  s.types = {GGMLType::kQ4_1, GGMLType::kQ4_1, GGMLType::kQ8_0, GGMLType::kQ4_1,
             GGMLType::kQ4_K, GGMLType::kQ4_1, GGMLType::kQ6_K};
  p.dtype = mx::float16;
  p.tokens = rows;
  p.num_slots = 64 * 16;
  auto& a = p.attention;
  a.dtype = mx::float16;
  a.num_tokens = a.num_seqs = a.num_decode_seqs = rows;
  a.num_q_heads = 9;
  a.num_kv_heads = 3;
  a.head_size = 64;
  a.block_size = 16;
  a.num_blocks = 64;
  a.max_blocks = 8;
  a.max_seq_len = 100;
  a.max_query_len = 1;
  return p;
}

}  // namespace

TEST(DecoderLayerPlanner, FiveDispatchesForLlamaSixForGemma) {
  for (bool gemma : {false, true}) {
    auto p = smollm2_decode(8, gemma);
    auto plan = vm::plan_decoder_layer(p);
    std::vector<std::string> want = {"layer_qkv_float16", "paged_attention_decode_float16_d64",
                                     "layer_matvec_float16", "layer_gate_up_float16",
                                     "layer_matvec_float16"};
    if (gemma) want.push_back("layer_add_norm_float16");
    ASSERT_EQ(plan.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(plan[i].kernel, want[i]);
  }
}

TEST(DecoderLayerPlanner, SlotsTypesAndGeometry) {
  auto p = smollm2_decode(11, false);  // two 8-row groups (fused: batch-invariant mode)
  p.attention.batch_invariant = true;
  p.attention.partition_size = vm::kInvariantPartitionSize;
  auto plan = vm::plan_decoder_layer(p);
  const vm::DecoderLayerSlots slots(p.spec);
  const int num_slots = slots.out + vm::DecoderLayerSlots::kNumOutputs;
  for (const auto& l : plan) {
    for (const auto& b : l.buffers) {
      EXPECT_GE(b.array_slot, 0) << l.kernel;
      EXPECT_LT(b.array_slot, num_slots) << l.kernel;
    }
  }
  const auto& qkv = plan[0];
  EXPECT_EQ(qkv.grid[0], 9u + 2 * 3);
  EXPECT_EQ(qkv.grid[1], 2u);
  // types as GGML ids, in q, k, v order; the caches bound as written
  EXPECT_EQ(qkv.constants[0].bits, 3u);
  EXPECT_EQ(qkv.constants[2].bits, 8u);
  int written = 0;
  for (const auto& b : qkv.buffers) {
    if (b.array_slot == vm::DecoderLayerSlots::kKeyCache ||
        b.array_slot == vm::DecoderLayerSlots::kValueCache) {
      EXPECT_TRUE(b.read_before_in_place_write);
      ++written;
    }
  }
  EXPECT_EQ(written, 2);
  DecoderLayerArgs args;
  ASSERT_EQ(qkv.args.size(), sizeof(args));
  std::memcpy(&args, qkv.args.data(), sizeof(args));
  EXPECT_EQ(args.rows, 11u);
  EXPECT_EQ(args.k, 576u);
  EXPECT_EQ(args.chunks, 36u);
  EXPECT_EQ(args.w0_row_bytes, 576u / 32 * 20);  // Q4_1: 20 bytes per 32 weights
  EXPECT_EQ(args.w2_row_bytes, 576u / 32 * 34);  // Q8_0
  EXPECT_EQ(args.norm_threads, 256u);            // rms_norm's count for 576
  EXPECT_EQ(args.num_slots, 64 * 16);
  // attention reads q and writes the attention scratch, mapped onto the layer's slots
  const auto& attn = plan[1];
  EXPECT_EQ(attn.buffers[0].array_slot, slots.q);
  EXPECT_EQ(attn.buffers[7].array_slot, slots.attn);
  // o: h = x + o; down: out = h + down
  EXPECT_EQ(plan[2].buffers[4].array_slot, slots.h);
  EXPECT_EQ(plan[4].buffers[3].array_slot, slots.h);
  EXPECT_EQ(plan[4].buffers[4].array_slot, slots.out);
}

namespace {

DecoderLayerArgs args_of(const vm::KernelLaunch& l) {
  DecoderLayerArgs a;
  EXPECT_EQ(l.args.size(), sizeof(a));
  std::memcpy(&a, l.args.data(), sizeof(a));
  return a;
}

}  // namespace

// Each mat-vec runs gguf_matvec's shape for its k (the same sums, bit for bit); a
// simdgroup owns 32 / lanes_per_row x rows_per_lane weight rows, 8 simdgroups a threadgroup.
TEST(DecoderLayerPlanner, MatvecsTakeGgufMatvecsShape) {
  auto plan = vm::plan_decoder_layer(smollm2_decode(8, false));
  for (int i : {0, 2, 3, 4}) {
    const DecoderLayerArgs a = args_of(plan[i]);
    const vm::GgufMatvecShape want = vm::gguf_matvec_shape(a.k);
    EXPECT_EQ(a.lanes_per_row, want.lanes_per_row) << plan[i].kernel;
    EXPECT_EQ(a.piece, want.piece) << plan[i].kernel;
    // gate_up: rows_per_lane rows of gate and as many of up, as many registers as gguf_matvec's
    EXPECT_EQ(a.rows_per_lane, i == 3 ? std::max(1u, want.rows_per_lane / 2) : want.rows_per_lane)
        << plan[i].kernel;
    EXPECT_EQ(plan[i].threadgroup[0], 256u) << plan[i].kernel;
  }
  // k = 576: 72 pieces of 8 weights, 8 lanes a row (lane use 1); k = 1536: 96 of 16, 32 lanes
  const DecoderLayerArgs qkv = args_of(plan[0]);
  EXPECT_EQ(qkv.lanes_per_row, 8u);
  EXPECT_EQ(qkv.rows_per_lane, 2u);
  EXPECT_EQ(qkv.piece, 8u);
  EXPECT_EQ(plan[0].grid[0], 9u + 2 * 3);  // a head per threadgroup, whatever the shape
  EXPECT_EQ(plan[2].grid[0], 576u / (8 * 8));    // o: 4 groups x 2 rows per simdgroup
  EXPECT_EQ(plan[3].grid[0], 1536u / (8 * 4));   // gate/up: 4 groups x 1 row of each
  const DecoderLayerArgs down = args_of(plan[4]);
  EXPECT_EQ(down.lanes_per_row, 32u);
  EXPECT_EQ(down.piece, 16u);
  EXPECT_EQ(plan[4].grid[0], 576u / (8 * 4));    // down: 1 group x 4 rows per simdgroup
}

TEST(DecoderLayerPlanner, RefusesHeadsTheKernelsDoNotHold) {
  auto p = smollm2_decode(1, false);
  p.spec.head_dim = 1024;
  EXPECT_THROW(vm::plan_decoder_layer(p), std::invalid_argument);
}

TEST(DecoderLayerPlanner, LongBatchesRunThePerOpKernelsInOnePlan) {
  auto p = smollm2_decode(9, false);
  ASSERT_FALSE(vm::decoder_layer_fuses(p));
  auto plan = vm::plan_decoder_layer(p);
  std::vector<std::string> want = {
      "rms_norm_float16", "gguf_matmul_q4_1_float16", "gguf_matmul_q4_1_float16",
      "gguf_matmul_q8_0_float16", "layer_qkv_float16", "paged_attention_decode_float16_d64",
      "gguf_matmul_q4_1_float16", "layer_add_norm_float16", "rms_norm_float16",
      "gguf_matmul_q4_k_float16", "gguf_matmul_q4_1_float16", "layer_act_float16",
      "gguf_matmul_q6_k_float16", "layer_add_norm_float16"};
  ASSERT_EQ(plan.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(plan[i].kernel, want[i]) << i;
  const vm::DecoderLayerSlots slots(p.spec);
  EXPECT_EQ(plan[1].buffers[2].array_slot, slots.q_projected);  // q's mat-mul output
  EXPECT_EQ(plan[4].constants[10].bits, 1u);                   // layer_qkv reads it
  EXPECT_EQ(plan.back().buffers[3].array_slot, slots.out);
}

// Split-KV attention (a long context, few rows): the o projection combines the partitions
// while it stages its input, so the reduce is not dispatched (issue 28: at most 6 a layer).
TEST(DecoderLayerPlanner, SplitContextsFoldTheReduceIntoTheOProjection) {
  for (bool gemma : {false, true}) {
    auto p = smollm2_decode(2, gemma);
    p.attention.max_seq_len = 1025;  // past 2 partitions of 512: 3 partitions
    p.attention.max_blocks = 65;
    ASSERT_GT(vm::choose_decode_partitions(p.attention), 1);
    auto plan = vm::plan_decoder_layer(p);
    ASSERT_EQ(plan.size(), gemma ? 6u : 5u);
    for (const auto& l : plan) EXPECT_EQ(l.kernel.find("reduce"), std::string::npos) << l.kernel;
    const vm::DecoderLayerSlots slots(p.spec);
    const auto& o = plan[2];
    EXPECT_EQ(o.kernel, "layer_matvec_float16");
    EXPECT_EQ(o.constants[11].bits, 1u);  // fc_combine
    EXPECT_EQ(o.constants[9].bits, 1u);   // staged
    auto bound = [&](int index) {
      for (const auto& b : o.buffers) {
        if (b.index == index) return b.array_slot;
      }
      return -1;
    };
    EXPECT_EQ(bound(0), slots.attn);  // rows attention wrote directly (none here)
    EXPECT_EQ(bound(6), slots.partials);
    EXPECT_EQ(bound(8), slots.partials + 2);
    EXPECT_EQ(bound(9), vm::DecoderLayerSlots::kSeqLens);
    EXPECT_EQ(bound(10), vm::DecoderLayerSlots::kCuSeqlensQ);
    const DecoderLayerArgs a = args_of(o);
    EXPECT_EQ(a.attention.num_partitions, 3u);
    EXPECT_EQ(a.attention.num_seqs, 2u);
    // (max, 1 / sum) per (row, head) and a count per row: 2 x (2 x 9 + 1) floats, 16-byte
    // rounded, then the staged rows
    EXPECT_EQ(a.staged_offset * 2u, 160u);
    EXPECT_EQ(o.threadgroup_memory[0], 160u + 2 * 576 * 2);
    EXPECT_EQ(plan[4].constants[11].bits, 0u);  // down never combines
  }
}

// When the staged rows and the partitions' statistics do not fit in 32 KB (8 float32 rows
// of q width 1024 fill it alone), the reduce stays a dispatch of its own.
TEST(DecoderLayerPlanner, SplitContextsKeepTheReduceWhenTheCombineDoesNotFit) {
  auto p = smollm2_decode(8, false);
  p.dtype = p.attention.dtype = mx::float32;
  p.spec.num_heads = p.attention.num_q_heads = 16;
  p.attention.max_seq_len = 1100;
  p.attention.max_blocks = 69;
  p.attention.num_kv_heads = p.spec.num_kv_heads = 1;  // 8 decode threadgroups: splits
  auto plan = vm::plan_decoder_layer(p);
  ASSERT_EQ(plan.size(), 6u);
  EXPECT_EQ(plan[2].kernel, "paged_attention_reduce_float32_d64");
  EXPECT_EQ(plan[3].constants[11].bits, 0u);
  EXPECT_EQ(plan[3].buffers[0].array_slot, vm::DecoderLayerSlots(p.spec).attn);
}
