// Bindings of the GGUF reader and the gguf_* ops. Thin: C++ functions bound by
// name, keyword arguments, a docstring each; values converted, no logic.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <stdexcept>

#include "bindings/bindings.h"
#include "bindings/common.h"
#include "mlx/array.h"
#include "mlx/utils.h"
#include "ops/gguf_ops.h"
#include "runtime/gguf_reader.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;
namespace vm = vllm_metal;
using vllm_metal::bindings::parse_float_dtype;
using vllm_metal::bindings::StreamArg;
using vllm_metal::bindings::to_stream_or_device;
namespace gg = vllm_metal::gguf;

namespace {

using TypeArg = std::variant<int, std::string>;


gg::GGMLType to_type(const TypeArg& t) {
  if (std::holds_alternative<int>(t)) {
    int id = std::get<int>(t);
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


mx::Shape to_shape(const std::vector<int64_t>& v) {
  mx::Shape s;
  for (int64_t d : v) {
    if (d < 0 || d > INT32_MAX) throw std::invalid_argument("shape dimension out of range");
    s.push_back(static_cast<int>(d));
  }
  return s;
}

nb::object scalar_to_py(gg::ValueType t, const uint8_t* p) {
  auto ld = [&](auto v) {
    std::memcpy(&v, p, sizeof(v));
    return v;
  };
  switch (t) {
    case gg::ValueType::kU8: return nb::int_(ld(uint8_t()));
    case gg::ValueType::kI8: return nb::int_(ld(int8_t()));
    case gg::ValueType::kU16: return nb::int_(ld(uint16_t()));
    case gg::ValueType::kI16: return nb::int_(ld(int16_t()));
    case gg::ValueType::kU32: return nb::int_(ld(uint32_t()));
    case gg::ValueType::kI32: return nb::int_(ld(int32_t()));
    case gg::ValueType::kU64: return nb::int_(ld(uint64_t()));
    case gg::ValueType::kI64: return nb::int_(ld(int64_t()));
    case gg::ValueType::kF32: return nb::float_(ld(float()));
    case gg::ValueType::kF64: return nb::float_(ld(double()));
    case gg::ValueType::kBool: return nb::bool_(ld(uint8_t()) != 0);
    default: return nb::none();
  }
}

// GGUF strings should be UTF-8; invalid bytes become U+FFFD instead of failing.
nb::object utf8_to_py(const std::string& s) {
  return nb::steal(PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "replace"));
}

nb::object value_to_py(const gg::Value& v) {
  if (v.type == gg::ValueType::kString) {
    return utf8_to_py(v.str);
  }
  if (v.type == gg::ValueType::kArray) {
    nb::list out;
    if (v.elem_type == gg::ValueType::kString) {
      for (const auto& s : v.strings) out.append(utf8_to_py(s));
    } else {
      size_t es = gg::value_type_size(v.elem_type);
      for (uint64_t i = 0; i < v.count; ++i) out.append(scalar_to_py(v.elem_type, v.raw.data() + i * es));
    }
    return out;
  }
  return scalar_to_py(v.type, reinterpret_cast<const uint8_t*>(&v.scalar));
}

// The tensor's bytes as a uint8 [rows, row_bytes] array, without a copy: the
// array keeps the mapping alive.
mx::array tensor_bytes(const std::shared_ptr<gg::GGUFFile>& f, const std::string& name) {
  const gg::TensorInfo& t = f->tensor(name);
  int64_t rb = gg::row_bytes(t.type, t.ne[0]);
  int64_t rows = rb == 0 ? 0 : static_cast<int64_t>(t.nbytes) / rb;
  if (rb > INT32_MAX || rows > INT32_MAX) {
    throw std::invalid_argument("[gguf] tensor '" + name + "' is too large for one array");
  }
  auto* keep = new std::shared_ptr<gg::GGUFFile>(f);
  return mx::array(const_cast<uint8_t*>(t.data), {static_cast<int>(rows), static_cast<int>(rb)},
                   mx::uint8, [keep](void*) { delete keep; });
}

}  // namespace

namespace vllm_metal::bindings {

void bind_gguf(nb::module_& m) {
  nb::exception<gg::GGUFError>(m, "GGUFError", PyExc_ValueError);

  nb::class_<gg::TensorInfo>(m, "GGUFTensorInfo", "One tensor of a GGUF file.")
      .def_ro("name", &gg::TensorInfo::name)
      .def_prop_ro("type", [](const gg::TensorInfo& t) { return static_cast<int>(t.type); })
      .def_prop_ro("type_name", [](const gg::TensorInfo& t) {
        return gg::type_name(static_cast<uint32_t>(t.type));
      })
      .def_ro("ne", &gg::TensorInfo::ne, "dimensions in GGUF order (ne[0] innermost)")
      .def_prop_ro("shape", &gg::TensorInfo::shape, "row-major shape (reversed ne)")
      .def_ro("offset", &gg::TensorInfo::offset, "byte offset inside the data section")
      .def_ro("nbytes", &gg::TensorInfo::nbytes);

  nb::class_<gg::GGUFFile>(m, "GGUFFile", "A memory-mapped, validated GGUF v2/v3 file.")
      .def_static(
          "open",
          [](const std::string& path, bool require_supported_types) {
            gg::ReadOptions o;
            o.require_supported_types = require_supported_types;
            return gg::GGUFFile::open(path, o);
          },
          "path"_a, nb::kw_only(), "require_supported_types"_a = true,
          "Maps and validates a GGUF file; raises GGUFError naming the problem.")
      .def_static(
          "parse_bytes",
          [](nb::bytes data, bool require_supported_types) {
            gg::ReadOptions o;
            o.require_supported_types = require_supported_types;
            auto f = gg::GGUFFile::parse(reinterpret_cast<const uint8_t*>(data.c_str()),
                                         data.size(), o, "<bytes>");
            return static_cast<int64_t>(f->tensors().size());
          },
          "data"_a, nb::kw_only(), "require_supported_types"_a = true,
          "Validates GGUF bytes (tests, fuzzing); returns the tensor count.")
      .def_prop_ro("version", &gg::GGUFFile::version)
      .def_prop_ro("alignment", &gg::GGUFFile::alignment)
      .def_prop_ro("data_offset", &gg::GGUFFile::data_offset)
      .def_prop_ro("file_size", &gg::GGUFFile::file_size)
      .def_prop_ro("path", &gg::GGUFFile::path)
      .def_prop_ro("metadata", [](const gg::GGUFFile& f) {
        nb::dict d;
        for (const auto& [k, v] : f.metadata()) d[nb::str(k.data(), k.size())] = value_to_py(v);
        return d;
      }, "all metadata as a dict (arrays as lists), in file order")
      .def("metadata_type", [](const gg::GGUFFile& f, const std::string& key) {
        const gg::Value& v = f.get(key);
        std::string t = gg::value_type_name(v.type);
        if (v.type == gg::ValueType::kArray) t += std::string("[") + gg::value_type_name(v.elem_type) + "]";
        return t;
      }, "key"_a, "'u32', 'string', 'array[f32]', ...")
      .def_prop_ro("tensors", [](const gg::GGUFFile& f) { return f.tensors(); })
      .def("tensor", [](const gg::GGUFFile& f, const std::string& name) { return f.tensor(name); },
           "name"_a)
      .def("tensor_data", &tensor_bytes, "name"_a,
           "The tensor's bytes as uint8 [rows, row_bytes], sharing the file mapping (no copy).");

  m.def(
      "gguf_type_info",
      [](const TypeArg& t) {
        gg::TypeInfo i = gg::type_info(to_type(t));
        return nb::make_tuple(i.name, i.block_size, i.type_size, i.supported);
      },
      "type"_a, "(name, block_size, type_size, supported) of a GGML type id or name.");
  m.def(
      "gguf_dequantize",
      [](const mx::array& blocks, const TypeArg& type, const std::vector<int64_t>& shape,
         const std::string& out_dtype, const StreamArg& s) {
        return vm::gguf_dequantize(blocks, to_type(type), to_shape(shape),
                                   parse_float_dtype(out_dtype), to_stream_or_device(s));
      },
      "blocks"_a, "type"_a, "shape"_a, "out_dtype"_a = "float32", nb::kw_only(),
      "stream"_a = nb::none(),
      "Dense [shape] weights from GGUF blocks (uint8, the tensor's bytes); type: id or name.");
  m.def(
      "gguf_matmul",
      [](const mx::array& x, const mx::array& blocks, const TypeArg& type,
         const std::vector<int64_t>& shape, bool exact, const std::optional<mx::array>& bias,
         const std::string& activation, const StreamArg& s) {
        return vm::gguf_matmul(x, blocks, to_type(type), to_shape(shape), exact, bias,
                               vm::parse_gguf_activation(activation), to_stream_or_device(s));
      },
      "x"_a, "blocks"_a, "type"_a, "shape"_a, nb::kw_only(), "exact"_a = false,
      "bias"_a = nb::none(), "activation"_a = "none", "stream"_a = nb::none(),
      "x @ W.T for W = [N, K] (shape) in GGUF block form; returns [..., N] in x's dtype. "
      "exact=False: the CPU rounds x to 8-bit blocks for Q4_0..Q8_0 and Q4_K..Q6_K "
      "(llama.cpp's scheme); exact=True: float32 sums of x as given. Epilogue on the float32 "
      "sums before the one rounding: bias [N] (x's dtype) added, then activation 'none', "
      "'gelu' (erf) or 'gelu_tanh' (as ops.gelu).");
  m.def(
      "plan_gguf_dequantize",
      [](const TypeArg& type, const std::string& dtype, int64_t rows, int64_t cols) {
        return vm::plan_gguf_dequantize({to_type(type), parse_float_dtype(dtype), rows, cols});
      },
      "type"_a, "dtype"_a, "rows"_a, "cols"_a, "Kernel launches of gguf_dequantize.");
  m.def(
      "plan_gguf_matmul",
      [](const TypeArg& type, const std::string& dtype, int64_t m, int64_t n, int64_t k, bool bias,
         const std::string& activation) {
        return vm::plan_gguf_matmul({to_type(type), parse_float_dtype(dtype), m, n, k, bias,
                                     vm::parse_gguf_activation(activation)});
      },
      "type"_a, "dtype"_a, "m"_a, "n"_a, "k"_a, "bias"_a = false, "activation"_a = "none",
      "Kernel launches of gguf_matmul. Slots: 0 x, 1 blocks, 2 y; with bias: 0 x, 1 blocks, "
      "2 bias, 3 y.");
  m.def(
      "gguf_matvec_shape",
      [](int64_t k) {
        vm::GgufMatvecShape s = vm::gguf_matvec_shape(k);
        return std::make_tuple(s.lanes_per_row, s.rows_per_lane, s.piece);
      },
      "k"_a,
      "(lanes_per_row, rows_per_lane, piece) of the Metal mat-vec kernel for rows of k "
      "weights: lanes sharing a weight row, weight rows per lane, weights per piece.");
}

}  // namespace vllm_metal::bindings
