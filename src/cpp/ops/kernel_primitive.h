// Base of every op primitive: one place decides which executor runs it.
//
//   CPU stream, native backend   -> eval_native_cpu (our C++ kernels)
//   CPU stream, emulated backend -> plan() executed by the MSL emulator
//   GPU stream (Apple)           -> plan() encoded through MLX's Metal encoder
#pragma once

#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "ops/kernel_backend.h"
#include "ops/kernel_launch.h"

namespace vllm_metal {

namespace mx = mlx::core;

class KernelPrimitive : public mx::Primitive {
 public:
  KernelPrimitive(mx::Stream stream, KernelBackend backend)
      : mx::Primitive(stream), backend_(backend) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) final;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) final;

  // Kernel launches for evaluated inputs and allocated outputs; array slots
  // number the inputs first, then the outputs.
  virtual KernelPlan plan(const std::vector<mx::array>& inputs,
                          const std::vector<mx::array>& outputs) const = 0;

  KernelBackend backend() const { return backend_; }

 protected:
  // Gives every output its buffer. Default: a fresh allocation each.
  virtual void allocate_outputs(const std::vector<mx::array>& inputs,
                                std::vector<mx::array>& outputs);
  virtual void eval_native_cpu(const std::vector<mx::array>& inputs,
                               std::vector<mx::array>& outputs) = 0;

 private:
  KernelBackend backend_;
};

// Executes `plan` in the emulator as one task on the CPU stream.
void run_plan_emulated(KernelPlan plan, const std::vector<mx::array>& inputs,
                       const std::vector<mx::array>& outputs, mx::Stream stream);

// Apple only (src/cpp/metal/encoder.cpp): encodes `plan` on the GPU stream.
void run_plan_metal(const KernelPlan& plan, const std::vector<mx::array>& inputs,
                    std::vector<mx::array>& outputs, mx::Stream stream);

}  // namespace vllm_metal
