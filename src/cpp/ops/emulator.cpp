#include "ops/emulator.h"

#include <dlfcn.h>

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
};

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::map<std::string, std::shared_ptr<Library>>& registry() {
  static std::map<std::string, std::shared_ptr<Library>> r;
  return r;
}

std::shared_ptr<Library> find(const std::string& source) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().find(source);
  return it == registry().end() ? nullptr : it->second;
}

}  // namespace

void register_library(const std::string& source, const std::string& so_path) {
  void* h = dlopen(so_path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    throw std::runtime_error("[emulator] cannot load " + so_path + ": " + dlerror());
  }
  auto lib = std::make_shared<Library>();
  lib->handle = h;
  lib->dispatch = reinterpret_cast<mslemu_dispatch_fc_fn>(dlsym(h, "mslemu_dispatch_fc"));
  lib->last_error = reinterpret_cast<mslemu_last_error_fn>(dlsym(h, "mslemu_last_error"));
  if (!lib->dispatch || !lib->last_error) {
    throw std::runtime_error("[emulator] " + so_path + " is not an mslemu kernel library");
  }
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry()[source] = std::move(lib);  // handles stay open for the process
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
         int num_slots) {
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
  int rc = lib->dispatch(launch.kernel.c_str(), &L, constants.data(),
                         static_cast<uint32_t>(constants.size()));
  if (rc != 0) {
    const char* why = lib->last_error();
    throw std::runtime_error("[emulator] " + launch.source + ".metal:" + launch.kernel +
                             " failed (" + std::to_string(rc) + "): " + (why ? why : "?"));
  }
}

}  // namespace vllm_metal::emulator
