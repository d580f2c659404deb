// Argument conversions shared by the binding files.
#pragma once

#include <stdexcept>
#include <string>
#include <variant>

#include "mlx/dtype.h"
#include "mlx/stream.h"
#include "mlx/utils.h"

namespace vllm_metal::bindings {

// `stream=` as MLX's own bindings accept it: None, a Stream or a Device.
using StreamArg = std::variant<std::monostate, mlx::core::Stream, mlx::core::Device>;

inline mlx::core::StreamOrDevice to_stream_or_device(const StreamArg& s) {
  if (std::holds_alternative<mlx::core::Stream>(s)) return std::get<mlx::core::Stream>(s);
  if (std::holds_alternative<mlx::core::Device>(s)) return std::get<mlx::core::Device>(s);
  return {};
}

// "float32" | "float16" | "bfloat16" (planner bindings take dtypes by name).
inline mlx::core::Dtype parse_float_dtype(const std::string& name) {
  if (name == "float32") return mlx::core::float32;
  if (name == "float16") return mlx::core::float16;
  if (name == "bfloat16") return mlx::core::bfloat16;
  throw std::invalid_argument("dtype must be 'float32', 'float16' or 'bfloat16', got '" + name +
                              "'");
}

}  // namespace vllm_metal::bindings
