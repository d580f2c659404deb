"""The C ABI as a C++ host sees it: dlopen the generated library, list its kernels with
mslemu_kernel_name, and dispatch from several host threads at once."""
import os
import subprocess

import mslemu

HOST = r"""
#include <mslemu/abi.h>
#include <dlfcn.h>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

template <class F> static F sym(void *h, const char *name) {
  void *p = dlsym(h, name);
  if (!p) { std::fprintf(stderr, "missing %s\n", name); std::exit(10); }
  return reinterpret_cast<F>(p);
}

int main(int argc, char **argv) {
  if (argc != 2) return 9;
  void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!h) { std::fprintf(stderr, "%s\n", dlerror()); return 8; }
  auto kernel_name = sym<mslemu_kernel_name_fn>(h, "mslemu_kernel_name");
  auto dispatch = sym<mslemu_dispatch_fn>(h, "mslemu_dispatch");
  auto dispatch_fc = sym<mslemu_dispatch_fc_fn>(h, "mslemu_dispatch_fc");
  auto set_fc = sym<mslemu_set_function_constant_fn>(h, "mslemu_set_function_constant");
  auto last_error = sym<mslemu_last_error_fn>(h, "mslemu_last_error");
  for (int i = 0; kernel_name(i); ++i) std::printf("kernel %s\n", kernel_name(i));
  if (kernel_name(-1) || kernel_name(1000)) return 2;

  mslemu_launch bad{};
  if (dispatch("nope", &bad) != MSLEMU_E_NO_KERNEL || !std::strstr(last_error(), "nope")) return 3;
  float f = 1.0f;
  if (set_fc("12", &f, 8) != MSLEMU_E_FC_SIZE) return 4;

  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      const float gain = 2.0f + t;
      const bool has_bias = (t % 2) == 1;
      const uint32_t act = 0;
      std::vector<float> x(200), bias(200, 0.25f), y(200);
      for (int i = 0; i < 200; ++i) x[i] = float(i) - 50.0f;
      void *bufs[3] = {x.data(), bias.data(), y.data()};
      const mslemu_function_constant fc[3] = {{"10", &has_bias, sizeof has_bias}, {"11", &act, sizeof act},
                                              {"12", &gain, sizeof gain}};
      for (int iter = 0; iter < 100; ++iter) {
        mslemu_launch L{};
        L.buffers = bufs;
        L.n_buffers = 3;
        L.grid[0] = 200;
        L.tg[0] = 48;  // not a multiple of 32; ragged last threadgroup
        L.nonuniform = 1;
        L.n_workers = 1;
        if (dispatch_fc("fc_affine", &L, fc, 3)) { ++failures; continue; }
        for (int i = 0; i < 200; ++i)
          if (y[i] != gain * x[i] + (has_bias ? 0.25f : 0.0f)) { ++failures; break; }
      }
    });
  for (auto &th : threads) th.join();
  if (failures) { std::fprintf(stderr, "%d failures\n", failures.load()); return 5; }
  std::printf("ok\n");
  return 0;
}
"""


def test_cpp_host_lists_kernels_and_dispatches_from_threads(load, tmp_path):
    lib = load("probes")
    src = tmp_path / "host.cpp"
    src.write_text(HOST)
    exe = tmp_path / "host"
    r = subprocess.run([mslemu.find_cxx(), "-std=c++17", "-O1", "-Wall", "-Werror", "-pthread", "-I", mslemu.INCLUDE_DIR,
                        str(src), "-o", str(exe), "-ldl"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([str(exe), lib.so_path], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, MSLEMU_STRICT="1", MSLEMU_POISON="1"))
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    lines = r.stdout.splitlines()
    assert lines[-1] == "ok"
    assert [ln.split()[1] for ln in lines[:-1]] == lib.kernels


def test_exported_symbols_are_only_the_abi(load):
    """-fvisibility=hidden: two kernel libraries in one host cannot interpose each other."""
    out = subprocess.run(["nm", "-D", "--defined-only", load("probes").so_path], capture_output=True, text=True,
                         check=True).stdout
    ours = sorted(line.split()[-1] for line in out.splitlines() if "mslemu" in line)
    assert ours == ["mslemu_dispatch", "mslemu_dispatch_fc", "mslemu_kernel_name", "mslemu_last_counts",
                    "mslemu_last_error",
                    "mslemu_set_function_constant"]
