// Which executor runs an op's kernels on the CPU stream.
#pragma once

#include <string>

namespace vllm_metal {

enum class KernelBackend : unsigned char {
  kNative,    // eval_cpu runs our C++ kernels; eval_gpu runs Metal (Apple)
  kEmulated,  // eval_cpu runs the op's Metal kernels in the emulator
};

// Backend captured by ops created from now on (an op keeps the one it was
// built with, so a lazy graph evaluates the way it was constructed).
KernelBackend default_kernel_backend();
void set_default_kernel_backend(KernelBackend backend);

KernelBackend parse_kernel_backend(const std::string& name);  // "native" | "emulated"
const char* kernel_backend_name(KernelBackend backend);

}  // namespace vllm_metal
