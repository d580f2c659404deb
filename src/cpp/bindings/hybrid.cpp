// Bindings of the hybrid-model ops (Qwen3-Next / Qwen3.5 linear attention and
// multimodal rope): causal_conv1d, gated_delta_rule, mrope and their planners.
// Thin: C++ functions bound by name, keyword arguments, a docstring each.
#include <nanobind/nanobind.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "bindings/bindings.h"
#include "bindings/common.h"
#include "mlx/array.h"
#include "ops/causal_conv1d.h"
#include "ops/gated_delta.h"
#include "ops/mrope.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;
namespace vm = vllm_metal;
using vllm_metal::bindings::parse_float_dtype;
using vllm_metal::bindings::StreamArg;
using vllm_metal::bindings::to_stream_or_device;

namespace {

constexpr const char* kConvDoc =
    "Depthwise causal conv1d + SiLU over packed variable-length rows with per-request state.\n\n"
    "x [T, C]; weight [C, K] (K in 2..8); bias [C] or None; conv_state [num_slots, C, K-1]\n"
    "(the last K-1 inputs per slot, oldest first), all one float dtype; cu_seqlens int32\n"
    "[N+1]; slots int32 [N] (distinct, in range); has_initial_state bool/int32 [N] or None\n"
    "(0: start from zeros). out[t] = silu(bias + sum_j weight[:, j] * in[t + j]) with in =\n"
    "concat(state, x rows of the sequence). Returns (out [T, C], new conv_state); the old\n"
    "state is copied first unless inplace=True (then its buffer is updated: rebind it).";

constexpr const char* kGdnDoc =
    "Gated delta rule (Qwen3-Next / Qwen3.5 linear attention) over packed rows.\n\n"
    "q, k [T, Hk, Dk]; v [T, Hv, Dv] (Hv a multiple of Hk, value head h reads key head\n"
    "h // (Hv // Hk)); a, b [T, Hv]; A_log, dt_bias [Hv]; state float32 [num_slots, Hv, Dv,\n"
    "Dk]; cu_seqlens, slots, has_initial_state as for causal_conv1d. q and k are\n"
    "L2-normalized (q also / sqrt(Dk)), g = exp(-exp(A_log) softplus(a + dt_bias)), beta =\n"
    "sigmoid(b); per token S = g S + beta (v - g S k) k^T, y = S q, all float32.\n"
    "method: 'recurrent', 'chunked' (WY form, chunk_size tokens; CPU) or 'auto'.\n"
    "Returns (y [T, Hv, Dv] in q's dtype, new state); the old state is copied first unless\n"
    "inplace=True (then its buffer is updated and the caller must rebind it).";

constexpr const char* kMropeDoc =
    "Multimodal rotary embedding (Qwen2-VL sectioned, Qwen3-VL / Qwen3.5 interleaved).\n\n"
    "x [T, H, D] float; positions int32/int64 [3, T] (temporal, height, width); sections\n"
    "(s0, s1, s2) with s0 + s1 + s2 = rotary_dim / 2 (default rotary_dim = D). NeoX pairs;\n"
    "pair i rotates by positions[axis(i)] * base^(-2i/rotary_dim); dimensions past\n"
    "rotary_dim are copied. Returns an array of x's shape and dtype.";

mx::Dtype parse_positions_dtype(const std::string& name) {
  if (name == "int32") return mx::int32;
  if (name == "int64") return mx::int64;
  throw std::invalid_argument("positions_dtype must be 'int32' or 'int64', got '" + name + "'");
}

}  // namespace

namespace vllm_metal::bindings {

void bind_hybrid(nb::module_& m) {
  m.def(
      "causal_conv1d",
      [](const mx::array& x, const mx::array& weight, const std::optional<mx::array>& bias,
         const mx::array& conv_state, const mx::array& cu_seqlens, const mx::array& slots,
         const std::optional<mx::array>& has_initial_state, bool silu, bool inplace,
         const StreamArg& s) {
        auto r = vm::causal_conv1d(x, weight, bias, conv_state, cu_seqlens, slots,
                                   has_initial_state, silu, inplace, to_stream_or_device(s));
        return nb::make_tuple(r[0], r[1]);
      },
      "x"_a, "weight"_a, "bias"_a.none(), nb::kw_only(), "conv_state"_a, "cu_seqlens"_a,
      "slots"_a, "has_initial_state"_a = nb::none(), "silu"_a = true, "inplace"_a = false,
      "stream"_a = nb::none(), kConvDoc);
  m.def(
      "gated_delta_rule",
      [](const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& a,
         const mx::array& b, const mx::array& A_log, const mx::array& dt_bias,
         const mx::array& state, const mx::array& cu_seqlens, const mx::array& slots,
         const std::optional<mx::array>& has_initial_state, const std::string& method,
         int64_t chunk_size, float eps, bool inplace, const StreamArg& s) {
        vm::GatedDeltaOptions o{method, chunk_size, eps, inplace};
        auto r = vm::gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, cu_seqlens, slots,
                                      has_initial_state, o, to_stream_or_device(s));
        return nb::make_tuple(r[0], r[1]);
      },
      "q"_a, "k"_a, "v"_a, "a"_a, "b"_a, "A_log"_a, "dt_bias"_a, nb::kw_only(), "state"_a,
      "cu_seqlens"_a, "slots"_a, "has_initial_state"_a = nb::none(), "method"_a = "auto",
      "chunk_size"_a = 64, "eps"_a = 1e-6f, "inplace"_a = false, "stream"_a = nb::none(),
      kGdnDoc);
  m.def(
      "mrope",
      [](const mx::array& x, const mx::array& positions, std::array<int64_t, 3> sections,
         bool interleaved, std::optional<int64_t> rotary_dim, double base, const StreamArg& s) {
        vm::MropeOptions o{sections, interleaved, rotary_dim, base};
        return vm::mrope(x, positions, o, to_stream_or_device(s));
      },
      "x"_a, "positions"_a, nb::kw_only(), "sections"_a, "interleaved"_a = false,
      "rotary_dim"_a = nb::none(), "base"_a = 10000.0, "stream"_a = nb::none(), kMropeDoc);
  m.def(
      "plan_gated_delta",
      [](const std::string& dtype, int64_t num_seqs, int64_t num_slots, int64_t hk, int64_t hv,
         int64_t dk, int64_t dv, bool copy_state) {
        vm::GatedDeltaProblem p;
        p.dtype = parse_float_dtype(dtype);
        p.num_seqs = num_seqs;
        p.num_slots = num_slots;
        p.hk = hk;
        p.hv = hv;
        p.dk = dk;
        p.dv = dv;
        p.copy_state = copy_state;
        return vm::plan_gated_delta(p);
      },
      "dtype"_a, "num_seqs"_a, "num_slots"_a, "hk"_a, "hv"_a, "dk"_a, "dv"_a,
      "copy_state"_a = false,
      "Kernel launches of gated_delta_rule. Slots: 0 q, 1 k, 2 v, 3 a, 4 b, 5 A_log (all\n"
      "float32 from a on), 6 dt_bias, 7 cu_seqlens, 8 slots, 9 has_initial_state (int32),\n"
      "10 state, 11 y, 12 new state.");
  m.def(
      "plan_causal_conv1d",
      [](const std::string& dtype, int64_t num_seqs, int64_t num_slots, int64_t channels,
         int64_t width, bool has_bias, bool silu, bool copy_state) {
        vm::CausalConv1dProblem p;
        p.dtype = parse_float_dtype(dtype);
        p.num_seqs = num_seqs;
        p.num_slots = num_slots;
        p.channels = channels;
        p.width = width;
        p.has_bias = has_bias;
        p.silu = silu;
        p.copy_state = copy_state;
        return vm::plan_causal_conv1d(p);
      },
      "dtype"_a, "num_seqs"_a, "num_slots"_a, "channels"_a, "width"_a, "has_bias"_a = true,
      "silu"_a = true, "copy_state"_a = false,
      "Kernel launches of causal_conv1d. Slots: 0 x, 1 bias, 2 weight, 3 cu_seqlens,\n"
      "4 slots, 5 has_initial_state, 6 conv_state, 7 out, 8 new conv_state.");
  m.def(
      "plan_mrope",
      [](const std::string& dtype, const std::string& positions_dtype, int64_t num_tokens,
         int64_t num_heads, int64_t head_size, std::array<int64_t, 3> sections,
         bool interleaved, std::optional<int64_t> rotary_dim) {
        vm::MropeProblem p;
        p.dtype = parse_float_dtype(dtype);
        p.positions_dtype = parse_positions_dtype(positions_dtype);
        p.tokens = num_tokens;
        p.heads = num_heads;
        p.head_size = head_size;
        p.rotary_dim = rotary_dim.value_or(head_size);
        p.sections = sections;
        p.interleaved = interleaved;
        return vm::plan_mrope(p);
      },
      "dtype"_a, "positions_dtype"_a, "num_tokens"_a, "num_heads"_a, "head_size"_a,
      nb::kw_only(), "sections"_a, "interleaved"_a = false, "rotary_dim"_a = nb::none(),
      "Kernel launches of mrope. Slots: 0 x, 1 positions [3, T], 2 table, 3 out.");
}

}  // namespace vllm_metal::bindings
