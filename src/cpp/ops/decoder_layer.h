// decoder_layer: one pre-norm llama-family layer (norm, q/k/v, q/k norms, rope,
// cache write, paged attention, o_proj, residual, norm, SwiGLU MLP, residual) as a
// single MLX node on the CPU (cpu/decoder_layer.h).
//
// Why: on MLX's CPU backend every node costs ~10 us of dispatch whatever its size,
// and a decode step of a small model is ~20 nodes a layer of a few microseconds of
// work each. On Apple GPUs the per-op path is already cheap (kernels queue in one
// command buffer), so this op has no Metal plan: it refuses GPU streams and the
// emulated backend, and models use it on the native CPU backend only.
#pragma once

#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"
#include "runtime/gguf_types.h"

namespace vllm_metal {

namespace mx = mlx::core;

// What does not change from step to step. Weights are passed with each call, in
// the order of DecoderLayerSpec::weight_names().
struct DecoderLayerSpec {
  int64_t hidden = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t intermediate = 0;
  float norm_eps = 1e-6f;
  float qk_norm_eps = 1e-6f;
  bool qkv_bias = false;  // q, k and v each carry a bias (qwen2, llama attention_bias)
  bool o_bias = false;    // o_proj carries a bias (llama attention_bias)
  bool qk_norm = false;   // per-head RMSNorm of q and k before rope (qwen3, gemma3)
  bool sandwich = false;  // norms of the attention and MLP outputs too (gemma3)
  bool gelu = false;      // MLP activation: tanh GELU (gemma3); else SiLU
  // GGML types of q, k, v, o, gate, up, down (F32 / F16 / BF16 for dense weights)
  std::vector<gguf::GGMLType> types;
  int64_t rotary_dim = 0;
  bool neox = true;
  float rope_mscale = 1.0f;
  float scale = 1.0f;          // attention scale
  int64_t sliding_window = 0;  // 0: none
  float softcap = 0.0f;        // 0: none
  bool exact = true;           // gguf_matmul's exact

  // input_norm, post_norm, q, k, v, o, gate, up, down[, attn_out_norm, mlp_out_norm]
  // [, q_bias, k_bias, v_bias][, o_bias][, q_norm, k_norm]
  std::vector<std::string> weight_names() const;
};

// x [T, hidden] float; positions int32 [T]; slot_mapping int64 [T]; block_tables,
// seq_lens, cu_seqlens_q int32 as paged_attention takes them; key/value caches
// [num_blocks, block_size, num_kv_heads, head_dim] in x's dtype, updated IN PLACE at
// eval (vLLM's KV-cache contract: buffers the runner owns; each must own its buffer
// alone, else the eval raises); rope_table uint32 [2, rotary_dim / 2]
// (rope_turn_table). Returns out [T, hidden]: the residual stream after the layer.
mx::array decoder_layer(const mx::array& x, const mx::array& positions,
                                     const mx::array& slot_mapping,
                                     const mx::array& block_tables, const mx::array& seq_lens,
                                     const mx::array& cu_seqlens_q, const mx::array& key_cache,
                                     const mx::array& value_cache, const mx::array& rope_table,
                                     const std::vector<mx::array>& weights,
                                     const DecoderLayerSpec& spec, mx::StreamOrDevice s = {});

class DecoderLayer : public mx::Primitive {
 public:
  DecoderLayer(mx::Stream stream, DecoderLayerSpec spec)
      : mx::Primitive(stream), spec_(std::move(spec)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "DecoderLayer"; }

 private:
  DecoderLayerSpec spec_;
};

}  // namespace vllm_metal
