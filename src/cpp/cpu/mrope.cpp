#include "cpu/mrope.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/parallel.h"
#include "cpu/rope.h"

namespace vllm_metal::cpu {

namespace {

template <Elt E>
using S = typename EltTraits<E>::Storage;

template <Elt E>
void rotate_scalar(const S<E>* x, S<E>* y, const float* c, const float* s, int64_t begin,
                   int64_t half) {
  using T = EltTraits<E>;
  for (int64_t i = begin; i < half; ++i) {
    const float a = T::load(x + i), b = T::load(x + half + i);
    T::store(y + i, a * c[i] - b * s[i]);
    T::store(y + half + i, b * c[i] + a * s[i]);
  }
}

#if defined(__x86_64__)
template <Elt E>
VLLM_METAL_AVX2 void rotate_avx2(const S<E>* x, S<E>* y, const float* c, const float* s,
                                 int64_t half) {
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    const __m256 a = load8<E>(x + i), b = load8<E>(x + half + i);
    const __m256 vc = _mm256_loadu_ps(c + i), vs = _mm256_loadu_ps(s + i);
    store8<E>(y + i, _mm256_fmsub_ps(a, vc, _mm256_mul_ps(b, vs)));
    store8<E>(y + half + i, _mm256_fmadd_ps(b, vc, _mm256_mul_ps(a, vs)));
  }
  rotate_scalar<E>(x, y, c, s, i, half);
}
#endif

#if defined(__aarch64__)
template <Elt E>
void rotate_neon(const S<E>* x, S<E>* y, const float* c, const float* s, int64_t half) {
  int64_t i = 0;
  for (; i + 4 <= half; i += 4) {
    const float32x4_t a = load4<E>(x + i), b = load4<E>(x + half + i);
    const float32x4_t vc = vld1q_f32(c + i), vs = vld1q_f32(s + i);
    store4<E>(y + i, vfmsq_f32(vmulq_f32(a, vc), b, vs));
    store4<E>(y + half + i, vfmaq_f32(vmulq_f32(b, vc), a, vs));
  }
  rotate_scalar<E>(x, y, c, s, i, half);
}
#endif

template <Elt E>
void rotate_generic(const S<E>* x, S<E>* y, const float* c, const float* s, int64_t half) {
  rotate_scalar<E>(x, y, c, s, 0, half);
}

template <Elt E>
void run(const MropeRows& a) {
  auto rotate = &rotate_generic<E>;
#if defined(__x86_64__)
  if (has_avx2_fma()) rotate = &rotate_avx2<E>;
#elif defined(__aarch64__)
  rotate = &rotate_neon<E>;
#endif
  const auto* x = static_cast<const S<E>*>(a.x);
  auto* y = static_cast<S<E>*>(a.out);
  const int64_t half = a.rotary_dim / 2, d = a.head_size;
  std::vector<uint8_t> axis(half);
  for (int64_t i = 0; i < half; ++i) {
    axis[i] = static_cast<uint8_t>(mrope_axis(i, a.sections, a.interleaved));
  }
  auto position = [&](int64_t ax, int64_t t) -> int64_t {
    const int64_t o = ax * a.tokens + t;
    return a.positions_int64 ? static_cast<const int64_t*>(a.positions)[o]
                             : static_cast<const int32_t*>(a.positions)[o];
  };
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, a.heads * d));
  parallel_for(a.tokens, grain, [&](int64_t begin, int64_t end) {
    // per axis cos/sin [3][half], then the picked pair values c, s [half]
    std::vector<float> cs3(6 * half), c(half), s(half);
    for (int64_t t = begin; t < end; ++t) {
      for (int ax = 0; ax < 3; ++ax) {
        rope_cos_sin(position(ax, t), a.table, half, half, 1.0f, cs3.data() + 2 * ax * half,
                     cs3.data() + (2 * ax + 1) * half);
      }
      for (int64_t i = 0; i < half; ++i) {
        c[i] = cs3[2 * axis[i] * half + i];
        s[i] = cs3[(2 * axis[i] + 1) * half + i];
      }
      for (int64_t h = 0; h < a.heads; ++h) {
        const S<E>* xh = x + (t * a.heads + h) * d;
        S<E>* yh = y + (t * a.heads + h) * d;
        rotate(xh, yh, c.data(), s.data(), half);
        if (yh != xh && d > a.rotary_dim) {
          std::memcpy(yh + a.rotary_dim, xh + a.rotary_dim, (d - a.rotary_dim) * sizeof(S<E>));
        }
      }
    }
  });
}

}  // namespace

int mrope_axis(int64_t i, const int64_t sections[3], bool interleaved) {
  if (interleaved) {
    if (i % 3 == 1 && i < 3 * sections[1]) return 1;
    if (i % 3 == 2 && i < 3 * sections[2]) return 2;
    return 0;
  }
  return i < sections[0] ? 0 : (i < sections[0] + sections[1] ? 1 : 2);
}

void mrope_rows(const MropeRows& a) {
  switch (a.elt) {
    case Elt::kF32: return run<Elt::kF32>(a);
    case Elt::kF16: return run<Elt::kF16>(a);
    case Elt::kBF16: return run<Elt::kBF16>(a);
  }
}

}  // namespace vllm_metal::cpu
