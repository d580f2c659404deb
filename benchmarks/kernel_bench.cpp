// kernel_bench: the ops against this machine's memory bandwidth, in one run.
//
//   1. Copy bandwidth: memcpy of a 256 MB buffer (far beyond the L3), split
//      across the cores with cpu::parallel_for like the kernels are, and on one
//      thread. Read + write bytes are counted. This is the roofline.
//   2. rms_norm, add_rms_norm and reshape_and_cache x float32/float16/bfloat16
//      x real model shapes, each three ways:
//        mlx    the MLX op (build the graph, mx::eval it), what the runtime pays
//        raw    the CPU kernel on plain buffers, all kernel threads
//        raw1t  the CPU kernel on plain buffers, one thread
//      reported as the median time per call, the GB/s of the bytes the op must
//      move at least, and that rate over the threaded copy bandwidth. The
//      repetitions of the three paths are interleaved, so load from elsewhere
//      on a shared machine lands on all of them alike.
//
// Prints tables, then one JSON object per line; --json PATH also writes the
// whole run as one JSON document. See benchmarks/README.md.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cpu/parallel.h"
#include "cpu/reshape_and_cache.h"
#include "cpu/rms_norm.h"
#include "cpu/vec.h"
#include "mlx/array.h"
#include "mlx/memory.h"
#include "mlx/ops.h"
#include "mlx/transforms.h"
#include "mlx/version.h"
#include "ops/dtype_names.h"
#include "ops/reshape_and_cache.h"
#include "ops/rms_norm.h"

namespace mx = mlx::core;
namespace vm = vllm_metal;
namespace cpu = vllm_metal::cpu;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct Config {
  bool quick = false;
  int threads = 0;            // kernel threads; 0 = all cores
  int reps = 7;               // timed repetitions; the median is reported
  double rep_seconds = 0.015; // each repetition runs calls for about this long
  size_t copy_bytes = size_t(256) << 20;
  long mlx_cache_limit_mb = -1;  // -1: leave MLX's default
  std::string json_path;
};

// ---- timing ---------------------------------------------------------------------

struct Timing {
  double median_s = 0;  // per call
  double min_s = 0;
  int iters = 0;        // calls per repetition
  int reps = 0;
};

// One way of running an op; `threads` is the kernel thread setting during its
// calls (set_num_threads), so paths with different settings can interleave.
struct Candidate {
  std::function<void()> fn;
  int threads = 0;
};

// Warms every candidate up (first-call allocations, page faults) and sizes its
// repetition to about cfg.rep_seconds, then times cfg.reps rounds; each round
// runs one repetition of every candidate in turn, so load from elsewhere on a
// shared machine lands on all of them alike and their ratios stay meaningful.
std::vector<Timing> measure_group(const std::vector<Candidate>& cs, const Config& cfg) {
  std::vector<Timing> ts(cs.size());
  std::vector<std::vector<double>> per_call(cs.size());
  for (size_t c = 0; c < cs.size(); ++c) {
    cpu::set_num_threads(cs[c].threads);
    auto t0 = Clock::now();
    cs[c].fn();
    double estimate = seconds_since(t0);
    if (estimate < cfg.rep_seconds) {
      // the first call may carry one-time costs: estimate again, warm
      int n = 0;
      double elapsed = 0;
      t0 = Clock::now();
      do {
        cs[c].fn();
        ++n;
        elapsed = seconds_since(t0);
      } while (elapsed < cfg.rep_seconds / 4 && n < 100000);
      estimate = elapsed / n;
    }
    ts[c].iters = std::max(1, static_cast<int>(cfg.rep_seconds / estimate));
    ts[c].reps = cfg.reps;
  }
  for (int r = 0; r < cfg.reps; ++r) {
    for (size_t c = 0; c < cs.size(); ++c) {
      cpu::set_num_threads(cs[c].threads);
      auto t0 = Clock::now();
      for (int i = 0; i < ts[c].iters; ++i) cs[c].fn();
      per_call[c].push_back(seconds_since(t0) / ts[c].iters);
    }
  }
  cpu::set_num_threads(cfg.threads);
  for (size_t c = 0; c < cs.size(); ++c) {
    auto& v = per_call[c];
    std::sort(v.begin(), v.end());
    const size_t m = v.size();
    ts[c].median_s = m % 2 ? v[m / 2] : 0.5 * (v[m / 2 - 1] + v[m / 2]);
    ts[c].min_s = v.front();
  }
  return ts;
}

Timing measure(const std::function<void()>& fn, int threads, const Config& cfg) {
  return measure_group({{fn, threads}}, cfg)[0];
}

// ---- buffers and data -----------------------------------------------------------

struct FreeDeleter {
  void operator()(char* p) const { std::free(p); }
};

// 64-byte aligned, zero-filled (so every page is touched before timing).
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t bytes) : bytes_(bytes) {
    size_t rounded = std::max<size_t>(64, (bytes + 63) / 64 * 64);
    p_.reset(static_cast<char*>(std::aligned_alloc(64, rounded)));
    if (!p_) throw std::bad_alloc();
    std::memset(p_.get(), 0, rounded);
  }
  char* data() const { return p_.get(); }
  size_t size() const { return bytes_; }

 private:
  size_t bytes_ = 0;
  std::unique_ptr<char, FreeDeleter> p_;
};

// Uniform in [-scale, scale); a fixed LCG so every run sees the same data.
std::vector<float> random_floats(size_t n, uint64_t seed, float scale = 1.0f) {
  std::vector<float> v(n);
  uint64_t s = seed * 6364136223846793005ULL + 1442695040888963407ULL;
  for (auto& f : v) {
    s = s * 6364136223846793005ULL + 1442695040888963407ULL;
    f = scale * (static_cast<float>(s >> 40) / 8388608.0f - 1.0f);  // 2^23
  }
  return v;
}

// An evaluated MLX array of `dtype` holding `src`.
mx::array make_array(const std::vector<float>& src, mx::Shape shape, mx::Dtype dtype) {
  mx::array a = mx::astype(mx::array(src.data(), std::move(shape), mx::float32), dtype);
  mx::eval(a);
  return a;
}

// A plain buffer with the bytes of an evaluated row-contiguous MLX array.
Buffer buffer_of(const mx::array& a) {
  Buffer b(a.nbytes());
  std::memcpy(b.data(), a.data<char>(), a.nbytes());
  return b;
}

// ---- machine ---------------------------------------------------------------------

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("model name", 0) == 0) {
      auto colon = line.find(':');
      if (colon != std::string::npos) {
        auto s = line.substr(colon + 1);
        s.erase(0, s.find_first_not_of(" \t"));
        return s;
      }
    }
  }
  return "unknown";
}

std::string load_average() {
  std::ifstream f("/proc/loadavg");
  std::string a, b, c;
  f >> a >> b >> c;
  return a + " " + b + " " + c;
}

// MLX's buffer cache limit (bytes): freed buffers beyond it go back to the OS.
size_t mlx_cache_limit() {
  size_t old = mx::set_cache_limit(0);
  mx::set_cache_limit(old);
  return old;
}

std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    out += c;
  }
  return out;
}

// ---- bandwidth -------------------------------------------------------------------

struct Bandwidth {
  std::string kind;   // "copy" | "read"
  size_t bytes = 0;   // buffer size
  int threads = 0;
  Timing t;
  double gb_s = 0;    // counted bytes / median time
};

constexpr int64_t kBlock = 64 << 10;

Bandwidth copy_bandwidth(size_t bytes, int threads, const Config& cfg) {
  Buffer src(bytes), dst(bytes);
  std::memset(src.data(), 0x5a, bytes);
  const int64_t blocks = static_cast<int64_t>(bytes / kBlock);
  auto fn = [&] {
    // grain 16 blocks = 1 MB; parallel_for hands each thread a few big chunks
    cpu::parallel_for(blocks, 16, [&](int64_t b, int64_t e) {
      std::memcpy(dst.data() + b * kBlock, src.data() + b * kBlock, (e - b) * kBlock);
    });
  };
  Bandwidth r;
  r.kind = "copy";
  r.bytes = blocks * kBlock;
  r.threads = threads;
  r.t = measure(fn, threads, cfg);
  r.gb_s = 2.0 * r.bytes / r.t.median_s / 1e9;  // read + write
  return r;
}

uint64_t sum_words(const uint64_t* p, int64_t n) {
  uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    a0 += p[i];
    a1 += p[i + 1];
    a2 += p[i + 2];
    a3 += p[i + 3];
  }
  for (; i < n; ++i) a0 += p[i];
  return a0 + a1 + a2 + a3;
}

std::atomic<uint64_t> g_sink{0};

Bandwidth read_bandwidth(size_t bytes, int threads, const Config& cfg) {
  Buffer src(bytes);
  std::memset(src.data(), 0x11, bytes);
  const int64_t blocks = static_cast<int64_t>(bytes / kBlock);
  const auto* words = reinterpret_cast<const uint64_t*>(src.data());
  constexpr int64_t kWordsPerBlock = kBlock / 8;
  auto fn = [&] {
    cpu::parallel_for(blocks, 16, [&](int64_t b, int64_t e) {
      g_sink.fetch_add(sum_words(words + b * kWordsPerBlock, (e - b) * kWordsPerBlock),
                       std::memory_order_relaxed);
    });
  };
  Bandwidth r;
  r.kind = "read";
  r.bytes = blocks * kBlock;
  r.threads = threads;
  r.t = measure(fn, threads, cfg);
  r.gb_s = double(r.bytes) / r.t.median_s / 1e9;
  return r;
}

// ---- thread hand-off ----------------------------------------------------------

struct Dispatch {
  int threads_setting = 0;  // what set_num_threads got (0 = auto)
  int threads = 0;          // what num_threads() then answers
  Timing t;
};

// A parallel_for with no work: what a kernel pays to fan out and join.
Dispatch dispatch_overhead(int setting, const Config& cfg) {
  std::atomic<int64_t> items{0};
  auto fn = [&] {
    cpu::parallel_for(64, 1, [&](int64_t b, int64_t e) {
      items.fetch_add(e - b, std::memory_order_relaxed);
    });
  };
  Dispatch d;
  d.threads_setting = setting;
  cpu::set_num_threads(setting);
  d.threads = cpu::num_threads();
  d.t = measure(fn, setting, cfg);
  return d;
}

std::string dispatch_json(const Dispatch& d);

constexpr float kEps = 1e-5f;

// ---- MLX per-op overhead -------------------------------------------------------------

struct OpOverhead {
  std::string how;  // "eval each op" | "32 ops, one eval" | "raw kernel"
  int ops_per_call = 1;
  Timing t;         // per call (divide by ops_per_call for per op)
};

// rms_norm of one SmolLM2 row (576 float32): the work is ~0.1 us, so this is
// what one op costs through MLX when evaluated alone and when chained.
std::vector<OpOverhead> mlx_op_overhead(const Config& cfg) {
  constexpr int kChain = 32;
  const auto xv = random_floats(576, 7);
  std::vector<float> wv(576, 1.0f);
  mx::array x = make_array(xv, {1, 576}, mx::float32);
  mx::array w = make_array(wv, {576}, mx::float32);
  auto each = [&] { mx::eval(vm::rms_norm(x, w, kEps)); };
  auto chained = [&] {
    mx::array y = x;
    for (int i = 0; i < kChain; ++i) y = vm::rms_norm(y, w, kEps);
    mx::eval(y);
  };
  Buffer by(576 * 4);
  cpu::RmsNormRows a;
  a.x = x.data<float>();
  a.weight = w.data<float>();
  a.out = by.data();
  a.rows = 1;
  a.hidden = 576;
  a.x_row_stride = 576;
  a.eps = kEps;
  auto raw = [&] { cpu::rms_norm_rows(a); };
  auto ts = measure_group({{each, cfg.threads}, {chained, cfg.threads}, {raw, cfg.threads}}, cfg);
  return {{"eval each op", 1, ts[0]}, {"32 ops, one eval", kChain, ts[1]}, {"raw kernel", 1, ts[2]}};
}

// ---- ops -------------------------------------------------------------------------

struct Model {
  const char* name;
  int64_t hidden;
  int64_t kv_heads;
  int64_t head_size;
  int64_t block_size;
};

const Model kModels[] = {
    {"SmolLM2-135M", 576, 3, 64, 16},
    {"Llama-3-8B", 4096, 8, 128, 16},
};
const int64_t kRows[] = {1, 16, 512, 4096};
const mx::Dtype kDtypes[] = {mx::float32, mx::float16, mx::bfloat16};
const char* const kOps[] = {"rms_norm", "add_rms_norm", "reshape_and_cache"};
const char* const kPaths[] = {"mlx", "raw", "raw1t"};

struct Result {
  std::string op, model, dtype, path;
  int64_t rows = 0;   // rows (norms) or tokens (cache)
  std::string shape;  // human description of the per-row shape
  int threads = 0;
  int64_t bytes = 0;  // minimal bytes moved per call
  Timing t;
  double gb_s = 0;
  double ratio = 0;   // gb_s / threaded copy GB/s
  int cache_copies = -1;  // mlx reshape_and_cache: calls that did not update in place
};

Result make_result(const char* op, const Model& m, int64_t rows, mx::Dtype dtype,
                   const char* path, int threads, int64_t bytes, const Timing& t,
                   double copy_gb_s) {
  Result r;
  r.op = op;
  r.model = m.name;
  r.dtype = vm::dtype_name(dtype);
  r.path = path;
  r.rows = rows;
  r.threads = threads;
  r.bytes = bytes;
  r.t = t;
  r.gb_s = double(bytes) / t.median_s / 1e9;
  r.ratio = r.gb_s / copy_gb_s;
  if (std::string(op) == "reshape_and_cache") {
    r.shape = std::to_string(m.kv_heads) + "x" + std::to_string(m.head_size);
  } else {
    r.shape = std::to_string(m.hidden);
  }
  return r;
}

// The float data of one (model, rows) case; shared by every dtype and op.
struct CaseData {
  std::vector<float> x, residual, weight, key, value;
  std::vector<int64_t> slots;
  int64_t num_blocks = 0;
};

CaseData make_case(const Model& m, int64_t rows) {
  CaseData d;
  const size_t n = size_t(rows) * m.hidden;
  d.x = random_floats(n, 1);
  d.residual = random_floats(n, 2);
  d.weight = random_floats(m.hidden, 3);
  for (auto& w : d.weight) w = 1.0f + 0.1f * w;
  const size_t kv = size_t(rows) * m.kv_heads * m.head_size;
  d.key = random_floats(kv, 4);
  d.value = random_floats(kv, 5);
  // A paged cache with twice the blocks the step needs (at least 1024). Up to
  // 16 tokens model a decode batch: one token per sequence, each in its own
  // block. More tokens model a prefill: consecutive slots in shuffled blocks.
  const int64_t needed = (rows + m.block_size - 1) / m.block_size;
  d.num_blocks = std::max<int64_t>(1024, 2 * needed);
  std::vector<int64_t> perm(d.num_blocks);
  for (int64_t i = 0; i < d.num_blocks; ++i) perm[i] = i;
  uint64_t s = 12345;
  for (int64_t i = d.num_blocks - 1; i > 0; --i) {
    s = s * 6364136223846793005ULL + 1442695040888963407ULL;
    std::swap(perm[i], perm[(s >> 33) % uint64_t(i + 1)]);
  }
  d.slots.resize(rows);
  for (int64_t t = 0; t < rows; ++t) {
    if (rows <= 16) {
      d.slots[t] = perm[t] * m.block_size + (t * 5 + 3) % m.block_size;
    } else {
      d.slots[t] = perm[t / m.block_size] * m.block_size + t % m.block_size;
    }
  }
  return d;
}

// Three results (mlx, raw, raw1t) for one norm case.
void bench_norm(const Model& m, int64_t rows, mx::Dtype dtype, bool fused, const CaseData& d,
                const Config& cfg, double copy_gb_s, int threads, std::vector<Result>& out) {
  const char* op = fused ? "add_rms_norm" : "rms_norm";
  const int64_t isz = mx::size_of(dtype);
  const int64_t elems = rows * m.hidden;
  const int64_t bytes = (fused ? 4 : 2) * elems * isz + m.hidden * isz;
  const mx::Shape shape{static_cast<int>(rows), static_cast<int>(m.hidden)};
  mx::array x = make_array(d.x, shape, dtype);
  mx::array r = make_array(d.residual, shape, dtype);
  mx::array w = make_array(d.weight, {static_cast<int>(m.hidden)}, dtype);

  auto mlx_call = [&] {
    if (fused) {
      mx::eval(vm::add_rms_norm(x, r, w, kEps));
    } else {
      mx::eval(vm::rms_norm(x, w, kEps));
    }
  };

  Buffer bx = buffer_of(x), br = buffer_of(r), bw = buffer_of(w);
  Buffer by(elems * isz), bh(fused ? elems * isz : 0);
  cpu::RmsNormRows a;
  a.elt = vm::elt_of(dtype);
  a.x = bx.data();
  a.residual = fused ? br.data() : nullptr;
  a.weight = bw.data();
  a.out = by.data();
  a.residual_out = fused ? bh.data() : nullptr;
  a.rows = rows;
  a.hidden = m.hidden;
  a.x_row_stride = m.hidden;
  a.residual_row_stride = m.hidden;
  a.eps = kEps;
  auto raw = [&] { cpu::rms_norm_rows(a); };
  auto ts = measure_group({{mlx_call, cfg.threads}, {raw, cfg.threads}, {raw, 1}}, cfg);
  out.push_back(make_result(op, m, rows, dtype, "mlx", threads, bytes, ts[0], copy_gb_s));
  out.push_back(make_result(op, m, rows, dtype, "raw", threads, bytes, ts[1], copy_gb_s));
  out.push_back(make_result(op, m, rows, dtype, "raw1t", 1, bytes, ts[2], copy_gb_s));
}

void bench_cache(const Model& m, int64_t tokens, mx::Dtype dtype, const CaseData& d,
                 const Config& cfg, double copy_gb_s, int threads, std::vector<Result>& out) {
  const char* op = "reshape_and_cache";
  const int64_t isz = mx::size_of(dtype);
  const int64_t row = m.kv_heads * m.head_size;
  const int64_t bytes = 4 * tokens * row * isz;  // read k, v; write both slots
  const mx::Shape kv_shape{static_cast<int>(tokens), static_cast<int>(m.kv_heads),
                           static_cast<int>(m.head_size)};
  const mx::Shape cache_shape{static_cast<int>(d.num_blocks), static_cast<int>(m.block_size),
                              static_cast<int>(m.kv_heads), static_cast<int>(m.head_size)};
  mx::array k = make_array(d.key, kv_shape, dtype);
  mx::array v = make_array(d.value, kv_shape, dtype);
  mx::array slots(d.slots.data(), {static_cast<int>(tokens)}, mx::int64);
  mx::array kc = mx::zeros(cache_shape, dtype);
  mx::array vc = mx::zeros(cache_shape, dtype);
  mx::eval({slots, kc, vc});

  // The runtime's pattern: rebind the caches to the op's results, so the old
  // buffers have no other owner and the op updates them in place.
  int copies = 0;
  const char* kc_ptr = kc.data<char>();
  auto mlx_call = [&] {
    {
      auto o = vm::reshape_and_cache(k, v, kc, vc, slots);
      kc = o[0];
      vc = o[1];
    }
    mx::eval({kc, vc});
    if (kc.data<char>() != kc_ptr) {
      ++copies;
      kc_ptr = kc.data<char>();
    }
  };

  Buffer bk = buffer_of(k), bv = buffer_of(v);
  const size_t cache_bytes = size_t(d.num_blocks) * m.block_size * row * isz;
  Buffer bkc(cache_bytes), bvc(cache_bytes);
  cpu::CacheScatter a;
  a.key = bk.data();
  a.value = bv.data();
  a.slot_mapping = d.slots.data();
  a.key_cache = bkc.data();
  a.value_cache = bvc.data();
  const int64_t strides[3] = {row, m.head_size, 1};
  std::copy(strides, strides + 3, a.key_strides);
  std::copy(strides, strides + 3, a.value_strides);
  a.num_tokens = tokens;
  a.num_heads = m.kv_heads;
  a.head_size = m.head_size;
  a.num_slots = d.num_blocks * m.block_size;
  a.itemsize = isz;
  auto raw = [&] { cpu::scatter_into_cache(a); };
  auto ts = measure_group({{mlx_call, cfg.threads}, {raw, cfg.threads}, {raw, 1}}, cfg);
  Result rm = make_result(op, m, tokens, dtype, "mlx", threads, bytes, ts[0], copy_gb_s);
  rm.cache_copies = copies;
  out.push_back(rm);
  out.push_back(make_result(op, m, tokens, dtype, "raw", threads, bytes, ts[1], copy_gb_s));
  out.push_back(make_result(op, m, tokens, dtype, "raw1t", 1, bytes, ts[2], copy_gb_s));
}

// ---- output ----------------------------------------------------------------------

std::string human_bytes(double b) {
  char buf[32];
  if (b >= 1e6) {
    std::snprintf(buf, sizeof buf, "%.1f MB", b / 1e6);
  } else if (b >= 1e3) {
    std::snprintf(buf, sizeof buf, "%.1f KB", b / 1e3);
  } else {
    std::snprintf(buf, sizeof buf, "%.0f B", b);
  }
  return buf;
}

std::string timing_json(const Timing& t) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "\"us_per_call\": %.3f, \"us_min\": %.3f, \"iters\": %d, \"reps\": %d",
                t.median_s * 1e6, t.min_s * 1e6, t.iters, t.reps);
  return buf;
}

std::string bandwidth_json(const Bandwidth& b) {
  std::ostringstream s;
  char gb[32];
  std::snprintf(gb, sizeof gb, "%.2f", b.gb_s);
  s << "{\"bench\": \"bandwidth\", \"kind\": \"" << b.kind << "\", \"buffer_bytes\": " << b.bytes
    << ", \"threads\": " << b.threads << ", " << timing_json(b.t) << ", \"gb_s\": " << gb << "}";
  return s.str();
}

std::string dispatch_json(const Dispatch& d) {
  std::ostringstream s;
  s << "{\"bench\": \"dispatch\", \"threads_setting\": " << d.threads_setting
    << ", \"threads\": " << d.threads << ", " << timing_json(d.t) << "}";
  return s.str();
}

std::string overhead_json(const OpOverhead& o) {
  std::ostringstream s;
  char us[32];
  std::snprintf(us, sizeof us, "%.3f", o.t.median_s * 1e6 / o.ops_per_call);
  s << "{\"bench\": \"mlx_op_overhead\", \"how\": \"" << o.how
    << "\", \"ops_per_call\": " << o.ops_per_call << ", \"us_per_op\": " << us << ", "
    << timing_json(o.t) << "}";
  return s.str();
}

std::string result_json(const Result& r) {
  std::ostringstream s;
  char nums[96];
  std::snprintf(nums, sizeof nums, "\"gb_s\": %.3f, \"ratio_to_copy\": %.4f", r.gb_s, r.ratio);
  s << "{\"bench\": \"kernel\", \"op\": \"" << r.op << "\", \"model\": \"" << r.model
    << "\", \"dtype\": \"" << r.dtype << "\", \"rows\": " << r.rows << ", \"shape\": \""
    << r.shape << "\", \"path\": \"" << r.path << "\", \"threads\": " << r.threads
    << ", \"bytes\": " << r.bytes << ", " << timing_json(r.t) << ", " << nums;
  if (r.cache_copies >= 0) s << ", \"cache_in_place\": " << (r.cache_copies == 0 ? "true" : "false");
  s << "}";
  return s.str();
}

const Result* find(const std::vector<Result>& rs, const std::string& op, const std::string& model,
                   int64_t rows, const std::string& dtype, const std::string& path) {
  for (const auto& r : rs) {
    if (r.op == op && r.model == model && r.rows == rows && r.dtype == dtype && r.path == path) {
      return &r;
    }
  }
  return nullptr;
}

void print_tables(const std::vector<Result>& rs) {
  for (const char* op : kOps) {
    const bool cache = std::string(op) == "reshape_and_cache";
    std::printf("\n== %s  (%s) ==\n", op,
                cache ? "bytes: read k, v + write both slots"
                      : (std::string(op) == "rms_norm" ? "bytes: read x + weight, write out"
                                                       : "bytes: read x, residual + weight, "
                                                         "write out, residual_out"));
    std::printf("%-13s %-6s %-8s %5s %9s |", "model", "shape", "dtype", cache ? "toks" : "rows",
                "moved");
    for (const char* p : kPaths) std::printf(" %9s %7s %5s |", (std::string(p) + " us").c_str(), "GB/s", "xcopy");
    std::printf("\n");
    for (const auto& m : kModels) {
      for (int64_t rows : kRows) {
        for (auto dt : kDtypes) {
          const std::string dname = vm::dtype_name(dt);
          const Result* first = find(rs, op, m.name, rows, dname, "mlx");
          if (!first) continue;
          std::printf("%-13s %-6s %-8s %5lld %9s |", m.name, first->shape.c_str(), dname.c_str(),
                      static_cast<long long>(rows), human_bytes(first->bytes).c_str());
          for (const char* p : kPaths) {
            const Result* r = find(rs, op, m.name, rows, dname, p);
            if (!r) {
              std::printf(" %9s %7s %5s |", "-", "-", "-");
              continue;
            }
            std::printf(" %9.2f %7.2f %5.2f%s|", r->t.median_s * 1e6, r->gb_s, r->ratio,
                        r->cache_copies > 0 ? "!" : " ");
          }
          std::printf("\n");
        }
      }
    }
  }
}

int usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s [--quick] [--json PATH] [--threads N] [--reps N]\n"
               "  --quick      ~5 s run: shorter repetitions, rows/tokens up to 512\n"
               "  --json PATH  also write the whole run as one JSON document\n"
               "  --threads N  kernel threads (default 0 = all cores)\n"
               "  --reps N     timed repetitions per case (median reported)\n"
               "  --mlx-cache-limit MB  set MLX's buffer cache limit (default: MLX's own)\n",
               argv0);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Config cfg;
  int reps_override = 0;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--quick") {
      cfg.quick = true;
    } else if (a == "--json" && i + 1 < argc) {
      cfg.json_path = argv[++i];
    } else if (a == "--threads" && i + 1 < argc) {
      cfg.threads = std::atoi(argv[++i]);
    } else if (a == "--reps" && i + 1 < argc) {
      reps_override = std::atoi(argv[++i]);
    } else if (a == "--mlx-cache-limit" && i + 1 < argc) {
      cfg.mlx_cache_limit_mb = std::atol(argv[++i]);
    } else {
      return usage(argv[0]);
    }
  }
  if (cfg.quick) {
    cfg.reps = 3;
    cfg.rep_seconds = 0.002;
  }
  if (reps_override > 0) cfg.reps = reps_override;
  cpu::set_num_threads(cfg.threads);
  const int threads = cpu::num_threads();
  if (cfg.mlx_cache_limit_mb >= 0) mx::set_cache_limit(size_t(cfg.mlx_cache_limit_mb) << 20);
  const auto t_start = Clock::now();
  const std::string load_before = load_average();

  std::printf("kernel_bench  cpu: %s  hw threads: %u  kernel threads: %d (--threads %d)  "
              "avx2+fma: %s\n",
              cpu_model().c_str(), std::thread::hardware_concurrency(), threads, cfg.threads,
              cpu::has_avx2_fma() ? "yes" : "no");
  std::printf("mlx %s  device: %s  mlx cache limit: %.0f MB  mode: %s  load average: %s\n",
              mx::version(), mx::default_device() == mx::Device::cpu ? "cpu" : "gpu",
              mlx_cache_limit() / 1048576.0, cfg.quick ? "quick" : "full", load_before.c_str());

  // ---- 1. bandwidth --------------------------------------------------------------
  std::vector<Bandwidth> bws;
  bws.push_back(copy_bandwidth(cfg.copy_bytes, threads, cfg));
  bws.push_back(copy_bandwidth(cfg.copy_bytes, 1, cfg));
  bws.push_back(read_bandwidth(cfg.copy_bytes, threads, cfg));
  bws.push_back(read_bandwidth(cfg.copy_bytes, 1, cfg));
  // Cache-resident reference: 8 MB source + 8 MB destination fit the 32 MB L3.
  bws.push_back(copy_bandwidth(size_t(8) << 20, threads, cfg));
  bws.push_back(copy_bandwidth(size_t(8) << 20, 1, cfg));
  const double copy_gb_s = bws[0].gb_s;
  std::printf("\n== memory bandwidth (median of %d) ==\n", cfg.reps);
  std::printf("%-5s %9s %7s %10s %8s\n", "kind", "buffer", "threads", "ms/pass", "GB/s");
  for (const auto& b : bws) {
    std::printf("%-5s %9s %7d %10.3f %8.2f%s\n", b.kind.c_str(), human_bytes(b.bytes).c_str(),
                b.threads, b.t.median_s * 1e3, b.gb_s,
                &b == &bws[0] ? "   <- roofline (xcopy below)" : "");
  }
  std::printf("copy counts read + write bytes; read counts bytes read.\n");

  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<Dispatch> dispatches;
  for (int setting : {0, hw, 1}) dispatches.push_back(dispatch_overhead(setting, cfg));
  std::printf("\n== parallel_for with no work (64 items, grain 1): fan-out + join ==\n");
  std::printf("%-26s %7s %10s\n", "set_num_threads", "threads", "us/call");
  for (const auto& d : dispatches) {
    std::printf("%-26s %7d %10.2f\n",
                (std::to_string(d.threads_setting) + (d.threads_setting == 0 ? " (auto)" : "")).c_str(),
                d.threads, d.t.median_s * 1e6);
  }

  const auto overheads = mlx_op_overhead(cfg);
  std::printf("\n== MLX per-op overhead: rms_norm, SmolLM2 1 row float32 ==\n");
  std::printf("%-18s %10s\n", "how", "us/op");
  for (const auto& o : overheads) {
    std::printf("%-18s %10.2f\n", o.how.c_str(), o.t.median_s * 1e6 / o.ops_per_call);
  }

  // ---- 2. ops --------------------------------------------------------------------
  std::vector<Result> results;
  for (const auto& m : kModels) {
    for (int64_t rows : kRows) {
      if (cfg.quick && rows > 512) continue;  // --quick: decode and mid-size steps only
      CaseData d = make_case(m, rows);
      for (auto dt : kDtypes) {
        bench_norm(m, rows, dt, false, d, cfg, copy_gb_s, threads, results);
        bench_norm(m, rows, dt, true, d, cfg, copy_gb_s, threads, results);
        bench_cache(m, rows, dt, d, cfg, copy_gb_s, threads, results);
        mx::clear_cache();
      }
      std::fprintf(stderr, ".");
      std::fflush(stderr);
    }
  }
  std::fprintf(stderr, "\n");

  std::printf("\nmedian of %d repetitions; us = microseconds per call; xcopy = GB/s over the "
              "%.2f GB/s threaded copy\n",
              cfg.reps, copy_gb_s);
  std::printf("mlx = MLX op + mx::eval; raw = CPU kernel on plain buffers, %d threads; "
              "raw1t = the same on 1 thread\n",
              threads);
  print_tables(results);
  bool any_copy = false;
  for (const auto& r : results) any_copy |= r.cache_copies > 0;
  if (any_copy) std::printf("! = the MLX reshape_and_cache copied the cache instead of updating it in place\n");

  const double total = seconds_since(t_start);
  std::printf("\n# JSON (one object per line)\n");
  for (const auto& b : bws) std::printf("%s\n", bandwidth_json(b).c_str());
  for (const auto& d : dispatches) std::printf("%s\n", dispatch_json(d).c_str());
  for (const auto& o : overheads) std::printf("%s\n", overhead_json(o).c_str());
  for (const auto& r : results) std::printf("%s\n", result_json(r).c_str());
  const std::string load_after = load_average();
  std::printf("\ntotal %.1f s  load average before: %s  after: %s\n", total, load_before.c_str(),
              load_after.c_str());

  if (!cfg.json_path.empty()) {
    std::ofstream f(cfg.json_path);
    if (!f) {
      std::fprintf(stderr, "cannot write %s\n", cfg.json_path.c_str());
      return 1;
    }
    f << "{\n  \"machine\": {\"cpu\": \"" << json_escape(cpu_model())
      << "\", \"hw_threads\": " << std::thread::hardware_concurrency()
      << ", \"kernel_threads\": " << threads << ", \"threads_flag\": " << cfg.threads
      << ", \"mlx_cache_limit_bytes\": " << mlx_cache_limit()
      << ", \"load_before\": \"" << load_before << "\", \"load_after\": \"" << load_after << "\""
      << ", \"avx2_fma\": " << (cpu::has_avx2_fma() ? "true" : "false") << ", \"mlx\": \""
      << mx::version() << "\"},\n  \"mode\": \"" << (cfg.quick ? "quick" : "full")
      << "\",\n  \"copy_gb_s\": " << copy_gb_s << ",\n  \"bandwidth\": [\n";
    for (size_t i = 0; i < bws.size(); ++i) {
      f << "    " << bandwidth_json(bws[i]) << (i + 1 < bws.size() ? "," : "") << "\n";
    }
    f << "  ],\n  \"dispatch\": [\n";
    for (size_t i = 0; i < dispatches.size(); ++i) {
      f << "    " << dispatch_json(dispatches[i]) << (i + 1 < dispatches.size() ? "," : "") << "\n";
    }
    f << "  ],\n  \"mlx_op_overhead\": [\n";
    for (size_t i = 0; i < overheads.size(); ++i) {
      f << "    " << overhead_json(overheads[i]) << (i + 1 < overheads.size() ? "," : "") << "\n";
    }
    f << "  ],\n  \"results\": [\n";
    for (size_t i = 0; i < results.size(); ++i) {
      f << "    " << result_json(results[i]) << (i + 1 < results.size() ? "," : "") << "\n";
    }
    f << "  ],\n  \"seconds\": " << total << "\n}\n";
  }
  return 0;
}
