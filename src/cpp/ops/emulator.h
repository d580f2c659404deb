// Runs KernelLaunch plans on the MSL emulator (tools/mslemu) on a Linux CPU.
//
// Each src/metal/<source>.metal is compiled by the emulator into a shared
// library (Python builds it: vllm_metal.emulation); the library is registered
// here under its source stem and executed through its C ABI. No MLX here.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

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
// `tag` names the launching op in recordings (the id of its first output).
void run(const KernelLaunch& launch, void* const* slot_ptrs, const uint64_t* slot_bytes,
         int num_slots, uint64_t tag = 0);

// ---- launch recording (the step model, benchmarks/metal_step_model.py) ----

// The counting build (mslemu accounting) of `source`, used only while recording.
void register_counting_library(const std::string& source, const std::string& so_path);

// One launch run while recording. With a counting build of its source registered,
// `counts` holds its traffic: counted once per distinct launch (kernel, constants, args,
// geometry, buffer sizes; later identical launches reuse it), and for a grid of more
// than kSampleAbove threadgroups along one axis, counted on two prefixes of that axis
// (kSample and 2 kSample threadgroups) and extrapolated linearly to the whole grid (exact
// for equal threadgroups; a partial last threadgroup counts as a whole one).
// The counting dispatches run before the real one on the same buffers: an op that updates
// a buffer in place from its old value (gated_delta's state) is applied twice, so a
// recorded step's values are for counting only.
struct LaunchRecord {
  std::string source;
  std::string kernel;
  std::array<uint32_t, 3> grid{};
  std::array<uint32_t, 3> threadgroup{};
  uint64_t tag = 0;
  int args_index = -1;          // [[buffer(i)]] of the args struct (not device memory), or -1
  bool counted = false;
  bool reused = false;          // counts copied from an identical earlier launch
  int sampled_axis = -1;        // grid axis counted on prefixes, or -1 (counted whole)
  // mslemu accounting (include/mslemu/abi.h): all threads; per [[buffer(i)]] bytes of
  // every access, distinct bytes, and with a simdgroup's broadcast loads counted once
  uint64_t threads = 0, threadgroups = 0, simdgroups = 0, threadgroup_memory = 0;
  uint64_t barriers = 0, simd_ops = 0, matrix_macs = 0;
  struct Buffer {
    uint64_t read = 0, written = 0, read_unique = 0, written_unique = 0;
    uint64_t read_simd = 0, written_simd = 0;
  };
  std::vector<Buffer> buffers;
};

constexpr uint32_t kSampleAbove = 512;
constexpr uint32_t kSample = 64;

// reset_counts false keeps the counts of earlier recordings for identical launches
// (several recordings of one model's steps)
void start_recording(bool reset_counts = true);
std::vector<LaunchRecord> stop_recording();  // what ran since start_recording

}  // namespace vllm_metal::emulator
