#include "ops/kernel_backend.h"

#include <atomic>
#include <stdexcept>

namespace vllm_metal {

namespace {
std::atomic<KernelBackend> g_backend{KernelBackend::kNative};
}

KernelBackend default_kernel_backend() {
  return g_backend.load(std::memory_order_relaxed);
}

void set_default_kernel_backend(KernelBackend backend) {
  g_backend.store(backend, std::memory_order_relaxed);
}

KernelBackend parse_kernel_backend(const std::string& name) {
  if (name == "native") return KernelBackend::kNative;
  if (name == "emulated") return KernelBackend::kEmulated;
  throw std::invalid_argument("[kernels] unknown kernel backend '" + name +
                              "', expected 'native' or 'emulated'");
}

const char* kernel_backend_name(KernelBackend backend) {
  return backend == KernelBackend::kEmulated ? "emulated" : "native";
}

}  // namespace vllm_metal
