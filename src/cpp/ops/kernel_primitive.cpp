#include "ops/kernel_primitive.h"

#include <stdexcept>
#include <set>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "ops/emulator.h"

namespace vllm_metal {

void KernelPrimitive::allocate_outputs(const std::vector<mx::array>&,
                                       std::vector<mx::array>& outputs) {
  for (auto& out : outputs) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
  }
}

void KernelPrimitive::eval_cpu(const std::vector<mx::array>& inputs,
                               std::vector<mx::array>& outputs) {
  allocate_outputs(inputs, outputs);
  if (backend_ == KernelBackend::kEmulated) {
    run_plan_emulated(plan(inputs, outputs), inputs, outputs, stream());
  } else {
    eval_native_cpu(inputs, outputs);
  }
}

void KernelPrimitive::eval_gpu(const std::vector<mx::array>& inputs,
                               std::vector<mx::array>& outputs) {
#ifdef VLLM_METAL_HAS_METAL
  allocate_outputs(inputs, outputs);
  run_plan_metal(plan(inputs, outputs), inputs, outputs, stream());
#else
  (void)inputs;
  (void)outputs;
  throw std::runtime_error(std::string("[") + name() +
                           "] this build has no Metal backend; use a CPU stream");
#endif
}

void run_plan_emulated(KernelPlan plan, const std::vector<mx::array>& inputs,
                       const std::vector<mx::array>& outputs, mx::Stream stream) {
  std::set<std::string> sources;
  for (const auto& launch : plan) {
    sources.insert(launch.source);
  }
  for (const auto& s : sources) {
    emulator::require_library(s);  // fail on the caller's thread, not in the task
  }
  std::vector<mx::array> arrays(inputs);
  arrays.insert(arrays.end(), outputs.begin(), outputs.end());
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& a : arrays) {
    encoder.set_input_array(a);
  }
  // recordings name a launch by its op: the id of the op's first output
  uint64_t tag = outputs.empty() ? 0 : outputs[0].id();
  encoder.dispatch([plan = std::move(plan), arrays = std::move(arrays), tag]() {
    std::vector<void*> ptrs;
    std::vector<uint64_t> bytes;
    for (const auto& a : arrays) {
      ptrs.push_back(const_cast<void*>(static_cast<const void*>(a.data<char>())));
      bytes.push_back(a.data_size() * a.itemsize());
    }
    for (const auto& launch : plan) {
      emulator::run(launch, ptrs.data(), bytes.data(), static_cast<int>(ptrs.size()), tag);
    }
  });
}

}  // namespace vllm_metal
