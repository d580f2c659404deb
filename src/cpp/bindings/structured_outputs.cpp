// Bindings of the structured-output ops (issue 21): apply_token_bitmask and its
// planner. Thin: C++ functions bound by name, keyword arguments, a docstring each.
#include <nanobind/nanobind.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "bindings/bindings.h"
#include "bindings/common.h"
#include "mlx/array.h"
#include "ops/apply_token_bitmask.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;
namespace vm = vllm_metal;
using vllm_metal::bindings::parse_float_dtype;
using vllm_metal::bindings::StreamArg;
using vllm_metal::bindings::to_stream_or_device;

namespace {

constexpr const char* kApplyDoc =
    "A grammar's token bitmask applied to logits (xgrammar's layout), out of place.\n\n"
    "logits [num_rows, vocab] float; bitmask int32 [num_masked, words] with words >=\n"
    "ceil(vocab / 32); rows int32 [num_masked]: bitmask row i applies to logits row rows[i]\n"
    "(in range, no row twice; rows not listed are unchanged). Token t is allowed iff bit\n"
    "t % 32 of word t // 32 is set; disallowed tokens become -inf (a mask allowing nothing\n"
    "makes its row all -inf). Bits past vocab are ignored. Returns logits' shape and dtype.";

}  // namespace

namespace vllm_metal::bindings {

void bind_structured_outputs(nb::module_& m) {
  m.def(
      "apply_token_bitmask",
      [](const mx::array& logits, const mx::array& bitmask, const mx::array& rows,
         const StreamArg& s) {
        return vm::apply_token_bitmask(logits, bitmask, rows, to_stream_or_device(s));
      },
      "logits"_a, "bitmask"_a, "rows"_a, nb::kw_only(), "stream"_a = nb::none(), kApplyDoc);
  m.def(
      "plan_apply_token_bitmask",
      [](const std::string& dtype, int64_t num_rows, int64_t vocab, int64_t mask_words,
         bool in_place) {
        vm::TokenBitmaskProblem p;
        p.dtype = parse_float_dtype(dtype);
        p.num_rows = num_rows;
        p.vocab = vocab;
        p.mask_words = mask_words;
        p.in_place = in_place;
        return vm::plan_apply_token_bitmask(p);
      },
      "dtype"_a, "num_rows"_a, "vocab"_a, "mask_words"_a, "in_place"_a = false,
      "Kernel launches of apply_token_bitmask. Slots: 0 logits, 1 bitmask, 2 mask_of_row\n"
      "(int32 [num_rows], -1: no mask), 3 out (logits itself when in_place).");
}

}  // namespace vllm_metal::bindings
