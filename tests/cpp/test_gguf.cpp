// GGUF on the CPU without MLX: the reader on in-memory files, block decoding
// and the quantized matmul against decode-then-naive-matmul. MLX-free, so the
// arm64 cross-build (tests/py/test_arm64_cpu_kernels.py) runs it for NEON.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu/batch_invariant.h"
#include "cpu/gguf_kernels.h"
#include "cpu/gguf_matmul.h"
#include "cpu/gguf_pool.h"
#include "cpu/gguf_quants.h"
#include "cpu/parallel.h"
#include "runtime/gguf_reader.h"

namespace c = vllm_metal::cpu;
namespace g = vllm_metal::gguf;

namespace {

// ---- a tiny GGUF encoder -------------------------------------------------------------

struct Bytes {
  std::vector<uint8_t> b;
  template <typename T>
  Bytes& put(T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    b.insert(b.end(), p, p + sizeof(T));
    return *this;
  }
  Bytes& str(const std::string& s) {
    put<uint64_t>(s.size());
    b.insert(b.end(), s.begin(), s.end());
    return *this;
  }
  void pad(size_t align) {
    while (b.size() % align) b.push_back(0);
  }
};

std::vector<uint8_t> sample_file() {
  Bytes f;
  f.put<uint32_t>(0x46554747).put<uint32_t>(3).put<uint64_t>(2).put<uint64_t>(3);
  f.str("general.architecture").put<uint32_t>(8).str("llama");
  f.str("n").put<uint32_t>(4).put<uint32_t>(7);
  f.str("scores").put<uint32_t>(9).put<uint32_t>(6).put<uint64_t>(2).put<float>(0.5f).put<float>(-2.0f);
  f.str("w").put<uint32_t>(2).put<uint64_t>(32).put<uint64_t>(2).put<uint32_t>(2).put<uint64_t>(0);
  f.str("b").put<uint32_t>(1).put<uint64_t>(3).put<uint32_t>(0).put<uint64_t>(64);
  f.pad(32);
  size_t data = f.b.size();
  f.b.resize(data + 64 + 12, 0x11);
  return f.b;
}

TEST(GgufReader, ParsesMetadataAndTensors) {
  auto bytes = sample_file();
  auto f = g::GGUFFile::parse(bytes.data(), bytes.size());
  EXPECT_EQ(f->version(), 3u);
  EXPECT_EQ(f->get("general.architecture").as_string(), "llama");
  EXPECT_EQ(f->get("n").as_int(), 7);
  EXPECT_EQ(f->get("scores").count, 2u);
  EXPECT_FLOAT_EQ(f->get("scores").array_float(1), -2.0f);
  ASSERT_EQ(f->tensors().size(), 2u);
  const auto& w = f->tensor("w");
  EXPECT_EQ(w.type, g::GGMLType::kQ4_0);
  EXPECT_EQ(w.nbytes, 36u);
  EXPECT_EQ(w.shape(), (std::vector<int64_t>{2, 32}));
  EXPECT_EQ(f->tensor("b").data, bytes.data() + f->data_offset() + 64);
  EXPECT_EQ(f->find("nope"), nullptr);
}

TEST(GgufReader, EveryTruncationThrows) {
  auto bytes = sample_file();
  for (size_t n = 0; n < bytes.size(); ++n) {
    std::vector<uint8_t> cut(bytes.begin(), bytes.begin() + n);
    EXPECT_THROW(g::GGUFFile::parse(cut.data(), cut.size()), g::GGUFError) << n;
  }
}

TEST(GgufReader, MessagesNameTheProblem) {
  auto bytes = sample_file();
  bytes[0] = 'X';
  try {
    g::GGUFFile::parse(bytes.data(), bytes.size());
    FAIL();
  } catch (const g::GGUFError& e) {
    EXPECT_NE(std::string(e.what()).find("bad magic"), std::string::npos) << e.what();
  }
}

// ---- decoding and matmul ----------------------------------------------------------------

const g::GGMLType kTypes[] = {
    g::GGMLType::kF32,  g::GGMLType::kF16,  g::GGMLType::kBF16,   g::GGMLType::kQ4_0,
    g::GGMLType::kQ4_1, g::GGMLType::kQ5_0, g::GGMLType::kQ5_1,   g::GGMLType::kQ8_0,
    g::GGMLType::kQ2_K, g::GGMLType::kQ3_K, g::GGMLType::kQ4_K,   g::GGMLType::kQ5_K,
    g::GGMLType::kQ6_K, g::GGMLType::kIQ4_NL, g::GGMLType::kIQ4_XS, g::GGMLType::kIQ3_S,
    g::GGMLType::kIQ3_XXS, g::GGMLType::kMXFP4};

// Byte offsets of the float16 scales of each block (random bytes elsewhere).
std::vector<int> scale_offsets(g::GGMLType t) {
  switch (t) {
    case g::GGMLType::kQ4_1: case g::GGMLType::kQ5_1: case g::GGMLType::kQ4_K:
    case g::GGMLType::kQ5_K: return {0, 2};
    case g::GGMLType::kQ2_K: return {80, 82};
    case g::GGMLType::kQ3_K: return {108};
    case g::GGMLType::kQ6_K: return {208};
    default: return {0};
  }
}

std::vector<uint8_t> random_weights(g::GGMLType t, int64_t n, int64_t k, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  g::TypeInfo ti = g::type_info(t);
  std::vector<uint8_t> w(n * g::row_bytes(t, k));
  if (ti.block_size == 1) {
    for (int64_t i = 0; i < n * k; ++i) {
      float v = u(rng);
      if (t == g::GGMLType::kF32) std::memcpy(&w[4 * i], &v, 4);
      uint16_t h = t == g::GGMLType::kF16 ? c::float_to_f16(v) : c::float_to_bf16(v);
      if (t != g::GGMLType::kF32) std::memcpy(&w[2 * i], &h, 2);
    }
    return w;
  }
  for (auto& b : w) b = static_cast<uint8_t>(rng());
  for (size_t blk = 0; blk < w.size() / ti.type_size; ++blk) {
    if (t == g::GGMLType::kMXFP4) {  // an E8M0 exponent byte: scales 2^-8 .. 2^0 (of 2^-255 .. 2^127)
      w[blk * ti.type_size] = static_cast<uint8_t>(119 + rng() % 9);
      continue;
    }
    for (int off : scale_offsets(t)) {
      uint16_t h = c::float_to_f16(u(rng) * 0.05f);
      std::memcpy(&w[blk * ti.type_size + off], &h, 2);
    }
  }
  return w;
}

TEST(GgufCpu, DequantizeRowsMatchesDecodeRowInEveryDtype) {
  for (auto t : kTypes) {
    const int64_t k = g::type_info(t).block_size == 1 ? 13 : 512, n = 5;
    auto w = random_weights(t, n, k, 1);
    std::vector<float> ref(n * k), f32(n * k);
    for (int64_t r = 0; r < n; ++r) {
      c::gguf_decode_row(t, w.data() + r * g::row_bytes(t, k), k, ref.data() + r * k);
    }
    std::vector<uint16_t> f16(n * k), bf16(n * k);
    c::GgufDequantizeRows a;
    a.type = t;
    a.blocks = w.data();
    a.rows = n;
    a.cols = k;
    a.out = f32.data();
    c::gguf_dequantize_rows(a);
    a.out_elt = c::Elt::kF16;
    a.out = f16.data();
    c::gguf_dequantize_rows(a);
    a.out_elt = c::Elt::kBF16;
    a.out = bf16.data();
    c::gguf_dequantize_rows(a);
    for (int64_t i = 0; i < n * k; ++i) {
      ASSERT_TRUE(std::isfinite(ref[i])) << g::type_name(uint32_t(t));
      ASSERT_EQ(f32[i], ref[i]);
      ASSERT_EQ(f16[i], c::float_to_f16(ref[i]));
      ASSERT_EQ(bf16[i], c::float_to_bf16(ref[i]));
    }
  }
}

TEST(GgufCpu, KnownQ4_0AndQ8_0Values) {
  uint8_t q4[18] = {};
  uint16_t one = c::float_to_f16(0.5f);
  std::memcpy(q4, &one, 2);
  for (int j = 0; j < 16; ++j) q4[2 + j] = static_cast<uint8_t>(j | ((15 - j) << 4));
  float y[32];
  c::gguf_block_decoder(g::GGMLType::kQ4_0)(q4, y);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(y[j], 0.5f * (j - 8));
    EXPECT_EQ(y[j + 16], 0.5f * (7 - j));
  }
  uint8_t q8[34] = {};
  std::memcpy(q8, &one, 2);
  for (int j = 0; j < 32; ++j) q8[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(j * 8 - 128));
  c::gguf_block_decoder(g::GGMLType::kQ8_0)(q8, y);
  for (int j = 0; j < 32; ++j) EXPECT_EQ(y[j], 0.5f * (j * 8 - 128));
}

// ---- matmul against x @ decode(W)^T in double -------------------------------------------------

// Types whose activations are rounded to 8 bits (every row count, unless exact).
const g::GGMLType kInt8Types[] = {g::GGMLType::kQ4_0, g::GGMLType::kQ4_1, g::GGMLType::kQ5_0,
                                  g::GGMLType::kQ5_1, g::GGMLType::kQ8_0, g::GGMLType::kQ4_K,
                                  g::GGMLType::kQ5_K, g::GGMLType::kQ6_K, g::GGMLType::kMXFP4};

bool int8_path(g::GGMLType t) {
  for (auto u : kInt8Types) {
    if (u == t) return true;
  }
  return false;
}

// The one tolerance table of these tests.
// Float paths (float weights, types without an integer kernel, `exact`) sum exact
// weights times x in float32: max |y - ref| / max |ref| <= kFloatTol[elt] (one
// rounding of the output in elt).
// The int8 path rounds x to 8 bits per value (a float scale d = max|x| / 127 per 32,
// llama.cpp's scheme), an error of about |w| d / sqrt(12) per output. Measured as
// rms(y - ref) / rms(|x_i| |w_j| / sqrt(k)): the error against the size an output of
// those rows typically has, which no accidental cancellation in ref can shrink. Expected
// about 0.0052 for Gaussian x; the bounds are 1.5x the largest of 900 random cases here
// and 750 in tests/py/test_gguf_matmul.py (same table there), + kFloatTol[elt].
const std::map<c::Elt, double> kFloatTol = {
    {c::Elt::kF32, 2e-5}, {c::Elt::kF16, 2e-3}, {c::Elt::kBF16, 1.6e-2}};
const std::map<g::GGMLType, double> kInt8Tol = {
    {g::GGMLType::kQ4_0, 0.015}, {g::GGMLType::kQ4_1, 0.018}, {g::GGMLType::kQ5_0, 0.015},
    {g::GGMLType::kQ5_1, 0.021}, {g::GGMLType::kQ8_0, 0.015}, {g::GGMLType::kQ4_K, 0.023},
    {g::GGMLType::kQ5_K, 0.021}, {g::GGMLType::kQ6_K, 0.018}, {g::GGMLType::kMXFP4, 0.015}};

std::string case_name(g::GGMLType t, int64_t m, int64_t n, int64_t k, c::Elt elt) {
  const char* dt = elt == c::Elt::kF32 ? "f32" : elt == c::Elt::kF16 ? "f16" : "bf16";
  return "gguf_matmul(" + g::type_name(uint32_t(t)) + ",m=" + std::to_string(m) +
         ",n=" + std::to_string(n) + ",k=" + std::to_string(k) + ",dt=" + dt +
         ",isa=" + c::gguf_matmul_isa() + ")";
}

// Runs gguf_matmul; returns y as float.
std::vector<float> run_matmul(g::GGMLType t, const std::vector<uint8_t>& w, int64_t n, int64_t k,
                              const std::vector<float>& x, const std::vector<uint16_t>& xh,
                              int64_t m, c::Elt elt, bool exact = false) {
  std::vector<float> y(m * n);
  std::vector<uint16_t> yh(m * n);
  c::GgufMatmul a;
  a.type = t;
  a.w = w.data();
  a.n = n;
  a.k = k;
  a.elt = elt;
  a.x = elt == c::Elt::kF32 ? static_cast<const void*>(x.data()) : xh.data();
  a.m = m;
  a.y = elt == c::Elt::kF32 ? static_cast<void*>(y.data()) : yh.data();
  a.exact = exact;
  c::gguf_matmul(a);
  if (elt == c::Elt::kF16) {
    for (int64_t i = 0; i < m * n; ++i) y[i] = c::f16_to_float(yh[i]);
  } else if (elt == c::Elt::kBF16) {
    for (int64_t i = 0; i < m * n; ++i) y[i] = c::bf16_to_float(yh[i]);
  }
  return y;
}

// x [m, k] ~ N(0, 1), rounded to elt; xh holds the elt bits.
std::vector<float> random_x(int64_t m, int64_t k, c::Elt elt, uint32_t seed,
                            std::vector<uint16_t>* xh) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> x(m * k);
  xh->assign(m * k, 0);
  for (int64_t i = 0; i < m * k; ++i) {
    x[i] = nd(rng);
    if (elt == c::Elt::kF16) {
      (*xh)[i] = c::float_to_f16(x[i]);
      x[i] = c::f16_to_float((*xh)[i]);
    } else if (elt == c::Elt::kBF16) {
      (*xh)[i] = c::float_to_bf16(x[i]);
      x[i] = c::bf16_to_float((*xh)[i]);
    }
  }
  return x;
}

void check_matmul(g::GGMLType t, int64_t m, int64_t n, int64_t k, c::Elt elt, bool exact = false) {
  auto w = random_weights(t, n, k, static_cast<uint32_t>(m * 31 + n));
  std::vector<float> wf(n * k);
  c::gguf_decode_row(t, w.data(), n * k, wf.data());
  std::vector<uint16_t> xh;
  std::vector<float> x = random_x(m, k, elt, 7, &xh);
  std::vector<float> y = run_matmul(t, w, n, k, x, xh, m, elt, exact);
  double scale = 0, worst = 0, se = 0, typical = 0;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double ref = 0, xx = 0, ww = 0;
      for (int64_t p = 0; p < k; ++p) {
        ref += double(x[i * k + p]) * wf[j * k + p];
        xx += double(x[i * k + p]) * x[i * k + p];
        ww += double(wf[j * k + p]) * wf[j * k + p];
      }
      const double got = y[i * n + j];
      ASSERT_TRUE(std::isfinite(got)) << case_name(t, m, n, k, elt);
      scale = std::max(scale, std::fabs(ref));
      worst = std::max(worst, std::fabs(got - ref));
      se += (got - ref) * (got - ref);
      typical += xx * ww / k;
    }
  }
  if (int8_path(t) && !exact) {
    const double tol = kInt8Tol.at(t) + kFloatTol.at(elt);
    EXPECT_LE(std::sqrt(se / typical), tol) << case_name(t, m, n, k, elt) << " (int8 rms error)";
  } else {
    EXPECT_LE(worst / scale, kFloatTol.at(elt)) << case_name(t, m, n, k, elt);
  }
}

// Runs fn once per kernel variant this CPU has (AVX-512 / AVX2 / NEON dotprod / NEON / scalar).
template <class F>
void for_each_isa(F fn) {
  for (const std::string& isa : c::gguf_matmul_isas()) {
    c::gguf_matmul_set_isa(isa);
    fn();
  }
  c::gguf_matmul_set_isa("");
}

TEST(GgufCpu, MatmulEveryTypeAgainstDecodedWeights) {
  for_each_isa([] {
    for (auto t : kTypes) {
      int64_t bs = g::type_info(t).block_size;
      int64_t k = bs == 1 ? 37 : (bs == 32 ? 96 : 512);
      for (int64_t m : {1, 2, 3, 4, 5, 7, 8, 9, 17}) check_matmul(t, m, 19, k, c::Elt::kF32);
    }
  });
}

// A row's result must not depend on how many rows share the call (decode alone vs in a
// batch, mat-vec vs tiles): every path rounds x the same way, so only the order of float
// sums differs.
TEST(GgufCpu, RowResultIndependentOfBatchSize) {
  for_each_isa([] {
    for (auto t : kTypes) {
      const int64_t bs = g::type_info(t).block_size;
      const int64_t n = 23, k = bs == 1 ? 64 : (bs == 32 ? 96 : 512);
      const std::vector<uint8_t> w = random_weights(t, n, k, 11);
      std::mt19937 rng(5);
      std::normal_distribution<float> normal;
      std::vector<float> batch(300 * k);  // 300 > kGgufInt8MaxRows: the float tiles too
      for (auto& v : batch) v = normal(rng);
      const std::vector<float> alone = run_matmul(t, w, n, k, batch, {}, 1, c::Elt::kF32);
      double scale = 0;
      for (float v : alone) scale = std::max(scale, double(std::fabs(v)));
      for (int64_t m : {8, 9, 17, 40, 300}) {
        const std::vector<float> y = run_matmul(t, w, n, k, batch, {}, m, c::Elt::kF32);
        for (int64_t j = 0; j < n; ++j) {
          ASSERT_NEAR(y[j], alone[j], 2e-6 * scale) << case_name(t, m, n, k, c::Elt::kF32);
        }
      }
    }
  });
}

// Batch-invariant mode: row r of any batch is bit-identical to the same row multiplied
// alone, for every type, activation scheme, element type, ISA, row count and thread count.
TEST(GgufCpu, BatchInvariantRowsAreBitIdentical) {
  c::set_batch_invariant(true);
  std::mt19937 pick(29);
  for (int threads : {1, 2}) {
    c::set_num_threads(threads);
    for_each_isa([&] {
      for (auto t : kTypes) {
        const int64_t bs = g::type_info(t).block_size;
        const int64_t n = 37, k = bs == 1 ? 64 : (bs == 32 ? 608 : 512);
        const std::vector<uint8_t> w = random_weights(t, n, k, 13);
        for (c::Elt elt : {c::Elt::kF32, c::Elt::kF16, c::Elt::kBF16}) {
          for (bool exact : {false, true}) {
            // a batch size from 1 to 40 (and once 300, beyond every row-count switch)
            const int64_t m = threads == 1 && elt == c::Elt::kF32 ? 300 : 1 + pick() % 40;
            std::vector<uint16_t> xh;
            const std::vector<float> x = random_x(m, k, elt, 7 + m, &xh);
            const std::vector<float> y = run_matmul(t, w, n, k, x, xh, m, elt, exact);
            for (int64_t r : {int64_t(0), m / 2, m - 1}) {
              const std::vector<float> xr(x.begin() + r * k, x.begin() + (r + 1) * k);
              const std::vector<uint16_t> xhr(xh.begin() + r * k, xh.begin() + (r + 1) * k);
              const std::vector<float> alone = run_matmul(t, w, n, k, xr, xhr, 1, elt, exact);
              for (int64_t j = 0; j < n; ++j) {
                ASSERT_EQ(y[r * n + j], alone[j])
                    << case_name(t, m, n, k, elt) << " row " << r << " col " << j
                    << (exact ? " exact" : " int8") << " isa " << c::gguf_matmul_isa()
                    << " threads " << threads;
              }
            }
          }
        }
      }
    });
  }
  c::set_num_threads(0);
  c::set_batch_invariant(false);
}

TEST(GgufCpu, ExactMatmulKeepsFloatSumsForDecodeRows) {
  for_each_isa([] {
    for (auto t : kInt8Types) {
      // 608: 19 blocks of 32, scales converted in vectors of 8 and 16 with a tail
      const bool b32 = g::type_info(t).block_size == 32;
      for (int64_t k : b32 ? std::vector<int64_t>{96, 608} : std::vector<int64_t>{512}) {
        for (int64_t m : {1, 2, 3, 5, 8, 13, 24, 25}) check_matmul(t, m, 19, k, c::Elt::kF32, /*exact=*/true);
      }
    }
  });
}

TEST(GgufCpu, MatmulHalfActivationsAndThreads) {
  for (int threads : {1, 2, 3}) {
    c::set_num_threads(threads);
    for_each_isa([] {
      check_matmul(g::GGMLType::kQ4_K, 1, 70, 512, c::Elt::kF16);
      check_matmul(g::GGMLType::kQ6_K, 17, 33, 256, c::Elt::kBF16);
      check_matmul(g::GGMLType::kQ4_1, 6, 40, 576, c::Elt::kF16);
      check_matmul(g::GGMLType::kQ8_0, 8, 300, 96, c::Elt::kBF16);  // several tasks
      check_matmul(g::GGMLType::kBF16, 3, 301, 40, c::Elt::kF16);
      check_matmul(g::GGMLType::kQ3_K, 2, 45, 256, c::Elt::kBF16);  // decoded to float
    });
  }
  c::set_num_threads(0);
}

// The integer form of every chunk (w = a * q + c per 16-weight half) is the float
// decoder's value, bit for bit.
TEST(GgufCpu, Q8ChunksMatchTheFloatDecoder) {
  for (auto t : kInt8Types) {
    const g::TypeInfo ti = g::type_info(t);
    auto w = random_weights(t, 1, 4 * ti.block_size, 11);
    std::vector<float> ref(4 * ti.block_size);
    c::gguf_decode_row(t, w.data(), 4 * ti.block_size, ref.data());
    for (int blk = 0; blk < 4; ++blk) {
      for (int j = 0; j < static_cast<int>(ti.block_size / 32); ++j) {
        c::GgufQ8Chunk ch;
        ASSERT_TRUE(c::gguf_q8_chunk(t, w.data() + blk * ti.type_size, j, &ch));
        for (int l = 0; l < 32; ++l) {
          const float v = ch.a[l / 16] * static_cast<float>(ch.q[l]) + ch.c[l / 16];
          ASSERT_EQ(v, ref[blk * ti.block_size + 32 * j + l])
              << g::type_name(uint32_t(t)) << " block " << blk << " chunk " << j << " weight " << l;
        }
      }
    }
  }
  c::GgufQ8Chunk ch;
  uint8_t block[256] = {};
  EXPECT_FALSE(c::gguf_q8_chunk(g::GGMLType::kIQ4_XS, block, 0, &ch));
}

// Every variant quantizes exactly like the scalar reference: q = round-half-even(x * 127 /
// max|x|), |x - d q| <= d / 2, zero blocks give d = 0.
TEST(GgufCpu, QuantizeActivationsRoundToNearestOnEveryIsa) {
  const int64_t m = 3, k = 256, nb = m * k / 32;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  std::vector<float> x(m * k);
  for (auto& v : x) v = nd(rng) * 3.0f;
  for (int l = 0; l < 32; ++l) x[32 + l] = 0.0f;                       // an all-zero block
  for (int l = 0; l < 32; ++l) x[64 + l] = static_cast<float>(l) - 0.5f;  // ties: max 30.5
  x[96] = 127.0f;  // scale 1: exact halves round to even
  for (int l = 1; l < 32; ++l) x[96 + l] = static_cast<float>(l) * 0.5f - 8.0f;
  auto quantize = [&](const c::GgufKernels& kern, std::vector<int8_t>* q, std::vector<float>* d,
                      std::vector<int16_t>* s16) {
    q->assign(m * k, 0);
    d->assign(2 * nb, 0.0f);
    s16->assign(2 * nb, 0);
    kern.quantize_q8(x.data(), m, k, q->data(), d->data(), d->data() + nb, s16->data());
  };
  std::vector<int8_t> q_ref, q;
  std::vector<float> d_ref, d;
  std::vector<int16_t> s_ref, s;
  quantize(c::gguf_kernels_scalar(), &q_ref, &d_ref, &s_ref);
  for (int64_t b = 0; b < nb; ++b) {
    const float db = d_ref[b];
    int sums[2] = {0, 0};
    for (int l = 0; l < 32; ++l) {
      const float xv = x[32 * b + l];
      const int qv = q_ref[32 * b + l];
      ASSERT_LE(std::abs(qv), 127);
      ASSERT_LE(std::fabs(xv - db * qv), db * 0.5f * (1 + 1e-5f)) << "block " << b << " value " << l;
      sums[l / 16] += qv;
    }
    EXPECT_EQ(s_ref[2 * b], sums[0]);
    EXPECT_EQ(s_ref[2 * b + 1], sums[1]);
    EXPECT_EQ(d_ref[nb + b], db * static_cast<float>(sums[0] + sums[1]));
  }
  EXPECT_EQ(d_ref[1], 0.0f);
  EXPECT_EQ(q_ref[96 + 16], 0);   // 0.0 stays 0
  EXPECT_EQ(q_ref[96 + 15], 0);   // -0.5 -> -0 (even)
  EXPECT_EQ(q_ref[96 + 14], -1);  // -1.0
  EXPECT_EQ(q_ref[96 + 13], -2);  // -1.5 -> -2 (even)
  EXPECT_EQ(q_ref[96 + 18], 1);   // 1.0
  EXPECT_EQ(q_ref[96 + 17], 0);   // 0.5 -> 0 (even)
  EXPECT_EQ(q_ref[96 + 19], 2);   // 1.5 -> 2 (even)
  for_each_isa([&] {
    // the table in use: take it from a matmul's point of view via the public name
    const std::string isa = c::gguf_matmul_isa();
    const c::GgufKernels* kern = &c::gguf_kernels_scalar();
#if defined(__x86_64__)
    if (isa == "avx2") kern = &c::gguf_kernels_avx2();
    if (isa == "avx512") kern = &c::gguf_kernels_avx512();
#elif defined(__aarch64__)
    if (isa == "neon") kern = &c::gguf_kernels_neon();
    if (isa == "neon_dot") kern = &c::gguf_kernels_neon_dot();
#endif
    quantize(*kern, &q, &d, &s);
    EXPECT_EQ(q, q_ref) << isa;
    EXPECT_EQ(d, d_ref) << isa;
    EXPECT_EQ(s, s_ref) << isa;
  });
}

// The SIMD variants compute the scalar reference's integer sums; only the order of
// the float scaling differs.
TEST(GgufCpu, EveryIsaMatchesTheScalarIntegerPath) {
  for (auto t : kInt8Types) {
    const int64_t bs = g::type_info(t).block_size;
    // 608: an odd number of 32-weight blocks (the one-row kernels run two chains of blocks)
    for (int64_t k : bs == 32 ? std::vector<int64_t>{576, 608} : std::vector<int64_t>{768}) {
      // n = 45 ends on a short panel of 8 and of 16 rows; 64: whole panels, float32 results
      // written straight to y
      for (int64_t n : {45, 64}) {
        auto w = random_weights(t, n, k, 3);
        // 9 .. 300: weight panels (x86), every remainder of their 3-, 6- and 8-row tiles
        for (int64_t m : {1, 2, 5, 8, 9, 10, 11, 14, 16, 17, 21, 23, 300}) {
          std::vector<uint16_t> xh;
          std::vector<float> x = random_x(m, k, c::Elt::kF32, 9, &xh);
          c::gguf_matmul_set_isa("scalar");
          std::vector<float> ref = run_matmul(t, w, n, k, x, xh, m, c::Elt::kF32);
          double scale = 0;
          for (float v : ref) scale = std::max(scale, double(std::fabs(v)));
          for_each_isa([&] {
            std::vector<float> y = run_matmul(t, w, n, k, x, xh, m, c::Elt::kF32);
            double worst = 0;
            for (int64_t i = 0; i < m * n; ++i) {
              worst = std::max(worst, double(std::fabs(y[i] - ref[i])));
            }
            EXPECT_LE(worst / scale, kFloatTol.at(c::Elt::kF32)) << case_name(t, m, n, k, c::Elt::kF32);
          });
        }
      }
    }
  }
}

// Half-precision results are the float32 results rounded once (the conversion of the
// activations is exact), also where panel results are buffered and converted in groups:
// n = 203 spans several groups and ends on a short panel.
TEST(GgufCpu, HalfPrecisionOutputIsTheFloat32OutputRounded) {
  for (auto t : {g::GGMLType::kQ4_1, g::GGMLType::kQ8_0, g::GGMLType::kQ4_K}) {
    const int64_t bs = g::type_info(t).block_size, k = bs == 32 ? 576 : 768, n = 203;
    auto w = random_weights(t, n, k, 5);
    for (int64_t m : {3, 12, 70}) {
      for (c::Elt elt : {c::Elt::kF16, c::Elt::kBF16}) {
        std::vector<uint16_t> xh;
        std::vector<float> x = random_x(m, k, elt, 11, &xh);
        std::vector<float> y32 = run_matmul(t, w, n, k, x, xh, m, c::Elt::kF32);
        std::vector<float> yh = run_matmul(t, w, n, k, x, xh, m, elt);
        int64_t wrong = 0;
        for (int64_t i = 0; i < m * n; ++i) {
          const float want = elt == c::Elt::kF16 ? c::round_to<c::Elt::kF16>(y32[i])
                                                 : c::round_to<c::Elt::kBF16>(y32[i]);
          wrong += yh[i] != want;
        }
        EXPECT_EQ(wrong, 0) << case_name(t, m, n, k, elt);
      }
    }
  }
}

// Back-to-back jobs on more threads than cores (workers descheduled mid-claim): every
// item runs exactly once, and all of them before gguf_parallel_for returns. A worker
// late from one job once claimed a chunk of the next and ended a call early.
TEST(GgufPool, EveryItemRunsOnceBeforeTheCallReturns) {
  c::set_num_threads(4);
  std::mt19937 rng(3);
  std::vector<std::atomic<int>> runs(64);
  for (int iter = 0; iter < 20000; ++iter) {
    const int64_t n = 2 + static_cast<int64_t>(rng() % 63);
    for (int64_t i = 0; i < n; ++i) runs[i].store(0, std::memory_order_relaxed);
    c::gguf_parallel_for(n, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) runs[i].fetch_add(1, std::memory_order_relaxed);
    });
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(runs[i].load(), 1) << "item " << i << " of " << n << ", call " << iter;
    }
  }
  c::set_num_threads(0);
}

TEST(GgufCpu, IsaSelection) {
  auto isas = c::gguf_matmul_isas();
  ASSERT_FALSE(isas.empty());
  EXPECT_EQ(isas.back(), "scalar");
  EXPECT_EQ(c::gguf_matmul_isa(), isas.front());
  EXPECT_THROW(c::gguf_matmul_set_isa("sse9"), std::invalid_argument);
  c::gguf_matmul_set_isa("scalar");
  EXPECT_EQ(c::gguf_matmul_isa(), "scalar");
  EXPECT_TRUE(c::gguf_matmul_int8_activations(g::GGMLType::kQ6_K));
  EXPECT_FALSE(c::gguf_matmul_int8_activations(g::GGMLType::kIQ4_XS));
  EXPECT_FALSE(c::gguf_matmul_int8_activations(g::GGMLType::kF16));
  c::gguf_matmul_set_isa("");
  EXPECT_EQ(c::gguf_matmul_isa(), isas.front());
}

}  // namespace

// Several matrices of different types times one x in one call give, bit for bit, what
// one call per matrix gives: decode rows (one pool job, x rounded once) and prefill sizes.
TEST(GgufCpu, GroupedMatmulEqualsOneCallPerMatrix) {
  const int64_t k = 512;
  const g::GGMLType types[] = {g::GGMLType::kQ4_1, g::GGMLType::kQ8_0, g::GGMLType::kQ4_K,
                               g::GGMLType::kF16};
  const int64_t rows[] = {200, 64, 37, 90};
  std::vector<std::vector<uint8_t>> ws;
  for (int i = 0; i < 4; ++i) ws.push_back(random_weights(types[i], rows[i], k, 40 + i));
  for (bool exact : {false, true}) {
    for (int64_t m : {1, 5, 20, 100, 300}) {
      std::vector<uint16_t> xh;
      const std::vector<float> x = random_x(m, k, c::Elt::kF32, 9, &xh);
      std::vector<std::vector<float>> ys(4);
      c::GgufMatmul mats[4];
      for (int i = 0; i < 4; ++i) {
        ys[i].assign(m * rows[i], 0.0f);
        mats[i].type = types[i];
        mats[i].w = ws[i].data();
        mats[i].n = rows[i];
        mats[i].k = k;
        mats[i].x = x.data();
        mats[i].m = m;
        mats[i].y = ys[i].data();
        mats[i].exact = exact;
      }
      c::gguf_matmul_group(mats, 4);
      for (int i = 0; i < 4; ++i) {
        const auto want = run_matmul(types[i], ws[i], rows[i], k, x, xh, m, c::Elt::kF32, exact);
        ASSERT_EQ(ys[i], want) << case_name(types[i], m, rows[i], k, c::Elt::kF32)
                               << " exact=" << exact;
      }
    }
  }
  c::GgufMatmul bad[2];
  bad[0].k = 32;
  bad[1].k = 64;
  EXPECT_THROW(c::gguf_matmul_group(bad, 2), std::invalid_argument);
}

// gguf_matmul_batch (a MoE layer's experts): calls with their own x, m and k, decode-size
// ones in one pool job, larger ones alone; each equals its own gguf_matmul call, bitwise,
// whatever else the batch holds (the integer path rounds each call's x on its own).
TEST(GgufCpu, BatchedMatmulsEqualOneCallEach) {
  const g::GGMLType types[] = {g::GGMLType::kQ4_0, g::GGMLType::kQ8_0, g::GGMLType::kQ4_K,
                               g::GGMLType::kF16, g::GGMLType::kMXFP4};
  const int64_t rows[] = {96, 64, 37, 90, 50};
  const int64_t ks[] = {512, 256, 512, 128, 256};
  const int64_t ms[] = {1, 3, 8, 40, 0};  // 40: past the decode rows; 0: nothing to do
  std::vector<std::vector<uint8_t>> ws;
  for (int i = 0; i < 5; ++i) ws.push_back(random_weights(types[i], rows[i], ks[i], 50 + i));
  for (bool exact : {false, true}) {
    std::vector<std::vector<float>> xs(5), ys(5);
    std::vector<std::vector<uint16_t>> xhs(5);
    c::GgufMatmul mats[5];
    for (int i = 0; i < 5; ++i) {
      xs[i] = random_x(ms[i], ks[i], c::Elt::kF32, 20 + i, &xhs[i]);
      ys[i].assign(ms[i] * rows[i], 0.0f);
      mats[i] = {types[i], ws[i].data(), rows[i], ks[i], c::Elt::kF32, xs[i].data(), ms[i],
                 ys[i].data(), exact};
    }
    c::gguf_matmul_batch(mats, 5);
    for (int i = 0; i < 5; ++i) {
      const auto want = run_matmul(types[i], ws[i], rows[i], ks[i], xs[i], xhs[i], ms[i],
                                   c::Elt::kF32, exact);
      ASSERT_EQ(ys[i], want) << case_name(types[i], ms[i], rows[i], ks[i], c::Elt::kF32)
                             << " exact=" << exact;
    }
  }
}
