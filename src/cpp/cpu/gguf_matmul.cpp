#include "cpu/gguf_matmul.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <stdexcept>
#include <utility>
#include <vector>

#include "cpu/batch_invariant.h"
#include "cpu/gelu.h"
#include "cpu/gguf_kernels.h"
#include "cpu/gguf_pool.h"
#include "cpu/gguf_quants.h"
#include "cpu/parallel.h"

#if defined(__aarch64__) && defined(__linux__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif

// ---- the NEON tables: gguf_dot_neon.h twice, without and with dotprod ---------------------
#if defined(__aarch64__)
namespace vllm_metal::cpu::neon_plain {
#define GGUF_NEON_DOT 0
#include "cpu/gguf_dot_neon.h"
#undef GGUF_NEON_DOT
}  // namespace vllm_metal::cpu::neon_plain

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("dotprod"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+dotprod")
#endif
namespace vllm_metal::cpu::neon_dot {
#define GGUF_NEON_DOT 1
#include "cpu/gguf_dot_neon.h"
#undef GGUF_NEON_DOT
}  // namespace vllm_metal::cpu::neon_dot
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace vllm_metal::cpu {
const GgufKernels& gguf_kernels_neon() {
  static const GgufKernels t = neon_plain::make_neon_kernels("neon");
  return t;
}
const GgufKernels& gguf_kernels_neon_dot() {
  static const GgufKernels t = neon_dot::make_neon_kernels("neon_dot");
  return t;
}
}  // namespace vllm_metal::cpu
#endif  // __aarch64__

namespace vllm_metal::cpu {

namespace {

using gguf::GGMLType;

// ---- which kernels ------------------------------------------------------------------------

struct Isa {
  const char* name;
  const GgufKernels& (*table)();
  bool (*supported)();
};

bool always() { return true; }
#if defined(__x86_64__)
bool has_avx512_vnni() {
  static const bool ok = has_avx2_fma() && __builtin_cpu_supports("avx512f") &&
                         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni");
  return ok;
}
const Isa kIsas[] = {{"avx512", gguf_kernels_avx512, has_avx512_vnni},
                     {"avx2", gguf_kernels_avx2, has_avx2_fma},
                     {"scalar", gguf_kernels_scalar, always}};
#elif defined(__aarch64__)
bool has_dotprod() {
#if defined(__APPLE__)
  return true;  // every Apple Silicon core has FEAT_DotProd
#elif defined(__linux__) && defined(HWCAP_ASIMDDP)
  static const bool ok = (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
  return ok;
#else
  return false;
#endif
}
const Isa kIsas[] = {{"neon_dot", gguf_kernels_neon_dot, has_dotprod},
                     {"neon", gguf_kernels_neon, always},
                     {"scalar", gguf_kernels_scalar, always}};
#else
const Isa kIsas[] = {{"scalar", gguf_kernels_scalar, always}};
#endif

std::atomic<const GgufKernels*> g_selected{nullptr};

const GgufKernels& best_kernels() {
  for (const Isa& isa : kIsas) {
    if (isa.supported()) return isa.table();
  }
  return gguf_kernels_scalar();
}

const GgufKernels& kernels() {
  const GgufKernels* k = g_selected.load(std::memory_order_acquire);
  if (k == nullptr) {
    k = &best_kernels();
    g_selected.store(k, std::memory_order_release);
  }
  return *k;
}

// ---- element conversions --------------------------------------------------------------------

// y[i, c0 .. c0 + nc) = src[i * lds + (0 .. nc)] for i < m, y [m, n] in elt.
void store_block(Elt elt, const float* src, int64_t lds, int64_t m, int64_t nc, void* y,
                 int64_t n, int64_t c0) {
  const size_t elt_bytes = elt == Elt::kF32 ? 4 : 2;
  for (int64_t i = 0; i < m; ++i) {
    from_floats(elt, src + i * lds, nc, static_cast<char*>(y) + (i * n + c0) * elt_bytes);
  }
}

// The bias (as float32) and activation applied to float sums before they are stored.
struct Epilogue {
  const float* bias = nullptr;  // [n]
  GgufActivation act = GgufActivation::kNone;
  bool any() const { return bias != nullptr || act != GgufActivation::kNone; }
};

// a's epilogue; a bias in half precision is widened into buf.
Epilogue make_epilogue(const GgufMatmul& a, std::vector<float>& buf) {
  Epilogue e;
  e.act = a.activation;
  if (a.bias != nullptr) {
    if (a.elt == Elt::kF32) {
      e.bias = static_cast<const float*>(a.bias);
    } else {
      buf.resize(a.n);
      to_floats(a.elt, a.bias, a.n, buf.data());
      e.bias = buf.data();
    }
  }
  return e;
}

// y[i, j] = act(y[i, j] + bias[c0 + j]) for i < m, j < nc (float sums of outputs c0 ..).
void apply_epilogue(const Epilogue& e, float* y, int64_t ldy, int64_t m, int64_t nc, int64_t c0) {
  if (!e.any()) return;
  for (int64_t i = 0; i < m; ++i) {
    float* r = y + i * ldy;
    if (e.bias != nullptr) {
      const float* b = e.bias + c0;
      for (int64_t j = 0; j < nc; ++j) r[j] += b[j];
    }
    if (e.act != GgufActivation::kNone) gelu_inplace_f32(r, nc, e.act == GgufActivation::kGeluTanh);
  }
}

// Per-thread scratch, kept across calls (no allocation per call in steady state).
float* scratch_floats(std::vector<float>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}
// n bytes at an `align`-byte boundary inside v.
uint8_t* aligned_bytes(std::vector<uint8_t>& v, size_t n, size_t align) {
  if (v.size() < n + align) v.resize(n + align);
  const auto p = reinterpret_cast<uintptr_t>(v.data());
  return v.data() + (align - p % align) % align;
}

// The integer path (x rounded to 8-bit blocks) serves the types with an integer kernel,
// unless the caller asked for exact float sums.
bool int8_path(const GgufKernels& kern, GGMLType type, bool exact) {
  const int tid = static_cast<int>(type);
  return !exact && kern.float_dot[tid] == nullptr && kern.q8_dot[tid] != nullptr;
}

// Rows up to which the mat-vec passes (and, on the integer path, panels) serve a call:
// every row count where the type has panels; kGgufInt8MaxRows on the rest of the integer
// path; kGgufExactMaxRows where an exact kernel dots straight from the blocks (passes of 8
// rows re-decode the weights in registers, cheaper than decoding them to float tiles up to
// about 24 rows: benchmarks/gguf_bench.py); else kGgufMatvecMaxRows.
constexpr int64_t kGgufExactMaxRows = 24;
// Batch-invariant mode: one path serves every row count, so a row never moves between
// kernels that sum in different orders as the batch changes. Float32 sums: the mat-vec
// passes, whose kernels sum a row alike whatever the pass size (gguf_dot_*.h); from 64 rows
// they take 1.2-1.4x the default's float tiles. Integer path: the weight panels where the
// type has them, from one row up (1.27x the one-row kernel at one row, free from 16 rows,
// where passes of 8 would cost 2.7x: docs/benchmarks.md, "Batch invariance"), else the
// mat-vec passes.
int64_t matvec_max_rows(const GgufKernels& kern, GGMLType type, bool exact) {
  if (batch_invariant()) return INT64_MAX;
  const int tid = static_cast<int>(type);
  if (int8_path(kern, type, exact)) {
    return kern.q8_pack[tid] != nullptr ? INT64_MAX : kGgufInt8MaxRows;
  }
  if (kern.float_dot[tid] == nullptr && kern.exact_dot[tid] != nullptr) return kGgufExactMaxRows;
  return kGgufMatvecMaxRows;
}

// From this many rows the integer path decodes weight panels once for all rows instead of
// dotting each weight block with passes of 8 rows (benchmarks/gguf_bench.py).
constexpr int64_t kGgufPanelMinRows = 9;

// ---- decode rows: m <= kGgufMatvecMaxRows, or kGgufInt8MaxRows on the integer path ------------

// Rows i0 .. i0 + rows of x.
GgufQ8Rows q8_rows(const GgufQ8Rows& x, int64_t i0, int64_t rows) {
  const int64_t nb = x.k / kGgufQ8Block;
  GgufQ8Rows r = x;
  r.m = rows;
  r.q = x.q + i0 * x.k;
  r.d = x.d + i0 * nb;
  r.dsum = x.dsum + i0 * nb;
  r.sum16 = x.sum16 + i0 * 2 * nb;
  r.dsum16 = x.dsum16 ? x.dsum16 + i0 * 2 * nb : nullptr;
  r.dpair = x.dpair ? x.dpair + i0 * 2 * nb : nullptr;
  r.neg_qsum = x.neg_qsum ? x.neg_qsum + i0 * nb : nullptr;
  return r;
}

// Weight bytes one task should read at least, so that a claim from the spinning pool
// (well under a microsecond) stays small against the work it carries. Smaller tasks
// balance a small matrix better over the threads: 48 KB split SmolLM2's 576 x 576 Q4_1
// into 5 tasks, 3 of them on one thread; 16 KB took 2 threads 1.18 -> 1.09 ms over 120
// such mat-vecs (2026-12-04, Xeon VM, interleaved runs).
constexpr int64_t kMinTaskBytes = 16 << 10;
constexpr int64_t kDecodeRows = 16;  // rows decoded to float together (types without int path)

// One weight matrix's decode rows: which kernel dots them and with what x.
struct MatvecPlan {
  const GgufMatmul* a = nullptr;
  const GgufKernels* kern = nullptr;
  const float* xf = nullptr;
  GgufQ8Rows xq;
  int64_t rb = 0;
  GgufFloatDotFn fdot = nullptr;  // float weights
  GgufQ8DotFn qdot = nullptr;     // integer path (x rounded to 8 bits)
  GgufFloatDotFn edot = nullptr;  // `exact` straight from the blocks
  GgufQ8PackFn pack = nullptr;    // integer path, many rows: weight panels
  Epilogue epi;

  // Weight rows one pool task should take at least (kMinTaskBytes of them; whole panels).
  int64_t grain() const {
    const int64_t g = std::max<int64_t>(1, kMinTaskBytes / std::max<int64_t>(1, rb));
    const int64_t cols = kern->q8_panel_cols;
    return pack ? (g + cols - 1) / cols * cols : g;
  }

  void rows(int64_t begin, int64_t end) const {
    if (pack) return panel_rows(begin, end);
    const int64_t m = a->m, n = a->n, k = a->k;
    const auto* w = static_cast<const uint8_t*>(a->w);
    const bool direct = a->elt == Elt::kF32;  // results straight into y
    static thread_local std::vector<float> ybuf, wbuf;
    for (int64_t r0 = begin; r0 < end;) {
      // float results go straight into y; the rest through a buffer of 16 rows,
      // as do the weights of types decoded to float first
      const bool whole = direct && (fdot || qdot || edot);
      const int64_t nr = whole ? end - r0 : std::min(kDecodeRows, end - r0);
      float* y = direct ? static_cast<float*>(a->y) + r0 : scratch_floats(ybuf, m * nr);
      const int64_t ldy = direct ? n : nr;
      const uint8_t* wr = w + r0 * rb;
      if (fdot) {
        for (int64_t i0 = 0; i0 < m; i0 += kGgufMatvecMaxRows) {
          fdot(wr, rb, nr, xf + i0 * k, std::min(kGgufMatvecMaxRows, m - i0), k, y + i0 * ldy, ldy);
        }
      } else if (edot) {
        for (int64_t i0 = 0; i0 < m; i0 += kGgufMatvecMaxRows) {
          edot(wr, rb, nr, xf + i0 * k, std::min(kGgufMatvecMaxRows, m - i0), k, y + i0 * ldy, ldy);
        }
      } else if (qdot) {
        // x rows in passes of up to 8 over the same (cached) weight rows
        for (int64_t i0 = 0; i0 < m; i0 += kGgufMatvecMaxRows) {
          qdot(wr, rb, nr, q8_rows(xq, i0, std::min(kGgufMatvecMaxRows, m - i0)), y + i0 * ldy,
               ldy);
        }
      } else {
        float* wf = scratch_floats(wbuf, nr * k);
        gguf_decode_row(a->type, wr, nr * k, wf);
        const GgufFloatDotFn dot = kern->float_dot[static_cast<int>(GGMLType::kF32)];
        for (int64_t i0 = 0; i0 < m; i0 += kGgufMatvecMaxRows) {
          dot(reinterpret_cast<const uint8_t*>(wf), 4 * k, nr, xf + i0 * k,
              std::min(kGgufMatvecMaxRows, m - i0), k, y + i0 * ldy, ldy);
        }
      }
      apply_epilogue(epi, y, ldy, m, nr, r0);
      if (!direct) store_block(a->elt, y, ldy, m, nr, a->y, n, r0);
      r0 += nr;
    }
  }

  // Weight rows begin .. end (begin a multiple of the panel width) as panels, each
  // dotted with all of x; float32 results go straight into y, others through a float
  // buffer of a few panels converted together (one conversion per panel and row would
  // cost more than it converts).
  void panel_rows(int64_t begin, int64_t end) const {
    const int64_t m = a->m, n = a->n, k = a->k;
    const auto* w = static_cast<const uint8_t*>(a->w);
    const int halves = gguf_q8_panel_halves(a->type);
    static thread_local std::vector<uint8_t> ubuf;
    static thread_local std::vector<float> sbuf, ybuf;
    GgufQ8Panel panel;
    panel.cols = kern->q8_panel_cols;
    const int64_t pc = panel.cols;
    panel.u = aligned_bytes(ubuf, k * pc, 64);
    float* scales = scratch_floats(sbuf, 2 * (k / 32) * halves * pc);
    panel.a = scales;
    panel.c = scales + (k / 32) * halves * pc;
    const int64_t buffer_cols = 8 * pc;
    for (int64_t c0 = begin; c0 < end; c0 += buffer_cols) {
      const int64_t cols = std::min(buffer_cols, end - c0);
      const bool direct = a->elt == Elt::kF32 && cols % pc == 0;
      float* y = direct ? static_cast<float*>(a->y) + c0 : scratch_floats(ybuf, m * buffer_cols);
      const int64_t ldy = direct ? n : buffer_cols;
      for (int64_t r0 = c0; r0 < c0 + cols; r0 += pc) {
        const int nr = static_cast<int>(std::min(pc, end - r0));
        pack(w + r0 * rb, rb, nr, k, panel);
        kern->q8_panel_dot(panel, xq, y + (r0 - c0), ldy);
      }
      apply_epilogue(epi, y, ldy, m, cols, c0);
      if (!direct) store_block(a->elt, y, ldy, m, cols, a->y, n, c0);
    }
  }
};

// Storage of x rounded to 8-bit blocks (quantize_x).
struct Q8Buffers {
  std::vector<int8_t> q_buf;
  std::vector<float> d_buf;
  std::vector<int16_t> s16_buf;
  std::vector<int32_t> qsum_buf;
};

// x rounded to 8-bit blocks in `b`, with every form of the block scales and sums that some
// kernel reads.
GgufQ8Rows quantize_x_into(const GgufKernels& kern, const float* xf, int64_t m, int64_t k,
                           Q8Buffers& b) {
  auto& [q_buf, d_buf, s16_buf, qsum_buf] = b;
  const int64_t nb = m * k / 32;
  if (static_cast<int64_t>(q_buf.size()) < m * k) q_buf.resize(m * k);
  if (static_cast<int64_t>(d_buf.size()) < 6 * nb) d_buf.resize(6 * nb);
  if (static_cast<int64_t>(s16_buf.size()) < 2 * nb) s16_buf.resize(2 * nb);
  if (static_cast<int64_t>(qsum_buf.size()) < nb) qsum_buf.resize(nb);
  float* d = d_buf.data();  // d [nb] | dsum [nb] | dsum16 [2 nb] | dpair [2 nb]
  float* dsum = d + nb;
  float* dsum16 = d + 2 * nb;
  float* dpair = d + 4 * nb;
  const int16_t* s16 = s16_buf.data();
  kern.quantize_q8(xf, m, k, q_buf.data(), d, dsum, s16_buf.data());
  for (int64_t b = 0; b < nb; ++b) {
    dsum16[2 * b] = d[b] * static_cast<float>(s16[2 * b]);
    dsum16[2 * b + 1] = d[b] * static_cast<float>(s16[2 * b + 1]);
    dpair[2 * b] = d[b];
    dpair[2 * b + 1] = dsum[b];
    qsum_buf[b] = -(static_cast<int32_t>(s16[2 * b]) + s16[2 * b + 1]);
  }
  GgufQ8Rows r{m, k, q_buf.data(), d, dsum, s16, dsum16};
  r.dpair = dpair;
  r.neg_qsum = qsum_buf.data();
  return r;
}

// The same in per-thread buffers kept across calls.
GgufQ8Rows quantize_x(const GgufKernels& kern, const float* xf, int64_t m, int64_t k) {
  static thread_local Q8Buffers buffers;
  return quantize_x_into(kern, xf, m, k, buffers);
}

// `xq` may already hold x rounded to 8 bits (xq.q != null), else it is made when needed.
MatvecPlan plan_matvec(const GgufKernels& kern, const GgufMatmul& a, const float* xf,
                       GgufQ8Rows& xq, const Epilogue& epi) {
  MatvecPlan p;
  p.a = &a;
  p.epi = epi;
  p.kern = &kern;
  p.xf = xf;
  p.rb = gguf::row_bytes(a.type, a.k);
  const int tid = static_cast<int>(a.type);
  p.fdot = kern.float_dot[tid];
  p.qdot = int8_path(kern, a.type, a.exact) ? kern.q8_dot[tid] : nullptr;
  p.edot = p.fdot || p.qdot ? nullptr : kern.exact_dot[tid];
  const bool panels_from_one_row = batch_invariant();  // see matvec_max_rows
  if (p.qdot && kern.q8_panel_dot != nullptr && (a.m >= kGgufPanelMinRows || panels_from_one_row)) {
    p.pack = kern.q8_pack[tid];
  }
  if (p.qdot) {
    if (xq.q == nullptr) xq = quantize_x(kern, xf, a.m, a.k);
    p.xq = xq;
  }
  return p;
}

void matvec(const GgufKernels& kern, const GgufMatmul& a, const float* xf, const Epilogue& epi) {
  GgufQ8Rows xq;
  const MatvecPlan p = plan_matvec(kern, a, xf, xq, epi);
  // panels: split the work on whole panels
  const int64_t unit = p.pack ? kern.q8_panel_cols : 1;
  gguf_parallel_for((a.n + unit - 1) / unit, p.grain() / unit, [&](int64_t begin, int64_t end) {
    p.rows(begin * unit, std::min(a.n, end * unit));
  });
}

// x [m, k] -> d * q, the values the integer decode path multiplies.
void round_through_q8(const GgufKernels& kern, const float* x, int64_t m, int64_t k, float* out) {
  const int64_t nb = m * k / kGgufQ8Block;
  std::vector<int8_t> q(m * k);
  std::vector<float> d(2 * nb);
  std::vector<int16_t> s16(2 * nb);
  kern.quantize_q8(x, m, k, q.data(), d.data(), d.data() + nb, s16.data());
  for (int64_t b = 0; b < nb; ++b) {
    const float scale = d[b];
    for (int l = 0; l < kGgufQ8Block; ++l) {
      out[b * kGgufQ8Block + l] = scale * static_cast<float>(q[b * kGgufQ8Block + l]);
    }
  }
}

// ---- prefill: m > kGgufMatvecMaxRows ----------------------------------------------------------

// Blocking (GotoBLAS-style, for every row count): a task owns a block of up to kBlockRows
// x rows and up to kTaskRows weight rows. Its x rows are packed into panels of 16 (once per
// thread and block, below); per chunk of kChunkK input features it decodes its weight rows
// to float once (96 KB); each strip of panel_rows weight rows then stays in L1 while the x panels
// stream from L2. Sums accumulate in the task's [kBlockRows, kTaskRows] tile (48 KB).
// Before, a task owned weight rows only and streamed all of x and an [m, 96] tile per
// chunk: at 16384 rows that left L2, and the float32 GEMM ran at half speed
// (docs/benchmarks.md, encoder embeddings). A row's sums keep the same order whatever
// block it falls in, so results do not depend on the batch.
constexpr int64_t kTaskRows = 96;
constexpr int64_t kChunkK = 256;  // a multiple of every block size
// float32 weights need no decode buffer: longer chunks store the tile half as often
// (a whole MiniLM row of 384 in one chunk)
constexpr int64_t kChunkKF32 = 512;
constexpr int64_t kBlockRows = 128;  // x rows per task: a multiple of kGgufPanelWidth

// Rows i0 .. i0 + rows of x, features c0 .. c0 + kc, as panels of W rows ([panel][kc][W],
// zero rows after the last).
void pack_x_panels(const float* xf, int64_t k, int64_t i0, int64_t rows, int64_t c0, int64_t kc,
                   float* xp) {
  constexpr int64_t W = kGgufPanelWidth;
  const int64_t panels = (rows + W - 1) / W;
  for (int64_t g = 0; g < panels; ++g) {
    float* dst = xp + g * kc * W;
    const int64_t n_in = std::min(W, rows - g * W);
    for (int64_t i = 0; i < n_in; ++i) {
      const float* src = xf + (i0 + g * W + i) * k + c0;
      for (int64_t p = 0; p < kc; ++p) dst[p * W + i] = src[p];
    }
    for (int64_t i = n_in; i < W; ++i) {
      for (int64_t p = 0; p < kc; ++p) dst[p * W + i] = 0.0f;
    }
  }
}

// Calls of prefill, so that a thread's packed x block is known to belong to this call.
std::atomic<uint64_t> g_prefill_calls{0};

// ---- prefill on weight panels (kern.weight_panel) ---------------------------------------

// A task owns a group of up to kWeightGroupCols weight rows and a run of x row blocks. It
// lays its weight rows out once as panels of kGgufWeightPanelCols, [panel][k][cols] (F32
// transposed, other types decoded), then for each block of kBlockRows x rows and each
// chunk of k runs the kernel on up to kGgufWeightPanelRows x rows read in place: no x
// packing, and the 16 x 12 panel's transposing scalar stores become vector stores into
// the [kBlockRows, group] tile. The chunks of k are the float tiles' and each output's sum
// runs over k in order wherever its row sits, so a row's result does not depend on the call
// (results equal the float tiles' to the last bit or so: docs/gguf.md).
constexpr int64_t kWeightGroupCols = 3 * kGgufWeightPanelCols;
// Below this many x rows laying the weights out costs more than the kernel saves (MiniLM's
// projections on Zen 4: level at 64 rows, 1.2-1.6x slower at 16, 8-17 % faster at 512).
constexpr int64_t kWeightPanelMinRows = 64;

// Weight rows r0 .. r0 + nr as panels (zero columns pad the last), by the table's layout
// kernel.
void lay_out_weight_panels(const GgufKernels& kern, GGMLType type, const uint8_t* w, int64_t rb,
                           int64_t r0, int64_t nr, int64_t k, float* wp, std::vector<float>& row_buf) {
  constexpr int64_t C = kGgufWeightPanelCols;
  // the rows as floats: F32 in place, other types decoded into row_buf
  const float* rows = reinterpret_cast<const float*>(w + r0 * rb);
  int64_t ld = rb / 4;
  if (type != GGMLType::kF32) {
    float* decoded = scratch_floats(row_buf, nr * k);
    for (int64_t j = 0; j < nr; ++j) gguf_decode_row(type, w + (r0 + j) * rb, k, decoded + j * k);
    rows = decoded;
    ld = k;
  }
  for (int64_t j0 = 0; j0 < nr; j0 += C) {
    kern.lay_out_panel(rows + j0 * ld, ld, static_cast<int>(std::min(C, nr - j0)), k,
                       wp + (j0 / C) * k * C);
  }
}

void prefill_weight_panels(const GgufKernels& kern, const GgufMatmul& a, const float* xf,
                           const Epilogue& epi) {
  const int64_t m = a.m, n = a.n, k = a.k;
  constexpr int64_t C = kGgufWeightPanelCols, G = kWeightGroupCols;
  const int64_t rb = gguf::row_bytes(a.type, k);
  const auto* w = static_cast<const uint8_t*>(a.w);
  const int64_t chunk = a.type == GGMLType::kF32 ? kChunkKF32 : kChunkK;
  const int64_t blocks = (m + kBlockRows - 1) / kBlockRows;
  const int64_t groups = (n + G - 1) / G;
  // about two tasks per thread: few weight groups share out their x blocks in runs
  const int64_t want_runs = std::clamp<int64_t>((2 * num_threads() + groups - 1) / groups, 1, blocks);
  const int64_t per_run = (blocks + want_runs - 1) / want_runs;  // x blocks a task
  const int64_t runs = (blocks + per_run - 1) / per_run;
  const uint64_t call = g_prefill_calls.fetch_add(1, std::memory_order_relaxed) + 1;
  char* y = static_cast<char*>(a.y);
  const int64_t elt_bytes = a.elt == Elt::kF32 ? 4 : 2;
  // the bias goes into the kernel's last store (the sums in the order of before, then the
  // bias, as the separate pass did); the activation runs on the finished tile
  const Epilogue act_only{nullptr, epi.act};
  // task t: weight group t / runs, row run t % runs; a thread's consecutive tasks on one
  // group lay its panels (and bias) out once
  gguf_parallel_for(groups * runs, 1, [&](int64_t begin, int64_t end) {
    static thread_local std::vector<float> wbuf, acc_buf, row_buf, bias_buf;
    static thread_local uint64_t laid_call = 0;
    static thread_local int64_t laid_group = -1;
    float* acc = scratch_floats(acc_buf, kBlockRows * G);
    float* group_bias = scratch_floats(bias_buf, G);  // zero past the group's last row
    if (static_cast<int64_t>(wbuf.size()) < G * k) laid_call = 0;
    float* wp = scratch_floats(wbuf, G * k);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t group = t / runs, run = t % runs;
      const int64_t r0 = group * G, nr = std::min(G, n - r0), panels = (nr + C - 1) / C;
      if (laid_call != call || laid_group != group) {
        lay_out_weight_panels(kern, a.type, w, rb, r0, nr, k, wp, row_buf);
        if (epi.bias != nullptr) {
          std::copy(epi.bias + r0, epi.bias + r0 + nr, group_bias);
          std::fill(group_bias + nr, group_bias + G, 0.0f);
        }
        laid_call = call;
        laid_group = group;
      }
      const int64_t b_end = std::min(blocks, (run + 1) * per_run);
      for (int64_t block = run * per_run; block < b_end; ++block) {
        const int64_t i0 = block * kBlockRows, rows = std::min(kBlockRows, m - i0);
        for (int64_t c0 = 0; c0 < k; c0 += chunk) {
          const int64_t kc = std::min(chunk, k - c0);
          const bool biased = epi.bias != nullptr && c0 + kc == k;
          for (int64_t i = 0; i < rows; i += kGgufWeightPanelRows) {
            const int r = static_cast<int>(std::min<int64_t>(kGgufWeightPanelRows, rows - i));
            for (int64_t pnl = 0; pnl < panels; ++pnl) {
              kern.weight_panel(xf + (i0 + i) * k + c0, k, r, wp + pnl * k * C + c0 * C, kc,
                                acc + i * G + pnl * C, G, c0 > 0,
                                biased ? group_bias + pnl * C : nullptr);
            }
          }
        }
        apply_epilogue(act_only, acc, G, rows, nr, r0);
        store_block(a.elt, acc, G, rows, nr, y + i0 * n * elt_bytes, n, r0);
      }
    }
  });
}

void prefill(const GgufKernels& kern, const GgufMatmul& a, const float* xf, const Epilogue& epi) {
  if (kern.weight_panel != nullptr && kern.lay_out_panel != nullptr && a.m >= kWeightPanelMinRows) {
    return prefill_weight_panels(kern, a, xf, epi);
  }
  const int64_t m = a.m, n = a.n, k = a.k;
  constexpr int64_t W = kGgufPanelWidth;
  const gguf::TypeInfo ti = gguf::type_info(a.type);
  const int64_t rb = gguf::row_bytes(a.type, k);
  const auto* w = static_cast<const uint8_t*>(a.w);
  const bool w_is_f32 = a.type == GGMLType::kF32;
  const int64_t pr = kern.panel_rows;
  const int64_t chunk = w_is_f32 ? kChunkKF32 : kChunkK;
  const int64_t blocks = (m + kBlockRows - 1) / kBlockRows;
  // weight rows per task: at most kTaskRows, and about two tasks per thread overall
  const int64_t want = (2 * num_threads() + blocks - 1) / blocks;  // weight groups wanted
  const int64_t per_group = (n + want - 1) / want;
  const int64_t group = std::min(kTaskRows, std::max(pr, (per_group + pr - 1) / pr * pr));
  const int64_t groups = (n + group - 1) / group;
  const uint64_t call = g_prefill_calls.fetch_add(1, std::memory_order_relaxed) + 1;
  // task t: x block t / groups, weight group t % groups. A thread packs its x block (all
  // chunks, [chunk][panel][kc][16]) once for the run of tasks it takes on that block:
  // packing it per task cost ~15% of a MiniLM projection at 16 weight groups.
  gguf_parallel_for(blocks * groups, 1, [&](int64_t begin, int64_t end) {
    static thread_local std::vector<float> wbuf, acc_buf, xbuf;
    static thread_local uint64_t packed_call = 0;
    static thread_local int64_t packed_block = -1;
    float* acc = scratch_floats(acc_buf, kBlockRows * group);  // [block rows, group]
    if (static_cast<int64_t>(xbuf.size()) < kBlockRows * k) packed_call = 0;
    float* xp = scratch_floats(xbuf, kBlockRows * k);
    float* wc = w_is_f32 ? nullptr : scratch_floats(wbuf, group * kChunkK);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = t / groups;
      const int64_t i0 = block * kBlockRows, rows = std::min(kBlockRows, m - i0);
      const int64_t panels = (rows + W - 1) / W;
      const int64_t r0 = (t % groups) * group, nr = std::min(group, n - r0);
      if (packed_call != call || packed_block != block) {
        for (int64_t c0 = 0; c0 < k; c0 += chunk) {
          pack_x_panels(xf, k, i0, rows, c0, std::min(chunk, k - c0), xp + c0 * kBlockRows);
        }
        packed_call = call;
        packed_block = block;
      }
      for (int64_t c0 = 0; c0 < k; c0 += chunk) {
        const int64_t kc = std::min(chunk, k - c0);
        const float* xc = xp + c0 * kBlockRows;  // this chunk's panels
        const float* wf;  // this chunk of the task's rows
        int64_t ldw;
        if (w_is_f32) {
          wf = reinterpret_cast<const float*>(w + r0 * rb) + c0;
          ldw = k;
        } else {
          const int64_t off = c0 / ti.block_size * ti.type_size;
          for (int64_t j = 0; j < nr; ++j) gguf_decode_row(a.type, w + (r0 + j) * rb + off, kc, wc + j * kc);
          wf = wc;
          ldw = kc;
        }
        for (int64_t j = 0; j < nr; j += pr) {
          for (int64_t g = 0; g < panels; ++g) {
            kern.panel(xc + g * kc * W, wf + j * ldw, ldw, static_cast<int>(std::min(pr, nr - j)),
                       kc, acc + g * W * group + j, group, c0 > 0);
          }
        }
      }
      apply_epilogue(epi, acc, group, rows, nr, r0);
      store_block(a.elt, acc, group, rows, nr,
                  static_cast<char*>(a.y) + i0 * n * (a.elt == Elt::kF32 ? 4 : 2), n, r0);
    }
  });
}

// x [m, k] as float32: a.x itself, or converted into buf.
const float* x_as_float(const GgufMatmul& a, std::vector<float>& buf) {
  if (a.elt == Elt::kF32) return static_cast<const float*>(a.x);
  buf.resize(a.m * a.k);
  to_floats(a.elt, a.x, a.m * a.k, buf.data());
  return buf.data();
}

}  // namespace

void gguf_matmul(const GgufMatmul& a) {
  if (a.m == 0 || a.n == 0) return;
  const GgufKernels& kern = kernels();
  std::vector<float> xbuf;
  const float* xf = x_as_float(a, xbuf);
  std::vector<float> bias_buf;
  const Epilogue epi = make_epilogue(a, bias_buf);
  const bool int8 = int8_path(kern, a.type, a.exact);
  if (a.m <= matvec_max_rows(kern, a.type, a.exact)) {
    matvec(kern, a, xf, epi);
    return;
  }
  // The integer path multiplies x rounded to 8-bit blocks; larger calls round x the same
  // way before their float tiles, so a row's result does not depend on how many rows
  // share the call (a request decoded alone or in a batch gets the same tokens).
  if (int8) {
    std::vector<float> rounded(a.m * a.k);
    round_through_q8(kern, xf, a.m, a.k, rounded.data());
    prefill(kern, a, rounded.data(), epi);
    return;
  }
  prefill(kern, a, xf, epi);
}

namespace {

// Decode-row plans of several calls as one pool job: each call's weight rows in segments of
// its plan's grain, the segments of all calls spread over the pool.
void run_matvec_plans(const std::vector<MatvecPlan>& plans) {
  struct Segment {
    size_t plan;
    int64_t begin, end;
  };
  std::vector<Segment> segments;
  for (size_t i = 0; i < plans.size(); ++i) {
    const int64_t n = plans[i].a->n, grain = plans[i].grain();
    for (int64_t r = 0; r < n; r += grain) segments.push_back({i, r, std::min(n, r + grain)});
  }
  gguf_parallel_for(static_cast<int64_t>(segments.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      plans[segments[s].plan].rows(segments[s].begin, segments[s].end);
    }
  });
}

}  // namespace

void gguf_matmul_group(const GgufMatmul* mats, int count) {
  if (count <= 0) return;
  const GgufMatmul& a0 = mats[0];
  const GgufKernels& kern = kernels();
  bool decode_rows = a0.m > 0;
  for (int i = 0; i < count; ++i) {
    const GgufMatmul& a = mats[i];
    if (a.x != a0.x || a.m != a0.m || a.k != a0.k || a.elt != a0.elt) {
      throw std::invalid_argument("gguf_matmul_group: the matrices must share x, m, k and elt");
    }
    decode_rows = decode_rows && a.n > 0 && a.m <= matvec_max_rows(kern, a.type, a.exact);
  }
  if (!decode_rows) {  // prefill sizes: each call already fills the pool
    for (int i = 0; i < count; ++i) gguf_matmul(mats[i]);
    return;
  }
  std::vector<float> xbuf;
  const float* xf = x_as_float(a0, xbuf);
  GgufQ8Rows xq;  // rounded once, shared by every matrix on the integer path
  std::vector<MatvecPlan> plans;
  std::vector<std::vector<float>> bias_bufs(count);
  for (int i = 0; i < count; ++i) {
    plans.push_back(plan_matvec(kern, mats[i], xf, xq, make_epilogue(mats[i], bias_bufs[i])));
  }
  run_matvec_plans(plans);
}

void gguf_matmul_batch(const GgufMatmul* mats, int count) {
  const GgufKernels& kern = kernels();
  std::vector<int> decode;  // the calls of decode rows, run together below
  for (int i = 0; i < count; ++i) {
    const GgufMatmul& a = mats[i];
    if (a.m == 0 || a.n == 0) continue;
    if (a.m <= matvec_max_rows(kern, a.type, a.exact)) {
      decode.push_back(i);
    } else {
      gguf_matmul(a);  // prefill sizes: each call already fills the pool
    }
  }
  const size_t n = decode.size();
  if (n == 0) return;
  // each call's x as float and rounded to 8 bits in its own buffers (sized once: the
  // plans point into them)
  std::vector<std::vector<float>> x_bufs(n), bias_bufs(n);
  std::vector<Q8Buffers> q8_bufs(n);
  std::vector<MatvecPlan> plans;
  for (size_t j = 0; j < n; ++j) {
    const GgufMatmul& a = mats[decode[j]];
    const float* xf = x_as_float(a, x_bufs[j]);
    GgufQ8Rows xq;
    if (int8_path(kern, a.type, a.exact)) xq = quantize_x_into(kern, xf, a.m, a.k, q8_bufs[j]);
    plans.push_back(plan_matvec(kern, a, xf, xq, make_epilogue(a, bias_bufs[j])));
  }
  run_matvec_plans(plans);
}

bool gguf_matmul_int8_activations(GGMLType type) {
  return static_cast<int>(type) < kGgufNumTypeIds && int8_path(kernels(), type, false);
}

std::vector<std::string> gguf_matmul_isas() {
  std::vector<std::string> out;
  for (const Isa& isa : kIsas) {
    if (isa.supported()) out.emplace_back(isa.name);
  }
  return out;
}

void gguf_matmul_set_isa(const std::string& name) {
  if (name.empty()) {
    g_selected.store(&best_kernels(), std::memory_order_release);
    return;
  }
  for (const Isa& isa : kIsas) {
    if (name == isa.name && isa.supported()) {
      g_selected.store(&isa.table(), std::memory_order_release);
      return;
    }
  }
  throw std::invalid_argument("[gguf_matmul] kernel variant '" + name +
                              "' is unknown or not supported by this CPU");
}

std::string gguf_matmul_isa() { return kernels().name; }

}  // namespace vllm_metal::cpu
