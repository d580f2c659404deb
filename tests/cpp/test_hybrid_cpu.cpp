// CPU kernels of the hybrid-model ops against naive double-precision loops:
// gated delta (recurrent and chunked), causal conv1d, mrope, and the float32
// dot / axpby helpers at every vector tail. MLX-free, so it also runs on arm64
// under qemu (tests/py/test_hybrid_arm64.py).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "cpu/causal_conv1d.h"
#include "cpu/gated_delta.h"
#include "cpu/mrope.h"
#include "cpu/rope.h"

namespace vc = vllm_metal::cpu;

namespace {

std::vector<float> randn(size_t n, unsigned seed, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

TEST(HybridCpu, DotAndAxpbyEveryTail) {
  for (int n = 0; n <= 40; ++n) {
    auto a = randn(n, 1 + n), b = randn(n, 100 + n);
    double ref = 0;
    for (int i = 0; i < n; ++i) ref += double(a[i]) * b[i];
    EXPECT_NEAR(vc::dot_f32(a.data(), b.data(), n), ref, 1e-5 * (1 + std::abs(ref))) << n;
    auto y = a;
    vc::axpby_f32(y.data(), 0.5f, -2.0f, b.data(), n);
    for (int i = 0; i < n; ++i) EXPECT_NEAR(y[i], 0.5 * a[i] - 2.0 * b[i], 1e-5) << n;
  }
}

struct Gdn {
  int hk = 2, hv = 4, dk = 40, dv = 12, slots = 5;
  std::vector<int32_t> cu{0, 7, 8, 8, 21}, slot{3, 0, 4, 1}, init{1, 0, 1, 1};
  int tokens() const { return cu.back(); }
};

// Naive recurrence in double, straight from the equations.
void gdn_reference(const Gdn& g, const std::vector<float>& q, const std::vector<float>& k,
                   const std::vector<float>& v, const std::vector<float>& a,
                   const std::vector<float>& b, const std::vector<float>& alog,
                   const std::vector<float>& dtb, std::vector<double>& state,
                   std::vector<double>& y) {
  const int rep = g.hv / g.hk;
  for (size_t n = 0; n + 1 < g.cu.size(); ++n) {
    double* s0 = state.data() + size_t(g.slot[n]) * g.hv * g.dv * g.dk;
    if (!g.init[n]) std::fill(s0, s0 + g.hv * g.dv * g.dk, 0.0);
    for (int t = g.cu[n]; t < g.cu[n + 1]; ++t) {
      for (int h = 0; h < g.hv; ++h) {
        const int kh = h / rep;
        const float* qt = &q[(t * g.hk + kh) * g.dk];
        const float* kt = &k[(t * g.hk + kh) * g.dk];
        double qs = 1e-6, ks = 1e-6;
        for (int i = 0; i < g.dk; ++i) qs += double(qt[i]) * qt[i], ks += double(kt[i]) * kt[i];
        const double x = a[t * g.hv + h] + dtb[h];
        const double gate = std::exp(-std::exp(double(alog[h])) * std::log1p(std::exp(x)));
        const double beta = 1.0 / (1.0 + std::exp(-double(b[t * g.hv + h])));
        for (int r = 0; r < g.dv; ++r) {
          double* s = s0 + (size_t(h) * g.dv + r) * g.dk;
          double kv = 0, out = 0;
          for (int i = 0; i < g.dk; ++i) s[i] *= gate, kv += s[i] * kt[i] / std::sqrt(ks);
          const double delta = beta * (v[(t * g.hv + h) * g.dv + r] - kv);
          for (int i = 0; i < g.dk; ++i) {
            s[i] += delta * kt[i] / std::sqrt(ks);
            out += s[i] * qt[i] / std::sqrt(qs) / std::sqrt(double(g.dk));
          }
          y[(t * g.hv + h) * g.dv + r] = out;
        }
      }
    }
  }
}

TEST(HybridCpu, GatedDeltaRecurrentAndChunkedMatchNaive) {
  Gdn g;
  const int t = g.tokens();
  auto q = randn(t * g.hk * g.dk, 1), k = randn(t * g.hk * g.dk, 2), v = randn(t * g.hv * g.dv, 3);
  auto a = randn(t * g.hv, 4), b = randn(t * g.hv, 5), dtb = randn(g.hv, 6);
  std::vector<float> alog(g.hv);
  for (int h = 0; h < g.hv; ++h) alog[h] = std::log(1.0f + 3.0f * h);
  const auto state0 = randn(size_t(g.slots) * g.hv * g.dv * g.dk, 7, 0.5f);
  std::vector<double> ref_state(state0.begin(), state0.end()), ref_y(t * g.hv * g.dv);
  gdn_reference(g, q, k, v, a, b, alog, dtb, ref_state, ref_y);
  for (int chunk : {0, 1, 5, 64}) {
    std::vector<float> state = state0, y(t * g.hv * g.dv);
    vc::GatedDeltaRows r;
    r.q = q.data(); r.k = k.data(); r.v = v.data(); r.a = a.data(); r.b = b.data();
    r.a_log = alog.data(); r.dt_bias = dtb.data(); r.cu_seqlens = g.cu.data();
    r.slots = g.slot.data(); r.has_initial_state = g.init.data();
    r.state = state.data(); r.y = y.data(); r.num_seqs = int(g.slot.size()); r.tokens = t;
    r.hk = g.hk; r.hv = g.hv; r.dk = g.dk; r.dv = g.dv; r.chunk_size = chunk;
    vc::gated_delta_rows(r);
    for (size_t i = 0; i < y.size(); ++i) ASSERT_NEAR(y[i], ref_y[i], 2e-5) << chunk << " y " << i;
    for (size_t i = 0; i < state.size(); ++i) {
      ASSERT_NEAR(state[i], ref_state[i], 2e-5) << chunk << " state " << i;
    }
  }
}

TEST(HybridCpu, CausalConv1dMatchesNaive) {
  const int c = 300, kw = 4, m = kw - 1, slots = 4;  // 300: two blocks, a tail of 44
  const std::vector<int32_t> cu{0, 2, 3, 10}, slot{2, 0, 3}, init{1, 1, 0};
  const int t = cu.back();
  auto x = randn(t * c, 1), w = randn(c * kw, 2), bias = randn(c, 3);
  const auto state0 = randn(slots * c * m, 4);
  std::vector<float> state = state0, out(t * c);
  vc::CausalConv1dRows r;
  r.x = x.data(); r.weight = w.data(); r.bias = bias.data(); r.cu_seqlens = cu.data();
  r.slots = slot.data(); r.has_initial_state = init.data(); r.state = state.data();
  r.out = out.data(); r.num_seqs = 3; r.channels = c; r.width = kw;
  vc::causal_conv1d_rows(r);
  for (int n = 0; n < 3; ++n) {
    for (int ch = 0; ch < c; ++ch) {
      std::vector<double> in;  // state (oldest first), then the sequence's inputs
      for (int j = 0; j < m; ++j) in.push_back(init[n] ? state0[(slot[n] * c + ch) * m + j] : 0);
      for (int tt = cu[n]; tt < cu[n + 1]; ++tt) in.push_back(x[tt * c + ch]);
      for (int i = 0; i < cu[n + 1] - cu[n]; ++i) {
        double acc = bias[ch];
        for (int j = 0; j < kw; ++j) acc += w[ch * kw + j] * in[i + j];
        ASSERT_NEAR(out[(cu[n] + i) * c + ch], acc / (1 + std::exp(-acc)), 2e-5) << n << " " << ch;
      }
      for (int j = 0; j < m; ++j) {
        ASSERT_EQ(state[(slot[n] * c + ch) * m + j], float(in[in.size() - m + j]));
      }
    }
  }
  for (int i = 0; i < c * m; ++i) ASSERT_EQ(state[c * m + i], state0[c * m + i]);  // slot 1
}

TEST(HybridCpu, MropeMatchesNaive) {
  const int t = 5, heads = 3, d = 80, rot = 64, half = rot / 2;
  const int64_t sections[3] = {11, 11, 10};  // Qwen3.5
  std::vector<double> inv(half);
  for (int i = 0; i < half; ++i) inv[i] = std::pow(10000.0, -2.0 * i / rot);
  std::vector<uint32_t> table(2 * half);
  vc::rope_turn_table(inv.data(), half, table.data());
  std::vector<int64_t> pos(3 * t);
  for (int i = 0; i < 3 * t; ++i) pos[i] = (i * 7919) % 5000;
  auto x = randn(t * heads * d, 9);
  for (bool inter : {false, true}) {
    std::vector<float> out(x.size());
    vc::MropeRows r;
    r.x = x.data(); r.out = out.data(); r.positions = pos.data(); r.positions_int64 = true;
    r.table = table.data(); r.tokens = t; r.heads = heads; r.head_size = d; r.rotary_dim = rot;
    std::copy(sections, sections + 3, r.sections);
    r.interleaved = inter;
    vc::mrope_rows(r);
    for (int tt = 0; tt < t; ++tt) {
      for (int h = 0; h < heads; ++h) {
        const float* xh = &x[(tt * heads + h) * d];
        const float* oh = &out[(tt * heads + h) * d];
        for (int i = 0; i < half; ++i) {
          const int ax = vc::mrope_axis(i, sections, inter);
          const double ang = pos[ax * t + tt] * inv[i];
          ASSERT_NEAR(oh[i], xh[i] * std::cos(ang) - xh[i + half] * std::sin(ang), 2e-5);
          ASSERT_NEAR(oh[i + half], xh[i + half] * std::cos(ang) + xh[i] * std::sin(ang), 2e-5);
        }
        for (int j = rot; j < d; ++j) ASSERT_EQ(oh[j], xh[j]);
      }
    }
  }
  // the two layouts on their defining indices
  EXPECT_EQ(vc::mrope_axis(29, sections, true), 2);
  EXPECT_EQ(vc::mrope_axis(30, sections, true), 0);
  EXPECT_EQ(vc::mrope_axis(31, sections, true), 1);  // h runs to 3 * 11, w stops at 3 * 10
  EXPECT_EQ(vc::mrope_axis(10, sections, false), 0);
  EXPECT_EQ(vc::mrope_axis(11, sections, false), 1);
  EXPECT_EQ(vc::mrope_axis(22, sections, false), 2);
}

}  // namespace
