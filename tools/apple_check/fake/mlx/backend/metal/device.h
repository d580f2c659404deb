// A recording stand-in for MLX's Metal device and command encoder, so that
// src/cpp/metal/encoder.cpp can be *run* on Linux (tools/apple_check,
// encoder_behaviour.cpp). It declares only what the encoder calls, with the
// real signatures of mlx/backend/metal/device.h (MLX 0.32.4) and metal-cpp;
// the real headers keep the encoder honest in the type/symbol check, this
// file lets a test see which calls it makes, in which order, with which values.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "mlx/array.h"
#include "mlx/device.h"
#include "mlx/stream.h"

namespace NS {
using UInteger = std::uintptr_t;
}  // namespace NS

namespace MTL {
enum DataType : NS::UInteger {
  DataTypeFloat = 3,
  DataTypeInt = 29,
  DataTypeUInt = 33,
  DataTypeBool = 53,
};
struct Size {
  Size(NS::UInteger width, NS::UInteger height, NS::UInteger depth)
      : width(width), height(height), depth(depth) {}
  NS::UInteger width, height, depth;
};
struct Library {
  std::string name, path;
};
struct ComputePipelineState {
  std::string base_name, hash_name;
  NS::UInteger max_threads = 1024;
  NS::UInteger maxTotalThreadsPerThreadgroup() const { return max_threads; }
};
}  // namespace MTL

namespace mlx::core::metal {

using MTLFCList = std::vector<std::tuple<const void*, MTL::DataType, NS::UInteger>>;

// One line per call, e.g. "set_input_array slot=2 idx=0 offset=16".
struct FakeLog {
  std::vector<std::string> calls;
  std::vector<const array*> slots;  // inputs then outputs, to name bound arrays
  NS::UInteger max_threads = 1024;  // what new pipelines report
  std::string slot_of(const array& a) const {
    for (size_t i = 0; i < slots.size(); ++i) {
      if (slots[i] == &a) return std::to_string(i);
    }
    return "?";
  }
  void add(std::string s) { calls.push_back(std::move(s)); }
};

inline FakeLog& fake_log() {
  static FakeLog log;
  return log;
}

class Device {
 public:
  MTL::Library* get_library(const std::string& name, const std::string& path = "") {
    fake_log().add("get_library " + name + " " + path);
    libraries_.push_back(new MTL::Library{name, path});
    return libraries_.back();
  }
  MTL::ComputePipelineState* get_kernel(const std::string& base_name, MTL::Library* mtl_lib,
                                        const std::string& hash_name = "",
                                        const MTLFCList& func_consts = {}) {
    std::string s = "get_kernel " + base_name + " lib=" + (mtl_lib ? mtl_lib->name : "null") +
                    " hash=" + hash_name;
    for (const auto& [ptr, type, index] : func_consts) {
      uint32_t bits = 0;
      std::memcpy(&bits, ptr, type == MTL::DataTypeBool ? 1 : 4);
      s += " fc(" + std::to_string(index) + "," + std::to_string(int(type)) + "," +
           std::to_string(bits) + ")";
    }
    fake_log().add(s);
    pipelines_.push_back(
        new MTL::ComputePipelineState{base_name, hash_name, fake_log().max_threads});
    return pipelines_.back();
  }

 private:
  std::vector<MTL::Library*> libraries_;  // leaked on purpose, like MLX's caches
  std::vector<MTL::ComputePipelineState*> pipelines_;
};

class CommandEncoder {
 public:
  void set_input_array(const array& a, int idx, int64_t offset = 0) {
    fake_log().add("set_input_array slot=" + fake_log().slot_of(a) + " idx=" +
                   std::to_string(idx) + " offset=" + std::to_string(offset));
  }
  void set_output_array(array& a, int idx, int64_t offset = 0) {
    fake_log().add("set_output_array slot=" + fake_log().slot_of(a) + " idx=" +
                   std::to_string(idx) + " offset=" + std::to_string(offset));
  }
  void register_output_array(const array& a) {
    fake_log().add("register_output_array slot=" + fake_log().slot_of(a));
  }
  void set_compute_pipeline_state(MTL::ComputePipelineState* kernel) {
    fake_log().add("set_compute_pipeline_state " + kernel->hash_name);
  }
  template <typename T>
  void set_bytes(const T* v, int n, int idx) {
    std::string s = "set_bytes idx=" + std::to_string(idx) + " n=" +
                    std::to_string(n * sizeof(T)) + " bytes=";
    const auto* p = reinterpret_cast<const unsigned char*>(v);
    for (size_t i = 0; i < n * sizeof(T); ++i) s += std::to_string(p[i]) + ",";
    fake_log().add(s);
  }
  template <typename T>
  void set_bytes(const T& v, int idx) {
    set_bytes(&v, 1, idx);
  }
  void set_threadgroup_memory_length(size_t length, int idx) {
    fake_log().add("set_threadgroup_memory_length idx=" + std::to_string(idx) +
                   " length=" + std::to_string(length));
  }
  void dispatch_threadgroups(MTL::Size grid, MTL::Size group) {
    fake_log().add("dispatch_threadgroups grid=" + dims(grid) + " group=" + dims(group));
  }

 private:
  static std::string dims(const MTL::Size& s) {
    return std::to_string(s.width) + "x" + std::to_string(s.height) + "x" +
           std::to_string(s.depth);
  }
};

inline Device& device(mlx::core::Device) {
  static Device d;
  return d;
}

inline CommandEncoder& get_command_encoder(Stream) {
  static CommandEncoder e;
  return e;
}

}  // namespace mlx::core::metal
