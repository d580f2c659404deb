// A Metal kernel launch described as plain data.
//
// Planners turn shapes into KernelLaunch values; the Metal encoder (Apple) and
// the emulator (Linux) only execute them. Keeping launch geometry as data lets
// the variant choice, grid sizes and argument packing be unit-tested anywhere.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace vllm_metal {

// Function constant value bound at pipeline creation ([[function_constant(i)]]).
struct FunctionConstant {
  enum class Type : uint8_t { kBool, kInt32, kUInt32, kFloat32 };
  int index = 0;
  Type type = Type::kInt32;
  uint32_t bits = 0;  // the value's bytes (bool stored as 0/1)

  static FunctionConstant boolean(int index, bool v);
  static FunctionConstant int32(int index, int32_t v);
  static FunctionConstant uint32(int index, uint32_t v);
  static FunctionConstant float32(int index, float v);
  size_t byte_size() const { return type == Type::kBool ? 1 : 4; }
};

// [[buffer(index)]] bound to one of the op's arrays: slots [0, num_inputs) are
// the primitive's inputs, [num_inputs, num_inputs + num_outputs) its outputs.
struct BufferBinding {
  int index = 0;
  int array_slot = 0;
  int64_t byte_offset = 0;
  // An input that a later op updates in place (the paged KV cache, see
  // reshape_and_cache's `inplace`). On Metal it is also registered as written,
  // so MLX's encoder makes the next writer of the buffer wait for this read:
  // its fences and barriers order writes after reads only for outputs.
  bool read_before_in_place_write = false;
};

struct KernelLaunch {
  std::string source;  // .metal file stem (emulator library; one metallib on Apple)
  std::string kernel;  // host name of the kernel function
  std::vector<FunctionConstant> constants;
  std::vector<BufferBinding> buffers;
  int args_index = 0;          // [[buffer(args_index)]] receives `args`
  std::vector<uint8_t> args;   // bytes of the op's *_args.h struct
  std::array<uint32_t, 3> grid{1, 1, 1};         // threadgroups per grid
  std::array<uint32_t, 3> threadgroup{1, 1, 1};  // threads per threadgroup
  std::vector<uint64_t> threadgroup_memory;      // bytes per [[threadgroup(i)]]

  template <typename Args>
  void set_args(int index, const Args& a) {
    static_assert(std::is_trivially_copyable_v<Args>, "args must be plain data");
    args_index = index;
    args.resize(sizeof(Args));
    std::memcpy(args.data(), &a, sizeof(Args));
  }
  void bind(int index, int array_slot, int64_t byte_offset = 0) {
    buffers.push_back({index, array_slot, byte_offset});
  }
  uint64_t num_threads() const {
    return uint64_t(grid[0]) * grid[1] * grid[2] * threadgroup[0] * threadgroup[1] *
        threadgroup[2];
  }
};

using KernelPlan = std::vector<KernelLaunch>;

inline uint32_t ceil_div(uint64_t a, uint64_t b) {
  return static_cast<uint32_t>((a + b - 1) / b);
}

}  // namespace vllm_metal
