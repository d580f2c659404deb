// Runs KernelLaunch plans on the MSL emulator (tools/mslemu) on a Linux CPU.
//
// Each src/metal/<source>.metal is compiled by the emulator into a shared
// library (Python builds it: vllm_metal.emulation); the library is registered
// here under its source stem and executed through its C ABI. No MLX here.
#pragma once

#include <cstdint>
#include <string>

#include "ops/kernel_launch.h"

namespace vllm_metal::emulator {

// dlopens `so_path` and makes its kernels runnable as `source`. Throws
// std::runtime_error when the library cannot be loaded.
void register_library(const std::string& source, const std::string& so_path);
bool has_library(const std::string& source);

// Throws std::runtime_error naming the source when it is not registered.
void require_library(const std::string& source);

// Runs one launch. `slot_ptrs[i]` is the base address of array slot i (already
// including the array's own offset); the binding's byte_offset is added here.
void run(const KernelLaunch& launch, void* const* slot_ptrs, const uint64_t* slot_bytes,
         int num_slots);

}  // namespace vllm_metal::emulator
