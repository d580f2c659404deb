// varlen_attention: scaled dot-product attention within each sequence of a
// packed variable-length batch (encoder models, whose keys live only for the
// request: no paged KV cache). q/k/v may be any view: on the CPU the kernel reads
// token rows in place where each token's [heads, D] is dense (slices of a fused
// QKV projection); other layouts, and the Metal kernels' inputs, are made dense.
//
//   q           [T, Hq, D] float32/float16/bfloat16
//   k, v        [T, Hkv, D], q's dtype; Hq a multiple of Hkv (q head h reads
//               kv head h / (Hq / Hkv)); D <= 256
//   cu_seqlens  int32 [N + 1]: sequence n owns rows [cu[n], cu[n + 1]);
//               cu[0] == 0, non-decreasing, cu[N] == T
//
// For row i of sequence n (rows [s, e)) and q head h:
//   out[i, h] = sum_j softmax_j(scale * q[i, h] . k[j, h']) v[j, h']
// over j in [s, e) (bidirectional), or j in [s, i] when causal; window > 0
// further keeps only |i - j| < window (Gemma 3's bidirectional sliding layers). float32
// arithmetic, one rounding per output. Returns [T, Hq, D] in q's dtype.
#pragma once

#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/utils.h"
#include "ops/kernel_primitive.h"

namespace vllm_metal {

mx::array varlen_attention(const mx::array& q, const mx::array& k, const mx::array& v,
                           const mx::array& cu_seqlens, float scale, bool causal = false,
                           int64_t window = 0, mx::StreamOrDevice s = {});

struct VarlenAttentionProblem {
  mx::Dtype dtype = mx::float32;
  int64_t num_tokens = 0;
  int64_t num_seqs = 0;
  int64_t num_q_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_size = 0;
  float scale = 1.0f;
  bool causal = false;
  int64_t window = 0;
  int64_t max_seq_len = 0;  // the longest sequence; 0: unknown (num_tokens is assumed)
};

// Head sizes with a tiled Metal kernel (8 query rows per simdgroup); others run one
// simdgroup per (row, head).
std::vector<int64_t> tiled_head_sizes();

// Slots: 0 q, 1 k, 2 v, 3 cu_seqlens, 4 out.
KernelPlan plan_varlen_attention(const VarlenAttentionProblem& p);

class VarlenAttention : public KernelPrimitive {
 public:
  VarlenAttention(mx::Stream stream, KernelBackend backend, float scale, bool causal,
                  int64_t window = 0, int64_t max_seq_len = 0)
      : KernelPrimitive(stream, backend),
        scale_(scale),
        causal_(causal),
        window_(window),
        max_seq_len_(max_seq_len) {}

  KernelPlan plan(const std::vector<mx::array>& inputs,
                  const std::vector<mx::array>& outputs) const override;
  const char* name() const override { return "VarlenAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 protected:
  void eval_native_cpu(const std::vector<mx::array>& inputs,
                       std::vector<mx::array>& outputs) override;

 private:
  VarlenAttentionProblem problem(const std::vector<mx::array>& inputs) const;
  float scale_;
  bool causal_;
  int64_t window_;
  int64_t max_seq_len_;
};

}  // namespace vllm_metal
