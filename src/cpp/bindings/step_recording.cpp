// What the step model (benchmarks/metal_step_model.py) reads of a decode step: the
// MLX graph of the step's outputs before eval (every primitive node, ours or MLX's),
// which arrays ended up sharing a buffer after eval, and the emulator's record of
// every kernel launch our ops ran (with traffic counts from the counting builds).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <unordered_set>
#include <vector>

#include "bindings/bindings.h"
#include "mlx/array.h"
#include "mlx/primitives.h"
#include "ops/emulator.h"
#include "ops/kernel_primitive.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;
namespace vm = vllm_metal;

namespace vllm_metal::bindings {

namespace {

// Every primitive node reachable from `outputs`, inputs before the nodes that read them
// (the order eval runs them in, up to independent branches). Evaluated arrays are leaves.
nb::list graph_nodes(const std::vector<mx::array>& outputs) {
  nb::list nodes;
  // arrays already on the stack or emitted, by id; a node's siblings are marked with it
  // (primitive objects are not a node's identity: MLX may share one between nodes)
  std::unordered_set<uintptr_t> seen;
  auto mark = [&](const mx::array& a) {
    seen.insert(a.id());
    for (const auto& s : a.siblings()) {
      seen.insert(s.id());
    }
  };
  struct Frame {
    mx::array a;
    size_t next = 0;
  };
  for (const auto& root : outputs) {
    if (!root.has_primitive() || seen.count(root.id())) {
      continue;
    }
    std::vector<Frame> stack{{root}};
    mark(root);
    while (!stack.empty()) {
      auto& f = stack.back();
      const auto& ins = f.a.inputs();
      if (f.next < ins.size()) {
        mx::array in = ins[f.next++];
        if (in.has_primitive() && !seen.count(in.id())) {
          mark(in);
          stack.push_back({in});
        }
        continue;
      }
      mx::array a = f.a;
      stack.pop_back();
      auto& p = a.primitive();
      std::vector<mx::array> outs = a.outputs();
      nb::dict node;
      node["name"] = std::string(p.name());
      node["ours"] = dynamic_cast<vm::KernelPrimitive*>(&p) != nullptr;
      node["id"] = outs.empty() ? a.id() : outs[0].id();
      node["inputs"] = a.inputs();
      node["outputs"] = outs;
      nodes.append(node);
    }
  }
  return nodes;
}

nb::dict counts_dict(const vm::emulator::LaunchRecord& r) {
  nb::dict d;
  d["threads"] = r.threads;
  d["threadgroups"] = r.threadgroups;
  d["simdgroups"] = r.simdgroups;
  d["threadgroup_memory"] = r.threadgroup_memory;
  d["barriers"] = r.barriers;
  d["simd_ops"] = r.simd_ops;
  d["matrix_macs"] = r.matrix_macs;
  // device memory: every buffer but the args struct (setBytes)
  uint64_t read = 0, written = 0, read_u = 0, written_u = 0, read_s = 0, written_s = 0;
  for (size_t i = 0; i < r.buffers.size(); ++i) {
    if (int(i) == r.args_index) {
      continue;
    }
    const auto& b = r.buffers[i];
    read += b.read;
    written += b.written;
    read_u += b.read_unique;
    written_u += b.written_unique;
    read_s += b.read_simd;
    written_s += b.written_simd;
  }
  d["read"] = read;
  d["written"] = written;
  d["read_unique"] = read_u;
  d["written_unique"] = written_u;
  d["read_simd"] = read_s;
  d["written_simd"] = written_s;
  return d;
}

nb::list stop_launch_recording() {
  nb::list out;
  for (const auto& r : vm::emulator::stop_recording()) {
    nb::dict d;
    d["source"] = r.source;
    d["kernel"] = r.kernel;
    d["grid"] = std::vector<uint32_t>(r.grid.begin(), r.grid.end());
    d["threadgroup"] = std::vector<uint32_t>(r.threadgroup.begin(), r.threadgroup.end());
    d["tag"] = r.tag;
    d["reused"] = r.reused;
    d["sampled_axis"] = r.sampled_axis;
    d["counts"] = r.counted ? nb::object(counts_dict(r)) : nb::none();
    out.append(d);
  }
  return out;
}

}  // namespace

void bind_step_recording(nb::module_& m) {
  m.def("graph_nodes", &graph_nodes, "outputs"_a,
        "Every primitive node of the unevaluated graph of `outputs`, inputs first: dicts of\n"
        "name, ours (one of our kernel ops), id (its first output's), inputs, outputs.");
  m.def(
      "array_id", [](const mx::array& a) { return a.id(); }, "a"_a,
      "The id graph_nodes and launch recordings name an array by.");
  m.def(
      "array_buffer_id",
      [](const mx::array& a) -> uintptr_t {
        return a.data_shared_ptr() ? reinterpret_cast<uintptr_t>(a.data_shared_ptr().get()) : 0;
      },
      "a"_a, "The buffer an evaluated array reads (equal for views of one buffer), 0 before eval.");
  m.def(
      "array_data_bytes", [](const mx::array& a) -> uint64_t { return a.data_size() * a.itemsize(); },
      "a"_a, "Bytes an evaluated array's data holds (a broadcast view: its data, not its shape).");
  m.def("register_counting_emulated_library", &vm::emulator::register_counting_library,
        "source"_a, "so_path"_a,
        "The counting build of src/metal/<source>.metal, run beside the real one while recording.");
  m.def("start_launch_recording", &vm::emulator::start_recording, "reset_counts"_a = true,
        "Record every emulated kernel launch from now on (see stop_launch_recording);\n"
        "reset_counts=False reuses counts of identical launches of earlier recordings.");
  m.def("stop_launch_recording", &stop_launch_recording,
        "The launches run since start_launch_recording, in order: source, kernel, grid,\n"
        "threadgroup, tag (the launching op's first output id), and counts (device bytes,\n"
        "threads, barriers...) when a counting build of the source is registered.");
}

}  // namespace vllm_metal::bindings
