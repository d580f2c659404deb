// Bindings of the LoRA op: lora_apply and its planner. Thin: keyword
// arguments, a docstring, no logic.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "bindings/bindings.h"
#include "bindings/common.h"
#include "mlx/array.h"
#include "ops/lora.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;
namespace vm = vllm_metal;
using vllm_metal::bindings::parse_float_dtype;
using vllm_metal::bindings::StreamArg;
using vllm_metal::bindings::to_stream_or_device;

namespace {

constexpr const char* kDoc =
    "Per-row LoRA delta added to a base linear's output (Punica BGMV style).\n\n"
    "y [T, out] (the base output), x [T, in] (its input), lora_a [S, R, in], lora_b\n"
    "[S, out, R], all one float dtype; scale float32 [S]; row_slot int32 [T] (-1: no\n"
    "adapter). out[t] = y[t] + B[s] @ (scale[s] * A[s] @ x[t]) with s = row_slot[t],\n"
    "float32 arithmetic, one rounding per output. Returns y itself when no row has a slot.";

}  // namespace

namespace vllm_metal::bindings {

void bind_lora(nb::module_& m) {
  m.def(
      "lora_apply",
      [](const mx::array& y, const mx::array& x, const mx::array& lora_a,
         const mx::array& lora_b, const mx::array& scale, const mx::array& row_slot,
         const StreamArg& s) {
        return vm::lora_apply(y, x, lora_a, lora_b, scale, row_slot, to_stream_or_device(s));
      },
      "y"_a, "x"_a, nb::kw_only(), "lora_a"_a, "lora_b"_a, "scale"_a, "row_slot"_a,
      "stream"_a = nb::none(), kDoc);
  m.def(
      "plan_lora_apply",
      [](const std::string& dtype, int64_t rows, int64_t in_dim, int64_t out_dim, int64_t rank,
         int64_t num_slots) {
        vm::LoraApplyProblem p;
        p.dtype = parse_float_dtype(dtype);
        p.rows = rows;
        p.in_dim = in_dim;
        p.out_dim = out_dim;
        p.rank = rank;
        p.num_slots = num_slots;
        return vm::plan_lora_apply(p);
      },
      "dtype"_a, "rows"_a, "in_dim"_a, "out_dim"_a, "rank"_a, "num_slots"_a,
      "Kernel launches of lora_apply. Slots: 0 y, 1 x, 2 lora_a, 3 lora_b, 4 scale,\n"
      "5 row_slot, 6 out.");
}

}  // namespace vllm_metal::bindings
