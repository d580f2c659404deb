// Binding of the fused mixture-of-experts op and its planner. Thin: C++
// functions bound by name, keyword arguments, a docstring each.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "bindings/bindings.h"
#include "bindings/common.h"
#include "mlx/array.h"
#include "ops/moe.h"
#include "ops/moe_gguf.h"
#include "runtime/gguf_types.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;
namespace vm = vllm_metal;
using vllm_metal::bindings::parse_float_dtype;
using vllm_metal::bindings::StreamArg;
using vllm_metal::bindings::to_stream_or_device;

namespace {

constexpr const char* kMoeDoc =
    "Sparse mixture-of-experts SwiGLU MLP with routing, tokens grouped by expert.\n\n"
    "hidden [T, H] float; router_logits [T, E] float; w_gate, w_up [E, I, H] and w_down\n"
    "[E, H, I], one float dtype. Experts: the top_k largest logits (ties to the lower id);\n"
    "p = softmax(logits) over E (scoring='softmax') or sigmoid(logits) ('sigmoid'), the k\n"
    "chosen p divided by their sum when renormalize. out[t] = sum_j p_j W_down[e_j]\n"
    "(silu(W_gate[e_j] x_t) * W_up[e_j] x_t), float32 arithmetic, hidden's dtype.\n\n"
    "gpt-oss: scoring='softmax_topk' (softmax over the k chosen logits); b_gate, b_up\n"
    "[E, I] and b_down [E, H] biases (all or none); activation='swiglu_oai':\n"
    "g = min(gate, 7), u = clamp(up, -7, 7), act = (u + 1) * g * sigmoid(1.702 g).";

constexpr const char* kMoeGgufDoc =
    "fused_moe with the expert weights in GGUF block form (llama.cpp's ffn_*_exps).\n\n"
    "gate, up: uint8 bytes of [E, I, H] tensors; down: of [E, H, I]; each with its GGML\n"
    "type (name or id, any type gguf_matmul takes); inter = I. Routing as fused_moe.\n"
    "exact=False: the CPU rounds activations to 8-bit blocks for the integer-capable\n"
    "types (gguf_matmul's scheme); exact=True: float32 sums. Metal always sums in float.\n"
    "scoring, activation and the biases as fused_moe (gpt-oss).";

namespace gg = vllm_metal::gguf;
using TypeArg = std::variant<int, std::string>;

gg::GGMLType parse_type(const TypeArg& t) {
  if (std::holds_alternative<int>(t)) {
    const int id = std::get<int>(t);
    if (id < 0 || !gg::type_info(static_cast<uint32_t>(id)).name) {
      throw std::invalid_argument("unknown GGML type id " + std::to_string(id));
    }
    return static_cast<gg::GGMLType>(id);
  }
  gg::GGMLType out;
  if (!gg::parse_type_name(std::get<std::string>(t), &out)) {
    throw std::invalid_argument("unknown GGML type '" + std::get<std::string>(t) + "'");
  }
  return out;
}

}  // namespace

namespace vllm_metal::bindings {

void bind_moe(nb::module_& m) {
  m.def(
      "fused_moe",
      [](const mx::array& hidden, const mx::array& router_logits, const mx::array& w_gate,
         const mx::array& w_up, const mx::array& w_down, int top_k, bool renormalize,
         const std::string& scoring, const std::string& activation,
         const std::optional<mx::array>& b_gate, const std::optional<mx::array>& b_up,
         const std::optional<mx::array>& b_down, const StreamArg& s) {
        return vm::fused_moe(hidden, router_logits, w_gate, w_up, w_down, top_k, renormalize,
                             scoring, vm::MoeOptions{activation, b_gate, b_up, b_down},
                             to_stream_or_device(s));
      },
      "hidden"_a, "router_logits"_a, "w_gate"_a, "w_up"_a, "w_down"_a, nb::kw_only(),
      "top_k"_a, "renormalize"_a = true, "scoring"_a = "softmax", "activation"_a = "silu",
      "b_gate"_a = nb::none(), "b_up"_a = nb::none(), "b_down"_a = nb::none(),
      "stream"_a = nb::none(), kMoeDoc);
  m.def(
      "plan_fused_moe",
      [](const std::string& dtype, const std::string& w_dtype, int64_t num_tokens,
         int64_t hidden, int64_t num_experts, int64_t inter, int64_t top_k, bool renormalize,
         bool sigmoid, bool topk_softmax, bool oai_act, bool bias) {
        vm::MoeProblem p;
        p.dtype = parse_float_dtype(dtype);
        p.w_dtype = parse_float_dtype(w_dtype);
        p.num_tokens = num_tokens;
        p.hidden = hidden;
        p.num_experts = num_experts;
        p.inter = inter;
        p.top_k = top_k;
        p.renormalize = renormalize;
        p.sigmoid = sigmoid;
        p.topk_softmax = topk_softmax;
        p.oai_act = oai_act;
        p.bias = bias;
        return vm::plan_fused_moe(p);
      },
      "dtype"_a, "w_dtype"_a, "num_tokens"_a, "hidden"_a, "num_experts"_a, "inter"_a,
      "top_k"_a, "renormalize"_a = true, "sigmoid"_a = false, "topk_softmax"_a = false,
      "oai_act"_a = false, "bias"_a = false,
      "Kernel launches of fused_moe (slots: see ops/moe.h).");
  m.def(
      "fused_moe_gguf",
      [](const mx::array& hidden, const mx::array& router_logits, const mx::array& gate,
         const TypeArg& gate_type, const mx::array& up, const TypeArg& up_type,
         const mx::array& down, const TypeArg& down_type, int inter, int top_k,
         bool renormalize, const std::string& scoring, bool exact, const std::string& activation,
         const std::optional<mx::array>& b_gate, const std::optional<mx::array>& b_up,
         const std::optional<mx::array>& b_down, const StreamArg& s) {
        vm::MoeGgufWeights w{gate, up, down, parse_type(gate_type), parse_type(up_type),
                             parse_type(down_type), inter};
        return vm::fused_moe_gguf(hidden, router_logits, w, top_k, renormalize, scoring, exact,
                                  vm::MoeOptions{activation, b_gate, b_up, b_down},
                                  to_stream_or_device(s));
      },
      "hidden"_a, "router_logits"_a, "gate"_a, "gate_type"_a, "up"_a, "up_type"_a, "down"_a,
      "down_type"_a, nb::kw_only(), "inter"_a, "top_k"_a, "renormalize"_a = true,
      "scoring"_a = "softmax", "exact"_a = false, "activation"_a = "silu",
      "b_gate"_a = nb::none(), "b_up"_a = nb::none(), "b_down"_a = nb::none(),
      "stream"_a = nb::none(), kMoeGgufDoc);
  m.def(
      "plan_fused_moe_gguf",
      [](const std::string& dtype, const TypeArg& gate_type, const TypeArg& up_type,
         const TypeArg& down_type, int64_t num_tokens, int64_t hidden, int64_t num_experts,
         int64_t inter, int64_t top_k, bool renormalize, bool sigmoid, bool topk_softmax,
         bool oai_act, bool bias) {
        vm::MoeGgufProblem p;
        p.dtype = parse_float_dtype(dtype);
        p.gate_type = parse_type(gate_type);
        p.up_type = parse_type(up_type);
        p.down_type = parse_type(down_type);
        p.num_tokens = num_tokens;
        p.hidden = hidden;
        p.num_experts = num_experts;
        p.inter = inter;
        p.top_k = top_k;
        p.renormalize = renormalize;
        p.sigmoid = sigmoid;
        p.topk_softmax = topk_softmax;
        p.oai_act = oai_act;
        p.bias = bias;
        return vm::plan_fused_moe_gguf(p);
      },
      "dtype"_a, "gate_type"_a, "up_type"_a, "down_type"_a, "num_tokens"_a, "hidden"_a,
      "num_experts"_a, "inter"_a, "top_k"_a, "renormalize"_a = true, "sigmoid"_a = false,
      "topk_softmax"_a = false, "oai_act"_a = false, "bias"_a = false,
      "Kernel launches of fused_moe_gguf.");
}

}  // namespace vllm_metal::bindings
