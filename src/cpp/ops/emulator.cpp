#include "ops/emulator.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <vector>

#include "mslemu/abi.h"

namespace vllm_metal::emulator {

namespace {

struct Library {
  void* handle = nullptr;
  mslemu_dispatch_fc_fn dispatch = nullptr;  // sets constants + dispatches atomically
  mslemu_last_error_fn last_error = nullptr;
  mslemu_last_counts_fn last_counts = nullptr;  // counting builds only
};

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::map<std::string, std::shared_ptr<Library>>& registry() {
  static std::map<std::string, std::shared_ptr<Library>> r;
  return r;
}

std::map<std::string, std::shared_ptr<Library>>& counting_registry() {
  static std::map<std::string, std::shared_ptr<Library>> r;
  return r;
}

std::shared_ptr<Library> find_in(std::map<std::string, std::shared_ptr<Library>>& r,
                                 const std::string& source) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = r.find(source);
  return it == r.end() ? nullptr : it->second;
}

std::shared_ptr<Library> find(const std::string& source) {
  return find_in(registry(), source);
}

std::shared_ptr<Library> open_library(const std::string& so_path) {
  void* h = dlopen(so_path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    throw std::runtime_error("[emulator] cannot load " + so_path + ": " + dlerror());
  }
  auto lib = std::make_shared<Library>();
  lib->handle = h;
  lib->dispatch = reinterpret_cast<mslemu_dispatch_fc_fn>(dlsym(h, "mslemu_dispatch_fc"));
  lib->last_error = reinterpret_cast<mslemu_last_error_fn>(dlsym(h, "mslemu_last_error"));
  lib->last_counts = reinterpret_cast<mslemu_last_counts_fn>(dlsym(h, "mslemu_last_counts"));
  if (!lib->dispatch || !lib->last_error) {
    throw std::runtime_error("[emulator] " + so_path + " is not an mslemu kernel library");
  }
  return lib;
}

// ---- recording ----

struct Recorder {
  std::mutex mutex;
  bool on = false;
  std::vector<LaunchRecord> records;
  std::map<std::string, LaunchRecord> counted;  // distinct launch -> its record (counts)
};

Recorder& recorder() {
  static Recorder r;
  return r;
}

void dispatch_or_throw(const Library& lib, const KernelLaunch& launch, const mslemu_launch& L,
                       const std::vector<mslemu_function_constant>& constants) {
  int rc = lib.dispatch(launch.kernel.c_str(), &L, constants.data(),
                        static_cast<uint32_t>(constants.size()));
  if (rc != 0) {
    const char* why = lib.last_error();
    throw std::runtime_error("[emulator] " + launch.source + ".metal:" + launch.kernel +
                             " failed (" + std::to_string(rc) + "): " + (why ? why : "?"));
  }
}

// What makes two launches count the same: everything the host hands the kernel but the
// buffers' contents.
std::string launch_key(const KernelLaunch& launch, const mslemu_launch& L) {
  std::string k = launch.source + "|" + launch.kernel + "|";
  for (const auto& c : launch.constants) {
    k += std::to_string(c.index) + "=" + std::to_string(c.bits) + ",";
  }
  k += "|";
  k.append(launch.args.begin(), launch.args.end());
  k += "|";
  for (int i = 0; i < 3; ++i) {
    k += std::to_string(L.grid[i]) + "," + std::to_string(L.tg[i]) + ",";
  }
  for (auto b : launch.threadgroup_memory) {
    k += std::to_string(b) + ",";
  }
  k += "|";
  for (uint32_t i = 0; i < L.n_buffers; ++i) {
    k += std::to_string(L.buffers[i] ? L.buffer_sizes[i] : 0) + ",";
  }
  return k;
}

// c1 counted s threadgroups along the sampled axis, c2 2s: the whole grid's g by the
// per-threadgroup increment (what all threadgroups share is in c1 once).
mslemu_counts extrapolate(const mslemu_counts& c1, const mslemu_counts& c2, uint32_t s,
                          uint32_t g) {
  auto lin = [&](uint64_t a, uint64_t b) {
    double step = b > a ? double(b - a) : 0.0;
    return a + static_cast<uint64_t>(step * double(g - s) / double(s) + 0.5);
  };
  mslemu_counts out = c2;
  out.threads = lin(c1.threads, c2.threads);
  out.threadgroups = lin(c1.threadgroups, c2.threadgroups);
  out.simdgroups = lin(c1.simdgroups, c2.simdgroups);
  out.threadgroup_read = lin(c1.threadgroup_read, c2.threadgroup_read);
  out.threadgroup_written = lin(c1.threadgroup_written, c2.threadgroup_written);
  out.barriers = lin(c1.barriers, c2.barriers);
  out.simd_ops = lin(c1.simd_ops, c2.simd_ops);
  out.matrix_loads = lin(c1.matrix_loads, c2.matrix_loads);
  out.matrix_stores = lin(c1.matrix_stores, c2.matrix_stores);
  out.matrix_macs = lin(c1.matrix_macs, c2.matrix_macs);
  for (uint32_t i = 0; i < std::min<uint32_t>(c2.n_buffers, MSLEMU_MAX_COUNTED_BUFFERS); ++i) {
    const auto &a = c1.buffers[i], &b = c2.buffers[i];
    auto& o = out.buffers[i];
    o.read = lin(a.read, b.read);
    o.written = lin(a.written, b.written);
    o.read_unique = lin(a.read_unique, b.read_unique);
    o.written_unique = lin(a.written_unique, b.written_unique);
    o.read_tg_unique = lin(a.read_tg_unique, b.read_tg_unique);
    o.written_tg_unique = lin(a.written_tg_unique, b.written_tg_unique);
    o.read_simd = lin(a.read_simd, b.read_simd);
    o.written_simd = lin(a.written_simd, b.written_simd);
  }
  return out;
}

void copy_counts(const mslemu_counts& c, LaunchRecord& r) {
  r.threads = c.threads;
  r.threadgroups = c.threadgroups;
  r.simdgroups = c.simdgroups;
  r.threadgroup_memory = c.threadgroup_memory;
  r.barriers = c.barriers;
  r.simd_ops = c.simd_ops;
  r.matrix_macs = c.matrix_macs;
  r.buffers.clear();
  for (uint32_t i = 0; i < std::min<uint32_t>(c.n_buffers, MSLEMU_MAX_COUNTED_BUFFERS); ++i) {
    const auto& b = c.buffers[i];
    r.buffers.push_back({b.read, b.written, b.read_unique, b.written_unique, b.read_simd,
                         b.written_simd});
  }
}

// Called before the real dispatch (a sampled count writes part of the outputs, which the
// real dispatch then writes whole).
void record(const KernelLaunch& launch, const mslemu_launch& L,
            const std::vector<mslemu_function_constant>& constants, uint64_t tag) {
  LaunchRecord r;
  r.source = launch.source;
  r.kernel = launch.kernel;
  r.tag = tag;
  r.args_index = launch.args.empty() ? -1 : launch.args_index;
  for (int i = 0; i < 3; ++i) {
    r.grid[i] = L.grid[i];
    r.threadgroup[i] = L.tg[i];
  }
  auto counting = find_in(counting_registry(), launch.source);
  if (counting && counting->last_counts) {
    std::string key = launch_key(launch, L);
    auto& rec = recorder();
    std::unique_lock<std::mutex> lock(rec.mutex);
    auto it = rec.counted.find(key);
    if (it != rec.counted.end()) {
      r = it->second;  // same source, kernel, geometry, args
      r.tag = tag;
      r.reused = true;
    } else {
      lock.unlock();
      int axis = int(std::max_element(L.grid, L.grid + 3) - L.grid);
      if (L.grid[axis] > kSampleAbove) {
        mslemu_launch part = L;
        part.grid[axis] = kSample;
        dispatch_or_throw(*counting, launch, part, constants);
        mslemu_counts c1 = *counting->last_counts();
        part.grid[axis] = 2 * kSample;
        dispatch_or_throw(*counting, launch, part, constants);
        copy_counts(extrapolate(c1, *counting->last_counts(), kSample, L.grid[axis]), r);
        r.sampled_axis = axis;
      } else {
        dispatch_or_throw(*counting, launch, L, constants);
        copy_counts(*counting->last_counts(), r);
      }
      r.counted = true;
      lock.lock();
      rec.counted.emplace(key, r);
    }
  }
  auto& rec = recorder();
  std::lock_guard<std::mutex> lock(rec.mutex);
  rec.records.push_back(std::move(r));
}

bool recording() {
  auto& rec = recorder();
  std::lock_guard<std::mutex> lock(rec.mutex);
  return rec.on;
}

}  // namespace

void register_library(const std::string& source, const std::string& so_path) {
  auto lib = open_library(so_path);
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry()[source] = std::move(lib);  // handles stay open for the process
}

void register_counting_library(const std::string& source, const std::string& so_path) {
  auto lib = open_library(so_path);
  if (!lib->last_counts) {
    throw std::runtime_error("[emulator] " + so_path + " is not a counting build");
  }
  std::lock_guard<std::mutex> lock(registry_mutex());
  counting_registry()[source] = std::move(lib);
}

void start_recording(bool reset_counts) {
  auto& rec = recorder();
  std::lock_guard<std::mutex> lock(rec.mutex);
  rec.on = true;
  rec.records.clear();
  if (reset_counts) {
    rec.counted.clear();
  }
}

std::vector<LaunchRecord> stop_recording() {
  auto& rec = recorder();
  std::lock_guard<std::mutex> lock(rec.mutex);
  rec.on = false;
  return std::move(rec.records);
}

bool has_library(const std::string& source) {
  return find(source) != nullptr;
}

void require_library(const std::string& source) {
  if (!has_library(source)) {
    throw std::runtime_error(
        "[emulator] no emulated kernel library for '" + source +
        "'; VLLM_METAL_KERNELS=emulated needs vllm_metal.emulation to build it first");
  }
}

void run(const KernelLaunch& launch, void* const* slot_ptrs, const uint64_t* slot_bytes,
         int num_slots, uint64_t tag) {
  auto lib = find(launch.source);
  if (!lib) {
    require_library(launch.source);
  }
  int n = launch.args.empty() ? 0 : launch.args_index + 1;
  for (const auto& b : launch.buffers) {
    n = std::max(n, b.index + 1);
  }
  std::vector<void*> ptrs(n, nullptr);
  std::vector<uint64_t> sizes(n, 0);
  for (const auto& b : launch.buffers) {
    if (b.array_slot < 0 || b.array_slot >= num_slots) {
      throw std::logic_error("[emulator] " + launch.kernel + ": bad array slot");
    }
    ptrs[b.index] = static_cast<char*>(slot_ptrs[b.array_slot]) + b.byte_offset;
    sizes[b.index] = slot_bytes[b.array_slot] - b.byte_offset;
  }
  if (!launch.args.empty()) {
    ptrs[launch.args_index] = const_cast<uint8_t*>(launch.args.data());
    sizes[launch.args_index] = launch.args.size();
  }
  mslemu_launch L{};
  L.buffers = ptrs.data();
  L.buffer_sizes = sizes.data();
  L.n_buffers = static_cast<uint32_t>(n);
  L.tg_mem_len = launch.threadgroup_memory.data();
  L.n_tg_mem = static_cast<uint32_t>(launch.threadgroup_memory.size());
  for (int i = 0; i < 3; ++i) {
    L.grid[i] = launch.grid[i];
    L.tg[i] = launch.threadgroup[i];
  }
  std::vector<std::string> indices;
  indices.reserve(launch.constants.size());
  std::vector<mslemu_function_constant> constants;
  for (const auto& c : launch.constants) {
    indices.push_back(std::to_string(c.index));
    constants.push_back({indices.back().c_str(), &c.bits, c.byte_size()});
  }
  if (recording()) {
    record(launch, L, constants, tag);
  }
  dispatch_or_throw(*lib, launch, L, constants);
}

}  // namespace vllm_metal::emulator
