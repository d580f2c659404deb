// GGUF on the CPU without MLX: the reader on in-memory files, block decoding
// and the quantized matmul against decode-then-naive-matmul. MLX-free, so the
// arm64 cross-build (tests/py/test_arm64_cpu_kernels.py) runs it for NEON.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpu/gguf_matmul.h"
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
    g::GGMLType::kIQ3_XXS};

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

void check_matmul(g::GGMLType t, int64_t m, int64_t n, int64_t k, c::Elt elt) {
  auto w = random_weights(t, n, k, static_cast<uint32_t>(m * 31 + n));
  std::vector<float> wf(n * k);
  c::gguf_decode_row(t, w.data(), n * k, wf.data());
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  std::vector<float> x(m * k);
  std::vector<uint16_t> xh(m * k);
  for (int64_t i = 0; i < m * k; ++i) {
    x[i] = nd(rng);
    if (elt == c::Elt::kF16) {
      xh[i] = c::float_to_f16(x[i]);
      x[i] = c::f16_to_float(xh[i]);
    } else if (elt == c::Elt::kBF16) {
      xh[i] = c::float_to_bf16(x[i]);
      x[i] = c::bf16_to_float(xh[i]);
    }
  }
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
  c::gguf_matmul(a);
  double scale = 0, worst = 0;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double ref = 0;
      for (int64_t p = 0; p < k; ++p) ref += double(x[i * k + p]) * wf[j * k + p];
      float got = elt == c::Elt::kF32 ? y[i * n + j]
                  : elt == c::Elt::kF16 ? c::f16_to_float(yh[i * n + j])
                                        : c::bf16_to_float(yh[i * n + j]);
      scale = std::max(scale, std::fabs(ref));
      worst = std::max(worst, std::fabs(got - ref));
    }
  }
  double tol = elt == c::Elt::kF32 ? 2e-5 : elt == c::Elt::kF16 ? 2e-3 : 1.6e-2;
  EXPECT_LE(worst / scale, tol) << g::type_name(uint32_t(t)) << " m=" << m << " n=" << n
                                << " k=" << k;
}

TEST(GgufCpu, MatmulEveryTypeAgainstDecodedWeights) {
  for (auto t : kTypes) {
    int64_t bs = g::type_info(t).block_size;
    int64_t k = bs == 1 ? 37 : (bs == 32 ? 96 : 512);
    for (int64_t m : {1, 3, 4, 5, 9}) check_matmul(t, m, 19, k, c::Elt::kF32);
  }
}

TEST(GgufCpu, MatmulHalfActivationsAndThreads) {
  for (int threads : {1, 2, 3}) {
    c::set_num_threads(threads);
    check_matmul(g::GGMLType::kQ4_K, 1, 70, 512, c::Elt::kF16);
    check_matmul(g::GGMLType::kQ6_K, 17, 33, 256, c::Elt::kBF16);
    check_matmul(g::GGMLType::kQ4_1, 6, 40, 576, c::Elt::kF16);
  }
  c::set_num_threads(0);
}

}  // namespace
