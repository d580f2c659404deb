// Runs src/cpp/metal/encoder.cpp on Linux against the recording fake of
// MLX's Metal device (fake/mlx/backend/metal/device.h) and checks the calls it
// makes: metallib lookup, pipelines per constant values, input vs output
// bindings with offsets, args bytes, threadgroup memory rounding, dispatch
// sizes, empty launches skipped, and bad launches rejected before anything is
// encoded. Built and run by check_host_code.py; prints failures, exits 1.
//
//   encoder_behaviour <installed|build-tree>   (run by absolute path)
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/backend/metal/device.h"
#include "ops/kernel_primitive.h"

namespace mx = mlx::core;
namespace vm = vllm_metal;

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    std::printf("FAIL: %s\n", what.c_str());
    ++failures;
  }
}

bool starts_with(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }
bool ends_with(const std::string& s, const std::string& p) {
  return s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0;
}

std::string dump(const std::vector<std::string>& calls) {
  std::string s;
  for (const auto& c : calls) s += "    " + c + "\n";
  return s;
}

struct Arrays {
  std::vector<mx::array> inputs{mx::array(1.0f), mx::array(2.0f)};
  std::vector<mx::array> outputs{mx::array(3.0f), mx::array(4.0f)};
  Arrays() {
    auto& log = mx::metal::fake_log();
    log.slots = {&inputs[0], &inputs[1], &outputs[0], &outputs[1]};
  }
};

// Runs the plan on a fresh log; returns the exception message ("" if none).
std::string run(const vm::KernelPlan& plan, Arrays& a) {
  mx::metal::fake_log().calls.clear();
  try {
    vm::run_plan_metal(plan, a.inputs, a.outputs, mx::Stream(0, mx::Device::gpu));
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

struct TwoU32 {
  uint32_t a, b;
};

vm::KernelLaunch launch(const std::string& kernel, int32_t c1) {
  vm::KernelLaunch l;
  l.source = "test";
  l.kernel = kernel;
  l.constants = {vm::FunctionConstant::boolean(0, true), vm::FunctionConstant::int32(1, c1),
                 vm::FunctionConstant::uint32(2, 7), vm::FunctionConstant::float32(3, 1.5f)};
  l.bind(0, 0);
  l.bind(1, 1, 16);
  l.bind(2, 2);
  l.set_args(3, TwoU32{1, 2});
  l.grid = {4, 2, 1};
  l.threadgroup = {32, 2, 1};
  l.threadgroup_memory = {100, 0, 16};
  return l;
}

void check_main_plan(const std::string& metallib) {
  Arrays a;
  vm::KernelPlan plan;
  plan.push_back(launch("k_a", -3));
  vm::KernelLaunch empty = launch("k_empty", 0);
  empty.grid = {0, 1, 1};
  plan.push_back(empty);
  vm::KernelLaunch second = launch("k_a", 5);  // other constant value: other pipeline
  second.buffers.clear();
  second.bind(0, 2);      // output 0 of the first launch, read again
  second.bind(1, 3, 8);   // output 1 with an offset
  second.args.clear();
  second.threadgroup_memory.clear();
  plan.push_back(second);
  vm::KernelLaunch plain;
  plain.kernel = "k_b";
  plain.bind(0, 0);
  plain.bind(1, 1);  // an input written in place by a later op: tracked as written too
  plain.buffers.back().read_before_in_place_write = true;
  plan.push_back(plain);

  const std::string err = run(plan, a);
  expect(err.empty(), "main plan threw: " + err);
  const auto calls = mx::metal::fake_log().calls;
  const std::string fc_a = " fc(0,53,1) fc(1,29,4294967293) fc(2,33,7) fc(3,3,1069547520)";
  const std::string fc_b = " fc(0,53,1) fc(1,29,5) fc(2,33,7) fc(3,3,1069547520)";
  // Pipelines first (all launches), then the encoding.
  std::vector<std::string> lib_and_kernels;
  for (const auto& c : calls) {
    if (starts_with(c, "get_")) lib_and_kernels.push_back(c);
  }
  expect(lib_and_kernels.size() == 6, "3 libraries + 3 kernels, got:\n" + dump(calls));
  if (lib_and_kernels.size() != 6) return;
  for (int i : {0, 2, 4}) {
    expect(lib_and_kernels[i] == "get_library vllm_metal " + metallib,
           "library call: " + lib_and_kernels[i]);
  }
  const std::string& ka = lib_and_kernels[1];
  const std::string& ka2 = lib_and_kernels[3];
  const std::string& kb = lib_and_kernels[5];
  expect(starts_with(ka, "get_kernel k_a lib=vllm_metal hash=k_a") && ends_with(ka, fc_a),
         "first pipeline: " + ka);
  expect(starts_with(ka2, "get_kernel k_a lib=vllm_metal hash=k_a") && ends_with(ka2, fc_b),
         "second pipeline: " + ka2);
  expect(kb == "get_kernel k_b lib=vllm_metal hash=k_b", "plain pipeline: " + kb);
  auto hash_of = [](const std::string& c) {
    auto from = c.find("hash=") + 5;
    return c.substr(from, c.find(' ', from) - from);
  };
  expect(hash_of(ka) != hash_of(ka2), "different constant values share the pipeline name " +
                                          hash_of(ka));

  std::vector<std::string> encoded(calls.begin() + 6, calls.end());
  const std::vector<std::string> want = {
      "set_compute_pipeline_state " + hash_of(ka),
      "set_input_array slot=0 idx=0 offset=0",
      "set_input_array slot=1 idx=1 offset=16",
      "set_output_array slot=2 idx=2 offset=0",
      "set_bytes idx=3 n=8 bytes=1,0,0,0,2,0,0,0,",
      "set_threadgroup_memory_length idx=0 length=112",
      "set_threadgroup_memory_length idx=1 length=0",
      "set_threadgroup_memory_length idx=2 length=16",
      "dispatch_threadgroups grid=4x2x1 group=32x2x1",
      "set_compute_pipeline_state " + hash_of(ka2),
      "set_output_array slot=2 idx=0 offset=0",
      "set_output_array slot=3 idx=1 offset=8",
      "dispatch_threadgroups grid=4x2x1 group=32x2x1",
      "set_compute_pipeline_state k_b",
      "set_input_array slot=0 idx=0 offset=0",
      "set_input_array slot=1 idx=1 offset=0",
      "register_output_array slot=1",
      "dispatch_threadgroups grid=1x1x1 group=1x1x1",
  };
  expect(encoded == want, "encoded calls differ; want:\n" + dump(want) + "  got:\n" +
                              dump(encoded));

  // Same plan again: same pipeline names (the cache key is stable).
  run(plan, a);
  const auto again = mx::metal::fake_log().calls;
  expect(again.size() > 1 && again[1] == ka, "second run asked for another pipeline: " +
                                                 (again.size() > 1 ? again[1] : ""));
}

void check_rejected(const std::string& what, vm::KernelLaunch bad, const std::string& message) {
  Arrays a;
  vm::KernelPlan plan = {launch("k_ok", 1), bad};
  const std::string err = run(plan, a);
  expect(err.find(message) != std::string::npos,
         what + ": expected an error containing '" + message + "', got '" + err + "'");
  for (const auto& c : mx::metal::fake_log().calls) {
    expect(starts_with(c, "get_"), what + ": encoded before failing: " + c);
  }
}

void check_errors() {
  vm::KernelLaunch bad_slot = launch("k_bad", 1);
  bad_slot.bind(4, 99);
  check_rejected("bad slot", bad_slot, "k_bad: buffer(4) binds missing array slot 99");
  vm::KernelLaunch negative_slot = launch("k_bad", 1);
  negative_slot.bind(4, -1);
  check_rejected("negative slot", negative_slot, "missing array slot -1");
  vm::KernelLaunch big_group = launch("k_big", 1);
  big_group.threadgroup = {64, 32, 1};
  check_rejected("threadgroup too large", big_group,
                 "k_big: threadgroup of 2048 threads exceeds the pipeline's 1024");
  vm::KernelLaunch big_args = launch("k_args", 1);
  big_args.args.resize(5000);
  check_rejected("args too large", big_args, "k_args: args struct of 5000 bytes exceeds 4096");
}

void touch(const std::string& path) { std::ofstream(path) << "not a real metallib\n"; }

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2 || argv[0][0] != '/') {
    std::fprintf(stderr, "usage: /abs/path/encoder_behaviour <installed|build-tree>\n");
    return 2;
  }
  std::string dir(argv[0]);
  dir = dir.substr(0, dir.rfind('/'));
  const std::string installed = dir + "/vllm_metal.metallib";
  const std::string build_tree = dir + "/metallib/vllm_metal.metallib";
  ::unlink(installed.c_str());
  ::unlink(build_tree.c_str());
  ::mkdir((dir + "/metallib").c_str(), 0755);

  // No metallib yet: a clear error naming both places, nothing encoded.
  {
    Arrays a;
    const std::string err = run({launch("k_a", 1)}, a);
    expect(err.find("vllm_metal.metallib not found") != std::string::npos &&
               err.find(installed) != std::string::npos &&
               err.find(build_tree) != std::string::npos,
           "missing metallib error should name " + installed + " and " + build_tree +
               ", got '" + err + "'");
    expect(mx::metal::fake_log().calls.empty(),
           "calls made without a metallib:\n" + dump(mx::metal::fake_log().calls));
  }
  std::string want;
  if (std::string(argv[1]) == "installed") {
    touch(build_tree);
    touch(installed);  // both present: the installed layout wins
    want = installed;
  } else {
    touch(build_tree);
    want = build_tree;
  }
  check_main_plan(want);
  check_errors();
  if (failures) {
    std::printf("%d check(s) failed\n", failures);
    return 1;
  }
  std::printf("encoder behaviour (%s): OK\n", argv[1]);
  return 0;
}
