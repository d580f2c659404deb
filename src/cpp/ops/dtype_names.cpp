#include "ops/dtype_names.h"

#include <stdexcept>

namespace vllm_metal {

std::string dtype_name(mx::Dtype dtype) {
  switch (dtype) {
    case mx::bool_: return "bool";
    case mx::uint8: return "uint8";
    case mx::uint16: return "uint16";
    case mx::uint32: return "uint32";
    case mx::uint64: return "uint64";
    case mx::int8: return "int8";
    case mx::int16: return "int16";
    case mx::int32: return "int32";
    case mx::int64: return "int64";
    case mx::float16: return "float16";
    case mx::float32: return "float32";
    case mx::float64: return "float64";
    case mx::bfloat16: return "bfloat16";
    case mx::complex64: return "complex64";
  }
  return "unknown";
}

bool is_float_dtype(mx::Dtype dtype) {
  return dtype == mx::float32 || dtype == mx::float16 || dtype == mx::bfloat16;
}

void check_float_dtype(const char* op, const char* what, mx::Dtype dtype) {
  if (!is_float_dtype(dtype)) {
    throw std::invalid_argument(std::string("[") + op + "] " + what +
                                " must be float32, float16 or bfloat16, got " + dtype_name(dtype));
  }
}

cpu::Elt elt_of(mx::Dtype dtype) {
  if (dtype == mx::float16) return cpu::Elt::kF16;
  if (dtype == mx::bfloat16) return cpu::Elt::kBF16;
  return cpu::Elt::kF32;
}

}  // namespace vllm_metal
