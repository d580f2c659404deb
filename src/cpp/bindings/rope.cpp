// Bindings of rope, its frequency tables and its planner. Thin: C++ functions
// bound by name, keyword arguments, a docstring each.
#include <nanobind/nanobind.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>

#include "bindings/bindings.h"
#include "bindings/common.h"
#include "mlx/array.h"
#include "mlx/utils.h"
#include "ops/rope.h"
#include "ops/rope_scaling.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;
namespace vm = vllm_metal;
using vllm_metal::bindings::parse_float_dtype;
using vllm_metal::bindings::StreamArg;
using vllm_metal::bindings::to_stream_or_device;

namespace {



mx::Dtype parse_dtype(const std::string& name) {
  if (name == "float32") return mx::float32;
  if (name == "float16") return mx::float16;
  if (name == "bfloat16") return mx::bfloat16;
  if (name == "int32") return mx::int32;
  if (name == "int64") return mx::int64;
  throw std::invalid_argument("unknown dtype '" + name + "'");
}

vm::RopeScaling scaling_of(const std::optional<vm::RopeScalingConfig>& scaling) {
  return scaling ? vm::parse_rope_scaling(*scaling) : vm::RopeScaling{};
}

constexpr const char* kRopeDoc =
    "Rotary position embedding of packed rows, one position per token.\n\n"
    "x: [num_tokens, num_heads, head_size] float32/float16/bfloat16, any strides\n"
    "(views are read in place); positions: int32 or int64 [num_tokens].\n"
    "Rotates the first rotary_dim (default head_size, even) dimensions of each head\n"
    "in pairs (i, i + rotary_dim/2) if is_neox else (2i, 2i + 1), by\n"
    "positions * inv_freq with inv_freq from base and scaling, an HF rope_scaling\n"
    "dict: {'rope_type': 'default' | 'linear' | 'llama3' | 'yarn', ...}. Returns\n"
    "an array of x's shape and dtype; cos/sin and the rotation are float32.";

}  // namespace

namespace vllm_metal::bindings {

void bind_rope(nb::module_& m) {
  m.def(
      "rope",
      [](const mx::array& x, const mx::array& positions, std::optional<int64_t> rotary_dim,
         bool is_neox, double base, const std::optional<vm::RopeScalingConfig>& scaling,
         const StreamArg& s) {
        vm::RopeOptions o;
        o.rotary_dim = rotary_dim;
        o.is_neox = is_neox;
        o.base = base;
        o.scaling = scaling_of(scaling);
        return vm::rope(x, positions, o, to_stream_or_device(s));
      },
      "x"_a, "positions"_a, nb::kw_only(), "rotary_dim"_a = nb::none(), "is_neox"_a = true,
      "base"_a = 10000.0, "scaling"_a = nb::none(), "stream"_a = nb::none(), kRopeDoc);
  m.def(
      "rope_inv_freq",
      [](int64_t rotary_dim, double base, const std::optional<vm::RopeScalingConfig>& scaling) {
        auto f = vm::rope_frequencies(rotary_dim, base, scaling_of(scaling));
        return nb::make_tuple(f.inv_freq, f.mscale);
      },
      "rotary_dim"_a, nb::kw_only(), "base"_a = 10000.0, "scaling"_a = nb::none(),
      "(inv_freq [rotary_dim / 2] as floats in radians per position, mscale) of a rope,\n"
      "computed in double precision on the host.");
  m.def(
      "plan_rope",
      [](const std::string& dtype, const std::string& positions_dtype, int64_t num_tokens,
         int64_t num_heads, int64_t head_size, std::optional<int64_t> rotary_dim, bool is_neox,
         std::optional<std::array<int64_t, 3>> x_strides, float mscale) {
        vm::RopeProblem p;
        p.dtype = parse_dtype(dtype);
        p.positions_dtype = parse_dtype(positions_dtype);
        p.tokens = num_tokens;
        p.heads = num_heads;
        p.head_size = head_size;
        p.rotary_dim = rotary_dim.value_or(head_size);
        auto st =
            x_strides.value_or(std::array<int64_t, 3>{num_heads * head_size, head_size, 1});
        p.x_token_stride = st[0];
        p.x_head_stride = st[1];
        p.x_dim_stride = st[2];
        p.neox = is_neox;
        p.mscale = mscale;
        return vm::plan_rope(p);
      },
      "dtype"_a, "positions_dtype"_a, "num_tokens"_a, "num_heads"_a, "head_size"_a,
      nb::kw_only(), "rotary_dim"_a = nb::none(), "is_neox"_a = true,
      "x_strides"_a = nb::none(), "mscale"_a = 1.0f,
      "Kernel launches of rope; x_strides = (token, head, dim) in elements, default dense.\n"
      "Slots: 0 x, 1 positions, 2 table (uint32 [2, rotary_dim / 2]), 3 out.");
  m.def(
      "rope_turn_table",
      [](int64_t rotary_dim, double base, const std::optional<vm::RopeScalingConfig>& scaling) {
        auto t = vm::rope_table(rotary_dim, base, scaling_of(scaling));
        return nb::make_tuple(t.table, t.mscale);
      },
      "rotary_dim"_a, nb::kw_only(), "base"_a = 10000.0, "scaling"_a = nb::none(),
      "(table, mscale): the kernels' uint32 [2, rotary_dim / 2] turn table (low words,\n"
      "then high words of each pair's turns per position in 2^-64 units).");
}

}  // namespace vllm_metal::bindings
