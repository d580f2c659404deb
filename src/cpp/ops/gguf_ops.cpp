#include "ops/gguf_ops.h"

#include <algorithm>
#include <stdexcept>

#include "cpu/batch_invariant.h"
#include "cpu/gguf_matmul.h"
#include "cpu/gguf_quants.h"
#include "gguf_dequantize_args.h"
#include "gguf_matmul_args.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "ops/dtype_names.h"
#include "ops/gelu.h"

namespace vllm_metal {

namespace {

using gguf::GGMLType;

std::string shape_str(const mx::Shape& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

[[noreturn]] void fail(const char* op, const std::string& what) {
  throw std::invalid_argument(std::string("[") + op + "] " + what);
}

// Validates blocks against (type, shape); returns the bytes of one row.
int64_t check_blocks(const char* op, const mx::array& blocks, GGMLType type,
                     const mx::Shape& shape) {
  check_gguf_type(op, type);
  if (blocks.dtype() != mx::uint8) {
    fail(op, "blocks must be uint8 (the tensor's raw bytes), got " + dtype_name(blocks.dtype()));
  }
  if (shape.empty()) fail(op, "shape must have at least 1 dimension");
  for (int d : shape) {
    if (d < 0) fail(op, "shape " + shape_str(shape) + " has a negative dimension");
  }
  gguf::TypeInfo ti = gguf::type_info(type);
  int64_t cols = shape.back();
  if (cols % ti.block_size != 0) {
    fail(op, "the last dimension of shape " + shape_str(shape) + " must be a multiple of the " +
                 ti.name + " block size " + std::to_string(ti.block_size));
  }
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
  int64_t rb = gguf::row_bytes(type, cols);
  int64_t expect = rows * rb;
  if (static_cast<int64_t>(blocks.size()) != expect) {
    fail(op, "blocks must hold " + std::to_string(expect) + " bytes for " + ti.name + " shape " +
                 shape_str(shape) + ", got " + std::to_string(blocks.size()));
  }
  return rb;
}

// Any shape works (kernels see bytes): only row-major density is needed.
mx::array flat_bytes(const mx::array& blocks, mx::StreamOrDevice s) {
  return mx::contiguous(blocks, false, s);
}

}  // namespace

void check_gguf_type(const char* op, GGMLType type) {
  gguf::TypeInfo ti = gguf::type_info(type);
  if (!ti.name || !ti.supported) {
    fail(op, "type " + gguf::type_name(static_cast<uint32_t>(type)) +
                 " is not supported (supported: " + gguf::supported_type_names() + ")");
  }
}

mx::array gguf_dequantize(const mx::array& blocks, GGMLType type, const mx::Shape& shape,
                          mx::Dtype out_dtype, mx::StreamOrDevice s) {
  const char* op = "gguf_dequantize";
  check_blocks(op, blocks, type, shape);
  check_float_dtype(op, "out_dtype", out_dtype);
  int64_t cols = shape.back();
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
  if (rows * cols == 0) return mx::zeros(shape, out_dtype, s);
  auto stream = mx::to_stream(s);
  return mx::array(shape, out_dtype,
                   std::make_shared<GgufDequantize>(stream, default_kernel_backend(), type, rows,
                                                    cols),
                   {flat_bytes(blocks, s)});
}

cpu::GgufActivation parse_gguf_activation(const std::string& name) {
  if (name == "none") return cpu::GgufActivation::kNone;
  if (name == "gelu") return cpu::GgufActivation::kGelu;
  if (name == "gelu_tanh") return cpu::GgufActivation::kGeluTanh;
  fail("gguf_matmul", "activation must be 'none', 'gelu' or 'gelu_tanh', got '" + name + "'");
}

mx::array gguf_matmul(const mx::array& x, const mx::array& blocks, GGMLType type,
                      const mx::Shape& shape, bool exact, const std::optional<mx::array>& bias,
                      cpu::GgufActivation activation, mx::StreamOrDevice s) {
  const char* op = "gguf_matmul";
  check_float_dtype(op, "x", x.dtype());
  if (shape.size() != 2) fail(op, "shape must be [N, K], got " + shape_str(shape));
  check_blocks(op, blocks, type, shape);
  if (x.ndim() < 1 || x.shape(-1) != shape[1]) {
    fail(op, "x must have K = " + std::to_string(shape[1]) + " on its last axis, got shape " +
                 shape_str(x.shape()));
  }
  if (bias) {
    if (bias->dtype() != x.dtype()) {
      fail(op, "bias must have x's dtype " + dtype_name(x.dtype()) + ", got " +
                   dtype_name(bias->dtype()));
    }
    if (bias->ndim() != 1 || bias->shape(0) != shape[0]) {
      fail(op, "bias must have shape [N] = [" + std::to_string(shape[0]) + "], got " +
                   shape_str(bias->shape()));
    }
  }
  mx::Shape out_shape = x.shape();
  out_shape.back() = shape[0];
  if (shape[0] == 0 || (x.size() == 0 && shape[1] != 0)) {
    return mx::zeros(out_shape, x.dtype(), s);
  }
  if (shape[1] == 0) {  // no sums: the epilogue of zeros
    mx::array y = mx::zeros(out_shape, x.dtype(), s);
    if (bias) y = mx::add(y, *bias, s);
    if (activation == cpu::GgufActivation::kNone) return y;
    return gelu(y, activation == cpu::GgufActivation::kGeluTanh, s);
  }
  auto stream = mx::to_stream(s);
  std::vector<mx::array> inputs = {mx::contiguous(x, false, s), flat_bytes(blocks, s)};
  if (bias) inputs.push_back(mx::contiguous(*bias, false, s));
  return mx::array(out_shape, x.dtype(),
                   std::make_shared<GgufMatmul>(stream, default_kernel_backend(), type, shape[0],
                                                shape[1], exact, bias.has_value(), activation),
                   std::move(inputs));
}

// ---- planners ----------------------------------------------------------------------

std::string gguf_dequantize_kernel_name(GGMLType type, mx::Dtype dtype) {
  return "gguf_dequantize_" + gguf::type_kernel_name(type) + "_" + dtype_name(dtype);
}

std::string gguf_matmul_kernel_name(GGMLType type, mx::Dtype dtype, bool matvec) {
  return std::string(matvec ? "gguf_matvec_" : "gguf_matmul_") + gguf::type_kernel_name(type) +
      "_" + dtype_name(dtype);
}

KernelPlan plan_gguf_dequantize(const GgufDequantizeProblem& p) {
  KernelLaunch l;
  l.source = "gguf_dequantize";
  l.kernel = gguf_dequantize_kernel_name(p.type, p.dtype);
  GgufDequantizeArgs args{};
  args.rows = static_cast<uint64_t>(p.rows);
  args.row_bytes = static_cast<uint64_t>(gguf::row_bytes(p.type, p.cols));
  args.cols = static_cast<uint32_t>(p.cols);
  args.chunks = ceil_div(p.cols, 16);
  const uint32_t threads = 256;
  l.grid = {ceil_div(uint64_t(p.rows) * args.chunks, threads), 1, 1};
  l.threadgroup = {threads, 1, 1};
  l.bind(0, 0);  // blocks
  l.bind(1, 1);  // out
  l.set_args(2, args);
  return {l};
}

namespace {

// Lanes per row for rows of `pieces` pieces: the largest power of two <= 32 dividing it.
GgufMatvecShape matvec_shape(int64_t pieces, uint32_t piece) {
  GgufMatvecShape s;
  s.piece = piece;
  s.lanes_per_row = 1;
  while (s.lanes_per_row < 32 && pieces % (2 * s.lanes_per_row) == 0) s.lanes_per_row *= 2;
  // 8 rows per simdgroup where the lanes allow (x reused for 8 / groups rows); at most 4
  // rows per lane (registers: a piece's decoded weights and 8 sums per row)
  const uint32_t groups = 32 / s.lanes_per_row;
  s.rows_per_lane = std::clamp<uint32_t>(8 / groups, 1, 4);
  return s;
}

}  // namespace

GgufMatvecShape gguf_matvec_shape(int64_t k) {
  // 16-weight pieces, or 8 where twice the pieces give a lane more rows to reuse x for
  // (k = 576: 36 chunks -> 4 lanes x 1 row; 72 halves -> 8 lanes x 2 rows)
  GgufMatvecShape s16 = matvec_shape(ceil_div(k, 16), 16);
  GgufMatvecShape s8 = matvec_shape(ceil_div(k, 8), 8);
  return s8.rows_per_lane > s16.rows_per_lane ? s8 : s16;
}

KernelPlan plan_gguf_matmul(const GgufMatmulProblem& p) {
  // Batch-invariant mode: the mat-vec kernel for every m (one summation order per row;
  // the tile kernel's simdgroup-matrix order differs), in groups of 8 rows along grid y.
  const bool matvec = p.m <= kGgufMetalMatvecMaxRows || cpu::batch_invariant();
  KernelLaunch l;
  l.source = "gguf_matmul";
  l.kernel = gguf_matmul_kernel_name(p.type, p.dtype, matvec);
  GgufMatmulArgs args{};
  args.x_row_stride = p.k;
  args.y_row_stride = p.n;
  args.w_row_bytes = static_cast<uint64_t>(gguf::row_bytes(p.type, p.k));
  args.m = static_cast<uint32_t>(p.m);
  args.n = static_cast<uint32_t>(p.n);
  args.k = static_cast<uint32_t>(p.k);
  args.chunks = ceil_div(p.k, 16);
  args.epilogue = (p.bias ? 1u : 0u) | static_cast<uint32_t>(p.activation) << 1;
  if (matvec) {
    // 2 simdgroups of rows_per_simdgroup weight rows per threadgroup; y: groups of 8 x rows
    const GgufMatvecShape shape = gguf_matvec_shape(p.k);
    args.lanes_per_row = shape.lanes_per_row;
    args.rows_per_lane = shape.rows_per_lane;
    args.piece = shape.piece;
    l.grid = {ceil_div(p.n, 2 * int64_t(shape.rows_per_simdgroup())),
              ceil_div(p.m, kGgufMetalMatvecMaxRows), 1};
    l.threadgroup = {64, 1, 1};
  } else {
    l.grid = {ceil_div(p.n, 32), ceil_div(p.m, 32), 1};
    l.threadgroup = {128, 1, 1};
  }
  l.bind(0, 1);  // w
  l.bind(1, 0);  // x
  l.bind(2, p.bias ? 3 : 2);  // y
  l.set_args(3, args);
  // bias; without one the kernel never reads buffer 4, bound to w so that every buffer
  // the function declares is bound (Metal's validation asks for it)
  l.bind(4, p.bias ? 2 : 1);
  return {l};
}

// ---- primitives ----------------------------------------------------------------

KernelPlan GgufDequantize::plan(const std::vector<mx::array>&,
                                const std::vector<mx::array>& outputs) const {
  GgufDequantizeProblem p{type_, outputs[0].dtype(), rows_, cols_};
  return plan_gguf_dequantize(p);
}

bool GgufDequantize::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const GgufDequantize&>(other);
  return type_ == o.type_ && rows_ == o.rows_ && cols_ == o.cols_ && backend() == o.backend();
}

void GgufDequantize::eval_native_cpu(const std::vector<mx::array>& inputs,
                                     std::vector<mx::array>& outputs) {
  cpu::GgufDequantizeRows a;
  a.type = type_;
  a.rows = rows_;
  a.cols = cols_;
  a.out_elt = elt_of(outputs[0].dtype());
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(inputs[0]);
  encoder.set_output_array(outputs[0]);
  encoder.dispatch([a, in = inputs[0], out = outputs[0]]() mutable {
    a.blocks = in.data<uint8_t>();
    a.out = out.data<void>();
    cpu::gguf_dequantize_rows(a);
  });
}

GgufMatmulProblem GgufMatmul::problem(const std::vector<mx::array>& inputs) const {
  GgufMatmulProblem p;
  p.type = type_;
  p.dtype = inputs[0].dtype();
  p.k = k_;
  p.n = n_;
  p.m = static_cast<int64_t>(inputs[0].size()) / k_;
  p.bias = bias_;
  p.activation = activation_;
  return p;
}

KernelPlan GgufMatmul::plan(const std::vector<mx::array>& inputs,
                            const std::vector<mx::array>&) const {
  return plan_gguf_matmul(problem(inputs));
}

bool GgufMatmul::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const GgufMatmul&>(other);
  return type_ == o.type_ && n_ == o.n_ && k_ == o.k_ && exact_ == o.exact_ &&
         bias_ == o.bias_ && activation_ == o.activation_ && backend() == o.backend();
}

void GgufMatmul::eval_native_cpu(const std::vector<mx::array>& inputs,
                                 std::vector<mx::array>& outputs) {
  GgufMatmulProblem p = problem(inputs);
  cpu::GgufMatmul a;
  a.type = p.type;
  a.n = p.n;
  a.k = p.k;
  a.m = p.m;
  a.elt = elt_of(p.dtype);
  a.exact = exact_;
  a.activation = activation_;
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  encoder.set_output_array(outputs[0]);
  encoder.dispatch([a, inputs, out = outputs[0], bias = bias_]() mutable {
    a.x = inputs[0].data<void>();
    a.w = inputs[1].data<uint8_t>();
    a.bias = bias ? inputs[2].data<void>() : nullptr;
    a.y = out.data<void>();
    cpu::gguf_matmul(a);
  });
}

}  // namespace vllm_metal
