// Bindings of the encoder-model ops: varlen_attention, gelu and their planners.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "bindings/bindings.h"
#include "bindings/common.h"
#include "mlx/array.h"
#include "ops/gelu.h"
#include "ops/layer_norm.h"
#include "ops/varlen_attention.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;
namespace vm = vllm_metal;
using vllm_metal::bindings::parse_float_dtype;
using vllm_metal::bindings::StreamArg;
using vllm_metal::bindings::to_stream_or_device;

namespace {

constexpr const char* kVarlenAttentionDoc =
    "Attention within each sequence of a packed variable-length batch (encoders).\n\n"
    "q [T, Hq, D]; k, v [T, Hkv, D] (q's float dtype, Hq a multiple of Hkv, D <= 256);\n"
    "cu_seqlens int32 [N+1] (rows [cu[n], cu[n+1]) are sequence n). Row i attends to every\n"
    "row of its sequence (causal=False) or to rows up to itself (causal=True); window > 0\n"
    "keeps only rows j with |i - j| < window (sliding layers). Softmax of\n"
    "scale * q.k in float32. Returns [T, Hq, D] in q's dtype.";

constexpr const char* kGeluDoc =
    "GELU element by element on a float array: x * Phi(x) (erf form, BERT's 'gelu'), or\n"
    "with approximate=True the tanh form ('gelu_new'). float32 arithmetic; Phi from\n"
    "Abramowitz & Stegun 7.1.26 (|erf error| <= 1.5e-7). Returns x's shape and dtype.";

constexpr const char* kLayerNormDoc =
    "LayerNorm over the last axis, optionally of a residual sum (post-LN blocks):\n"
    "h = x (+ residual, rounded to x's dtype); returns (h - mean) / sqrt(var + eps) * weight\n"
    "+ bias in x's dtype. weight, bias [hidden]; all arrays share one float dtype; float32\n"
    "arithmetic.";

}  // namespace

namespace vllm_metal::bindings {

void bind_encoder(nb::module_& m) {
  m.def(
      "varlen_attention",
      [](const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& cu_seqlens,
         float scale, bool causal, int64_t window, const StreamArg& s) {
        return vm::varlen_attention(q, k, v, cu_seqlens, scale, causal, window,
                                    to_stream_or_device(s));
      },
      "q"_a, "k"_a, "v"_a, nb::kw_only(), "cu_seqlens"_a, "scale"_a, "causal"_a = false,
      "window"_a = 0, "stream"_a = nb::none(), kVarlenAttentionDoc);
  m.def(
      "plan_varlen_attention",
      [](const std::string& dtype, int64_t num_tokens, int64_t num_seqs, int64_t num_q_heads,
         int64_t num_kv_heads, int64_t head_size, float scale, bool causal, int64_t window,
         int64_t max_seq_len) {
        vm::VarlenAttentionProblem p;
        p.dtype = parse_float_dtype(dtype);
        p.num_tokens = num_tokens;
        p.num_seqs = num_seqs;
        p.num_q_heads = num_q_heads;
        p.num_kv_heads = num_kv_heads;
        p.head_size = head_size;
        p.scale = scale;
        p.causal = causal;
        p.window = window;
        p.max_seq_len = max_seq_len;
        return vm::plan_varlen_attention(p);
      },
      "dtype"_a, "num_tokens"_a, "num_seqs"_a, "num_q_heads"_a, "num_kv_heads"_a, "head_size"_a,
      "scale"_a, "causal"_a = false, "window"_a = 0, "max_seq_len"_a = 0,
      "Kernel launches of varlen_attention. Slots: 0 q, 1 k, 2 v, 3 cu_seqlens, 4 out.\n"
      "max_seq_len: the longest sequence (the tiled kernel's grid); 0: num_tokens.");
  m.def("varlen_attention_tiled_head_sizes", &vm::tiled_head_sizes,
        "Head sizes whose Metal varlen_attention is the tiled kernel.");
  m.def(
      "gelu",
      [](const mx::array& x, bool approximate, const StreamArg& s) {
        return vm::gelu(x, approximate, to_stream_or_device(s));
      },
      "x"_a, nb::kw_only(), "approximate"_a = false, "stream"_a = nb::none(), kGeluDoc);
  m.def(
      "layer_norm",
      [](const mx::array& x, const mx::array& weight, const mx::array& bias, float eps,
         const std::optional<mx::array>& residual, const StreamArg& s) {
        return vm::layer_norm(x, weight, bias, eps, residual, to_stream_or_device(s));
      },
      "x"_a, "weight"_a, "bias"_a, nb::kw_only(), "eps"_a, "residual"_a = nb::none(),
      "stream"_a = nb::none(), kLayerNormDoc);
  m.def(
      "plan_layer_norm",
      [](const std::string& dtype, int64_t rows, int64_t hidden, float eps, bool residual) {
        return vm::plan_layer_norm(parse_float_dtype(dtype), rows, hidden, eps, residual);
      },
      "dtype"_a, "rows"_a, "hidden"_a, "eps"_a, "residual"_a = false,
      "Kernel launches of layer_norm. Slots: 0 x, 1 weight, 2 bias, 3 out; with residual: "
      "0 x, 1 residual, 2 weight, 3 bias, 4 out.");
  m.def(
      "plan_gelu",
      [](const std::string& dtype, int64_t count, bool approximate) {
        return vm::plan_gelu(parse_float_dtype(dtype), count, approximate);
      },
      "dtype"_a, "count"_a, "approximate"_a = false,
      "Kernel launches of gelu. Slots: 0 x, 1 out.");
}

}  // namespace vllm_metal::bindings
