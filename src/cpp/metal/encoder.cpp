// Apple only: encodes a KernelPlan through MLX's Metal command encoder.
//
// Everything an op decides (kernel variant, function constants, bindings,
// grid) is already in the plan and tested on Linux with the emulator; this
// file only translates it into encoder calls. Kernels come from
// vllm_metal.metallib, built by CMake (mlx_build_metallib) and found next to
// the core shared library. See docs/apple.md. Checked on Linux by
// tools/apple_check: compiled against MLX's macOS headers, its symbols looked up
// in the real libmlx.dylib, and run against a recording fake of MLX's device.
#include <dlfcn.h>
#include <sys/stat.h>

#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/backend/metal/device.h"
#include "ops/kernel_primitive.h"

namespace vllm_metal {

namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "bool constants are read from the low byte of FunctionConstant::bits");

bool is_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// <dir of libvllm_metal_core>/vllm_metal.metallib (installed package) or
// <dir>/metallib/vllm_metal.metallib (CMake build tree).
std::string find_metallib() {
  Dl_info info{};
  if (::dladdr(reinterpret_cast<const void*>(&run_plan_metal), &info) == 0 ||
      info.dli_fname == nullptr) {
    throw std::runtime_error("[vllm_metal] dladdr failed to locate the core library");
  }
  std::string dir(info.dli_fname);
  const auto slash = dir.rfind('/');
  dir = slash == std::string::npos ? std::string(".") : dir.substr(0, slash);
  const std::string tried[] = {dir + "/vllm_metal.metallib",
                               dir + "/metallib/vllm_metal.metallib"};
  for (const auto& path : tried) {
    if (is_file(path)) return path;
  }
  throw std::runtime_error("[vllm_metal] vllm_metal.metallib not found; tried " + tried[0] +
                           " and " + tried[1]);
}

MTL::DataType metal_type(FunctionConstant::Type t) {
  switch (t) {
    case FunctionConstant::Type::kBool: return MTL::DataTypeBool;
    case FunctionConstant::Type::kInt32: return MTL::DataTypeInt;
    case FunctionConstant::Type::kUInt32: return MTL::DataTypeUInt;
    case FunctionConstant::Type::kFloat32: return MTL::DataTypeFloat;
  }
  throw std::runtime_error("[vllm_metal] unknown function constant type");
}

// One pipeline per (kernel, constant values): the values are part of the name.
MTL::ComputePipelineState* get_pipeline(mx::metal::Device& d, const KernelLaunch& launch) {
  static const std::string metallib = find_metallib();  // retried if it threw
  MTL::Library* lib = d.get_library("vllm_metal", metallib);
  mx::metal::MTLFCList consts;
  std::string hash = launch.kernel;
  for (const auto& c : launch.constants) {
    consts.emplace_back(&c.bits, metal_type(c.type), NS::UInteger(c.index));
    char buf[32];
    std::snprintf(buf, sizeof(buf), "_fc%d_%d_%08x", c.index, int(c.type), unsigned(c.bits));
    hash += buf;
  }
  return d.get_kernel(launch.kernel, lib, hash, consts);
}

[[noreturn]] void fail(const KernelLaunch& launch, const std::string& what) {
  throw std::runtime_error("[vllm_metal] " + launch.kernel + ": " + what);
}

// Everything Metal would reject (or silently misbehave on), caught before encoding.
void check_launch(const KernelLaunch& launch, MTL::ComputePipelineState* kernel,
                  int num_slots) {
  const uint64_t group = uint64_t(launch.threadgroup[0]) * launch.threadgroup[1] *
                         launch.threadgroup[2];
  if (group > kernel->maxTotalThreadsPerThreadgroup()) {
    fail(launch, "threadgroup of " + std::to_string(group) + " threads exceeds the pipeline's " +
                     std::to_string(kernel->maxTotalThreadsPerThreadgroup()));
  }
  for (const auto& b : launch.buffers) {
    if (b.array_slot < 0 || b.array_slot >= num_slots) {
      fail(launch, "buffer(" + std::to_string(b.index) + ") binds missing array slot " +
                       std::to_string(b.array_slot));
    }
  }
  if (launch.args.size() > 4096) {  // setBytes is meant for data up to 4 KB
    fail(launch, "args struct of " + std::to_string(launch.args.size()) + " bytes exceeds 4096");
  }
}

}  // namespace

void run_plan_metal(const KernelPlan& plan, const std::vector<mx::array>& inputs,
                    std::vector<mx::array>& outputs, mx::Stream stream) {
  auto& d = mx::metal::device(stream.device);
  const int num_inputs = static_cast<int>(inputs.size());
  const int num_slots = num_inputs + static_cast<int>(outputs.size());
  // All pipelines and checks first, so a bad launch leaves nothing half-encoded.
  std::vector<MTL::ComputePipelineState*> kernels;
  for (const auto& launch : plan) {
    kernels.push_back(launch.num_threads() == 0 ? nullptr : get_pipeline(d, launch));
    if (kernels.back()) check_launch(launch, kernels.back(), num_slots);
  }
  auto& enc = mx::metal::get_command_encoder(stream);
  for (size_t k = 0; k < plan.size(); ++k) {
    const KernelLaunch& launch = plan[k];
    if (!kernels[k]) continue;  // empty grid: nothing to encode
    enc.set_compute_pipeline_state(kernels[k]);
    for (const auto& b : launch.buffers) {
      if (b.array_slot < num_inputs) {
        enc.set_input_array(inputs[b.array_slot], b.index, b.byte_offset);
        // a barrier (same encoder) or a fence (a later one) before its next in-place write
        if (b.read_before_in_place_write) enc.register_output_array(inputs[b.array_slot]);
      } else {
        enc.set_output_array(outputs[b.array_slot - num_inputs], b.index, b.byte_offset);
      }
    }
    if (!launch.args.empty()) {
      enc.set_bytes(launch.args.data(), static_cast<int>(launch.args.size()),
                    launch.args_index);
    }
    for (size_t i = 0; i < launch.threadgroup_memory.size(); ++i) {
      // Metal wants threadgroup memory lengths in multiples of 16 bytes.
      const uint64_t len = (launch.threadgroup_memory[i] + 15) / 16 * 16;
      enc.set_threadgroup_memory_length(len, static_cast<int>(i));
    }
    enc.dispatch_threadgroups(
        MTL::Size(launch.grid[0], launch.grid[1], launch.grid[2]),
        MTL::Size(launch.threadgroup[0], launch.threadgroup[1], launch.threadgroup[2]));
  }
}

}  // namespace vllm_metal
