// Dtype helpers shared by the ops: names for kernels and error messages.
#pragma once

#include <string>

#include "mlx/dtype.h"
#include "cpu/vec.h"

namespace vllm_metal {

namespace mx = mlx::core;

// "float32" | "float16" | "bfloat16" | ... (kernel host names use these).
std::string dtype_name(mx::Dtype dtype);

bool is_float_dtype(mx::Dtype dtype);  // float32, float16 or bfloat16

// Throws std::invalid_argument "[op] <what> must be float32, float16 or bfloat16, got <dtype>".
void check_float_dtype(const char* op, const char* what, mx::Dtype dtype);

cpu::Elt elt_of(mx::Dtype dtype);  // for float dtypes

}  // namespace vllm_metal
