// apply_token_bitmask: a structured-output grammar's token mask applied to logits
// (issue 21). Out of place, MLX style:
//
//   logits   [num_rows, vocab] float32/float16/bfloat16
//   bitmask  int32 [num_masked, words], words >= ceil(vocab / 32)
//   rows     int32 [num_masked]: mask row i applies to logits row rows[i]; in
//            [0, num_rows), no row twice; rows not listed are copied unchanged
//   returns  [num_rows, vocab] in logits' dtype: logits with every disallowed
//            token of a masked row set to -inf (a row whose mask allows nothing
//            is all -inf; the sampler then has no finite logit in that row)
//
// Token t of a masked row is allowed iff bit (t % 32) of word t / 32 is set
// (least significant bit first, a set bit allows). Allowed values are copied
// bit for bit; -inf is written as its bit pattern (no float arithmetic at all).
//
// Verified against the sources installed with vLLM 0.33.0 (xgrammar 0.2.8):
// - xgrammar `allocate_token_bitmask(batch, vocab)`: int32 [batch, ceil(vocab/32)],
//   filled with -1 (all allowed); `apply_token_bitmask_inplace` documents "0 means
//   the token is masked", logits[i, j] = -inf when bit j of row i is 0, and vLLM's
//   Triton kernel (v1/worker/gpu/structured_outputs.py) unpacks word >> arange(32)
//   & 1 == 0 as disallowed: bit j of word w is token 32 w + j.
// - Row mapping: vLLM's scheduler sends the masks compacted, one block of
//   mask_stride = 1 + num_speculative_tokens rows per structured-output request,
//   in structured_output_request_ids order. The model runner V1
//   (structured_output/utils.py apply_grammar_bitmask) scatters them into a
//   [num_logits, words] array filled with -1 and passes the logits rows to
//   xgrammar as `indices`; runner V2 (StructuredOutputsWorker) keeps them compact
//   and maps mask row i to a logits row (logits_indices + cu_num_logits). `rows`
//   here is V2's compact form: mask row i -> logits row rows[i].
// - Vocab padding: the backends size the mask from model_config.get_vocab_size()
//   (guidance: max(that, len(tokenizer)); xgrammar with a Mistral tokenizer:
//   len(tokenizer.vocab)), and the LogitsProcessor cuts the lm head's padding off
//   the logits (logits[..., :org_vocab_size]), so usually words == ceil(vocab/32).
//   Bits past `vocab` (the last word's high bits, wider masks) are ignored, as
//   xgrammar and vLLM's kernel ignore them. xgrammar's tokens past its own vocab
//   size (padding ids) have 0 bits: disallowed, like any 0 bit.
// - A mask narrower than the logits (32 * words < vocab) is an error here.
//   xgrammar instead leaves logits[..., 32 * words:] unmasked (with a warning that
//   out-of-grammar tokens can then be sampled); a caller with such a mask pads it
//   with 0 words (disallow) or -1 words (xgrammar's behaviour) on purpose.
#pragma once

#include <string>

#include "mlx/array.h"
#include "mlx/utils.h"
#include "ops/kernel_primitive.h"

namespace vllm_metal {

mx::array apply_token_bitmask(const mx::array& logits, const mx::array& bitmask,
                              const mx::array& rows, mx::StreamOrDevice s = {});

struct TokenBitmaskProblem {
  mx::Dtype dtype = mx::float32;
  int64_t num_rows = 0;
  int64_t vocab = 0;
  int64_t mask_words = 0;  // int32 words per bitmask row (its row stride)
  // out shares logits' buffer: rows without a mask and allowed tokens are not
  // written, and logits are not read at all
  bool in_place = false;
};

// "apply_token_bitmask_{float32|float16|bfloat16}"
std::string token_bitmask_kernel_name(mx::Dtype dtype);

// Simdgroups of a threadgroup: each covers 32 mask words (1024 tokens) of a row.
uint32_t token_bitmask_simdgroups(int64_t vocab);

// One launch: grid (spans of the row, num_rows). Slots: 0 logits, 1 bitmask,
// 2 mask_of_row (int32 [num_rows], -1: no mask), 3 out.
KernelPlan plan_apply_token_bitmask(const TokenBitmaskProblem& p);

class ApplyTokenBitmask : public KernelPrimitive {
 public:
  ApplyTokenBitmask(mx::Stream stream, KernelBackend backend)
      : KernelPrimitive(stream, backend) {}

  KernelPlan plan(const std::vector<mx::array>& inputs,
                  const std::vector<mx::array>& outputs) const override;
  const char* name() const override { return "ApplyTokenBitmask"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 protected:
  void allocate_outputs(const std::vector<mx::array>& inputs,
                        std::vector<mx::array>& outputs) override;
  void eval_native_cpu(const std::vector<mx::array>& inputs,
                       std::vector<mx::array>& outputs) override;

 private:
  static TokenBitmaskProblem problem(const std::vector<mx::array>& inputs,
                                     const std::vector<mx::array>& outputs);
};

}  // namespace vllm_metal
