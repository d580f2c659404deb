#include "ops/apply_token_bitmask.h"

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "apply_token_bitmask_args.h"
#include "cpu/apply_token_bitmask.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/transforms.h"
#include "ops/dtype_names.h"
#include "ops/varlen.h"

namespace vllm_metal {

namespace {

constexpr const char* kOp = "apply_token_bitmask";

[[noreturn]] void fail(const std::string& msg) {
  throw std::invalid_argument(std::string("[") + kOp + "] " + msg);
}

mx::array dense(const mx::array& a, mx::StreamOrDevice s) {
  if (a.status() == mx::array::Status::available && a.flags().row_contiguous) return a;
  return mx::contiguous(a, false, s);
}

// rows (host metadata, evaluated here) checked and inverted:
// logits row -> bitmask row, -1 for rows without a mask.
std::vector<int32_t> mask_of_row(const mx::array& rows, int64_t num_rows,
                                 mx::StreamOrDevice s) {
  mx::array r = dense(rows, s);
  mx::eval(r);
  const int32_t* p = r.data<int32_t>();
  std::vector<int32_t> inverse(static_cast<size_t>(num_rows), -1);
  for (int64_t i = 0; i < static_cast<int64_t>(r.size()); ++i) {
    if (p[i] < 0 || p[i] >= num_rows) {
      fail("rows[" + std::to_string(i) + "] = " + std::to_string(p[i]) +
           " is out of range for logits of " + std::to_string(num_rows) + " rows");
    }
    if (inverse[p[i]] >= 0) {
      fail("row " + std::to_string(p[i]) + " is listed twice (rows[" +
           std::to_string(inverse[p[i]]) + "] and rows[" + std::to_string(i) + "])");
    }
    inverse[p[i]] = static_cast<int32_t>(i);
  }
  return inverse;
}

}  // namespace

mx::array apply_token_bitmask(const mx::array& logits, const mx::array& bitmask,
                              const mx::array& rows, mx::StreamOrDevice s) {
  check_float_dtype(kOp, "logits", logits.dtype());
  if (logits.ndim() != 2) {
    fail("logits must be [num_rows, vocab], got " + shape_string(logits.shape()));
  }
  if (bitmask.dtype() != mx::int32) {
    fail("bitmask must be int32, got " + dtype_name(bitmask.dtype()));
  }
  if (bitmask.ndim() != 2) {
    fail("bitmask must be [num_masked, words], got " + shape_string(bitmask.shape()));
  }
  if (rows.dtype() != mx::int32) fail("rows must be int32, got " + dtype_name(rows.dtype()));
  const int num_masked = bitmask.shape(0);
  if (rows.ndim() != 1 || rows.shape(0) != num_masked) {
    fail("rows must be [" + std::to_string(num_masked) +
         "] (one logits row per bitmask row), got " + shape_string(rows.shape()));
  }
  const int64_t num_rows = logits.shape(0);
  const int64_t vocab = logits.shape(1);
  const int64_t words = bitmask.shape(1);
  if (words * 32 < vocab) {
    fail("bitmask rows of " + std::to_string(words) + " words cover " +
         std::to_string(words * 32) + " tokens, fewer than the vocab of " +
         std::to_string(vocab) + " (needs ceil(" + std::to_string(vocab) +
         " / 32) = " + std::to_string((vocab + 31) / 32) + " words)");
  }
  const std::vector<int32_t> inverse = mask_of_row(rows, num_rows, s);
  if (num_masked == 0 || vocab == 0) {
    return logits;  // nothing is masked: arrays are immutable, no copy needed
  }
  return mx::array(
      logits.shape(), logits.dtype(),
      std::make_shared<ApplyTokenBitmask>(mx::to_stream(s), default_kernel_backend()),
      {dense(logits, s), dense(bitmask, s),
       mx::array(inverse.begin(), {static_cast<int>(num_rows)}, mx::int32)});
}

std::string token_bitmask_kernel_name(mx::Dtype dtype) {
  return "apply_token_bitmask_" + dtype_name(dtype);
}

uint32_t token_bitmask_simdgroups(int64_t vocab) {
  // 8 simdgroups (256 threads, 8192 tokens) unless the row is shorter
  const int64_t spans = (vocab + 1023) / 1024;
  return static_cast<uint32_t>(std::clamp<int64_t>(spans, 1, 8));
}

KernelPlan plan_apply_token_bitmask(const TokenBitmaskProblem& p) {
  KernelLaunch l;
  l.source = "apply_token_bitmask";
  l.kernel = token_bitmask_kernel_name(p.dtype);
  TokenBitmaskArgs args{};
  args.logits_row_stride = p.vocab;
  args.out_row_stride = p.vocab;
  args.mask_row_stride = p.mask_words;
  args.vocab = static_cast<uint32_t>(p.vocab);
  args.in_place = p.in_place ? 1u : 0u;
  const uint32_t sgs = token_bitmask_simdgroups(p.vocab);
  const uint64_t spans = (p.vocab + 1023) / 1024;
  l.grid = {ceil_div(spans, sgs), static_cast<uint32_t>(p.num_rows), 1};
  l.threadgroup = {32 * sgs, 1, 1};
  for (int i = 0; i < 4; ++i) l.bind(i, i);
  l.set_args(4, args);
  return {l};
}

TokenBitmaskProblem ApplyTokenBitmask::problem(const std::vector<mx::array>& inputs,
                                               const std::vector<mx::array>& outputs) {
  TokenBitmaskProblem p;
  p.dtype = inputs[0].dtype();
  p.num_rows = inputs[0].shape(0);
  p.vocab = inputs[0].shape(1);
  p.mask_words = inputs[1].shape(1);
  p.in_place = outputs[0].data<char>() == inputs[0].data<char>();
  return p;
}

void ApplyTokenBitmask::allocate_outputs(const std::vector<mx::array>& inputs,
                                         std::vector<mx::array>& outputs) {
  // each value is read (if at all) and written by one thread: masking in place is safe
  if (inputs[0].flags().row_contiguous && inputs[0].is_donatable()) {
    outputs[0].copy_shared_buffer(inputs[0]);
  } else {
    outputs[0].set_data(mx::allocator::malloc(outputs[0].nbytes()));
  }
}

KernelPlan ApplyTokenBitmask::plan(const std::vector<mx::array>& inputs,
                                   const std::vector<mx::array>& outputs) const {
  return plan_apply_token_bitmask(problem(inputs, outputs));
}

bool ApplyTokenBitmask::is_equivalent(const mx::Primitive& other) const {
  return backend() == static_cast<const ApplyTokenBitmask&>(other).backend();
}

void ApplyTokenBitmask::eval_native_cpu(const std::vector<mx::array>& inputs,
                                        std::vector<mx::array>& outputs) {
  const TokenBitmaskProblem p = problem(inputs, outputs);
  cpu::TokenBitmaskRows rows;
  rows.elt = elt_of(p.dtype);
  rows.num_rows = p.num_rows;
  rows.vocab = p.vocab;
  rows.mask_words = p.mask_words;
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  for (auto& a : outputs) encoder.set_output_array(a);
  encoder.dispatch([rows, inputs, outputs]() mutable {
    rows.logits = inputs[0].data<void>();
    rows.bitmask = inputs[1].data<uint32_t>();
    rows.mask_of_row = inputs[2].data<int32_t>();
    rows.out = outputs[0].data<void>();
    cpu::apply_token_bitmask_rows(rows);
  });
}

}  // namespace vllm_metal
