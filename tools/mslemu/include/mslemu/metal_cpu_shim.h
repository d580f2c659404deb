// metal_cpu_shim.h -- compile Metal Shading Language compute kernels as C++17
// with clang++ (>= 17; tested with clang 19) on Linux and run them on the CPU.
//
//  * vector types are clang ext_vector_type -- the same representation Apple's
//    Metal compiler (a clang fork) uses, so .xyz swizzles, component-wise
//    operators, scalar broadcast and v[i] indexing behave like MSL;
//  * `half` is _Float16, `bfloat` is __bf16;
//  * address-space keywords (device/constant/thread/threadgroup) are erased;
//  * threadgroup_barrier / simd_* collectives cooperate with the fiber
//    scheduler in runtime.h (one fiber per simulated GPU thread).
//
// The MSL keyword macros are defined at the very END of this header, so
// nothing that is included afterwards may use the identifiers kernel, device,
// constant, thread, threadgroup (include <mslemu/end.h> to undefine them).
#pragma once
#include "runtime.h"

#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if !defined(__clang__)
#error "mslemu needs clang++ (ext_vector_type); g++ cannot express MSL vector swizzles"
#endif

// ----------------------------------------------------------------------------
// scalar types
// ----------------------------------------------------------------------------
typedef _Float16 half;
typedef __bf16 bfloat;
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
// Fixed-width types (<cstdint>, above) are global as in MSL; args headers shared with the
// host use them.  MSL also spells them metal::uint32_t etc.: same entities, no ambiguity.
namespace metal {
using ::int8_t; using ::int16_t; using ::int32_t; using ::int64_t;
using ::uint8_t; using ::uint16_t; using ::uint32_t; using ::uint64_t;
using ::size_t; using ::ptrdiff_t;
}  // namespace metal
static_assert(sizeof(long) == 8 && sizeof(int64_t) == 8, "MSL long is 64-bit");

// ----------------------------------------------------------------------------
// vector types (clang ext_vector_type == Metal's own representation)
// ----------------------------------------------------------------------------
namespace metal {
template <class T, int N> using vec = T __attribute__((ext_vector_type(N)));
}
#define MSLEMU_VEC_TYPES(T)                                   \
  typedef metal::vec<T, 2> T##2;                              \
  typedef metal::vec<T, 3> T##3;                              \
  typedef metal::vec<T, 4> T##4;
MSLEMU_VEC_TYPES(float)
MSLEMU_VEC_TYPES(half)
MSLEMU_VEC_TYPES(bfloat)
MSLEMU_VEC_TYPES(int)
MSLEMU_VEC_TYPES(uint)
MSLEMU_VEC_TYPES(short)
MSLEMU_VEC_TYPES(ushort)
MSLEMU_VEC_TYPES(char)
MSLEMU_VEC_TYPES(uchar)
MSLEMU_VEC_TYPES(long)
MSLEMU_VEC_TYPES(ulong)
MSLEMU_VEC_TYPES(bool)
#undef MSLEMU_VEC_TYPES

// packed_* types: tightly packed (alignment of the scalar), convertible to/from vecN
namespace mslemu {
template <class T, int N> struct packed_vec;
template <class T> struct packed_vec<T, 2> {
  T x, y;
  packed_vec() = default;
  packed_vec(metal::vec<T, 2> v) : x(v.x), y(v.y) {}
  operator metal::vec<T, 2>() const { return metal::vec<T, 2>{x, y}; }
  T &operator[](int i) { return (&x)[i]; }
  const T &operator[](int i) const { return (&x)[i]; }
};
template <class T> struct packed_vec<T, 3> {
  T x, y, z;
  packed_vec() = default;
  packed_vec(metal::vec<T, 3> v) : x(v.x), y(v.y), z(v.z) {}
  operator metal::vec<T, 3>() const { return metal::vec<T, 3>{x, y, z}; }
  T &operator[](int i) { return (&x)[i]; }
  const T &operator[](int i) const { return (&x)[i]; }
};
template <class T> struct packed_vec<T, 4> {
  T x, y, z, w;
  packed_vec() = default;
  packed_vec(metal::vec<T, 4> v) : x(v.x), y(v.y), z(v.z), w(v.w) {}
  operator metal::vec<T, 4>() const { return metal::vec<T, 4>{x, y, z, w}; }
  T &operator[](int i) { return (&x)[i]; }
  const T &operator[](int i) const { return (&x)[i]; }
};
}  // namespace mslemu
#define MSLEMU_PACKED(T)                                  \
  typedef mslemu::packed_vec<T, 2> packed_##T##2;        \
  typedef mslemu::packed_vec<T, 3> packed_##T##3;        \
  typedef mslemu::packed_vec<T, 4> packed_##T##4;
MSLEMU_PACKED(float)
MSLEMU_PACKED(half)
MSLEMU_PACKED(bfloat)
MSLEMU_PACKED(int)
MSLEMU_PACKED(uint)
MSLEMU_PACKED(short)
MSLEMU_PACKED(ushort)
MSLEMU_PACKED(char)
MSLEMU_PACKED(uchar)
#undef MSLEMU_PACKED

// ----------------------------------------------------------------------------
// traits + vector constructor helper (float4(a,b,c,d), float4(x), float4(h4), float4(v.xy, z, w))
// ----------------------------------------------------------------------------
namespace mslemu {
template <class T> struct vinfo { static constexpr int n = 1; using elem = T; static constexpr bool is_vec = false; };
template <class T, int N> struct vinfo<metal::vec<T, N>> { static constexpr int n = N; using elem = T; static constexpr bool is_vec = true; };
template <class T, int N> struct vinfo<packed_vec<T, N>> { static constexpr int n = N; using elem = T; static constexpr bool is_vec = true; };
template <class T> using elem_t = typename vinfo<std::remove_cv_t<std::remove_reference_t<T>>>::elem;
template <class T> inline constexpr bool is_vec_v = vinfo<std::remove_cv_t<std::remove_reference_t<T>>>::is_vec;
template <class T> inline constexpr bool is_fscalar_v =
    std::is_same_v<T, float> || std::is_same_v<T, half> || std::is_same_v<T, bfloat> || std::is_same_v<T, double>;
template <class T> inline constexpr bool is_fp_v = is_fscalar_v<elem_t<T>>;
template <class T> inline constexpr bool is_int_v = std::is_integral_v<elem_t<T>>;

template <class T> inline constexpr bool is_num_v = std::is_arithmetic_v<T> || is_fscalar_v<T>;
template <class To, class From> inline To cvt(From x) {
  if constexpr (is_num_v<To> && is_num_v<From>) {
    if constexpr (std::is_same_v<To, From>) return x;
    else if constexpr ((std::is_same_v<To, bfloat> || std::is_same_v<From, bfloat>) &&
                       !std::is_same_v<To, float> && !std::is_same_v<From, float>)
      return (To)(float)x;  // clang refuses direct bf16 <-> int/half casts
    else if constexpr (std::is_same_v<To, bool>) return x != From(0);
    else return (To)x;
  } else {
    return (To)x;
  }
}
template <class V, class A> inline void put(V &r, int &i, const A &a) {
  using E = typename vinfo<V>::elem;
  if constexpr (is_vec_v<A>) {
    for (int k = 0; k < vinfo<A>::n; ++k) r[i++] = cvt<E>(a[k]);
  } else {
    r[i++] = cvt<E>(a);
  }
}
template <class V, class... A> inline V mk(const A &...a) {
  if constexpr (!vinfo<V>::is_vec) {
    if constexpr (sizeof...(A) == 0) return V();
    else if constexpr (sizeof...(A) == 1) return cvt<V>(a...);
    else return V(a...);
  } else {
  using E = typename vinfo<V>::elem;
  constexpr int N = vinfo<V>::n;
  constexpr int total = (0 + ... + vinfo<std::remove_cv_t<A>>::n);
  V r;
  if constexpr (sizeof...(A) == 0) {
    for (int k = 0; k < N; ++k) r[k] = E(0);
  } else if constexpr (sizeof...(A) == 1 && total == 1) {
    E s = cvt<E>(a...);
    for (int k = 0; k < N; ++k) r[k] = s;
  } else {
    static_assert(total == N, "MSL vector constructor: number of components does not match");
    int i = 0;
    (put(r, i, a), ...);
  }
  return r;
  }
}
// `threadgroup T x[N];` inside a kernel is rewritten by mslemu.gen to
// `auto &x = *mslemu::tg_var<T[N]>([]{});` -- the lambda type makes the key
// unique per declaration and per template instantiation.
template <class T, class K> inline T *tg_var(K, const char *name = "") {
  static const char key = 0;
  return static_cast<T *>(tg_var_lookup(&key, sizeof(T), alignof(T) < 16 ? 16 : alignof(T), name));
}
// `(half4) x` is rewritten by mslemu.gen to `mslemu::vcast<half4>()->* x`: MSL
// C-style vector casts convert values, clang's ext_vector casts reinterpret bits.
template <class V> struct vcast {};
template <class V> struct vcast_neg {};
template <class V, class A> inline V operator->*(vcast<V>, const A &a) { return mk<V>(a); }
template <class V> inline vcast_neg<V> operator-(vcast<V>) { return {}; }
template <class V, class A> inline V operator->*(vcast_neg<V>, const A &a) { return -mk<V>(a); }
}  // namespace mslemu

// ----------------------------------------------------------------------------
// numeric constants
// ----------------------------------------------------------------------------
#ifndef MAXFLOAT
#define MAXFLOAT FLT_MAX
#endif
#define HALF_MAX ((half)65504.0f)
#define MAXHALF HALF_MAX
#define HALF_MIN ((half)6.103515625e-05f)
#define HALF_EPSILON ((half)0.0009765625f)
#define M_E_F 2.71828182845904523536f
#define M_LOG2E_F 1.44269504088896340736f
#define M_LOG10E_F 0.434294481903251827651f
#define M_LN2_F 0.693147180559945309417f
#define M_LN10_F 2.30258509299404568402f
#define M_PI_F 3.14159265358979323846f
#define M_PI_2_F 1.57079632679489661923f
#define M_PI_4_F 0.785398163397448309616f
#define M_1_PI_F 0.318309886183790671538f
#define M_2_PI_F 0.636619772367581343076f
#define M_2_SQRTPI_F 1.12837916709551257390f
#define M_SQRT2_F 1.41421356237309504880f
#define M_SQRT1_2_F 0.707106781186547524401f
#define M_PI_H ((half)M_PI_F)
#define M_LOG2E_H ((half)M_LOG2E_F)
#define M_LN2_H ((half)M_LN2_F)
#define M_SQRT2_H ((half)M_SQRT2_F)

namespace metal {
using mslemu::vinfo;

template <class T> struct numeric_limits : std::numeric_limits<T> {};
template <> struct numeric_limits<half> {
  static constexpr bool is_specialized = true;
  static constexpr half min() { return (half)6.103515625e-05f; }
  static constexpr half max() { return (half)65504.0f; }
  static constexpr half lowest() { return (half)-65504.0f; }
  static constexpr half epsilon() { return (half)0.0009765625f; }
  static constexpr half infinity() { return (half)__builtin_inff(); }
  static constexpr half quiet_NaN() { return (half)__builtin_nanf(""); }
  static constexpr int digits = 11;
};
template <> struct numeric_limits<bfloat> {
  static constexpr bool is_specialized = true;
  static bfloat min() { return (bfloat)1.17549435e-38f; }
  static bfloat max() { return (bfloat)3.38953139e38f; }
  static bfloat lowest() { return (bfloat)-3.38953139e38f; }
  static bfloat epsilon() { return (bfloat)0.0078125f; }
  static bfloat infinity() { return (bfloat)__builtin_inff(); }
  static bfloat quiet_NaN() { return (bfloat)__builtin_nanf(""); }
  static constexpr int digits = 8;
};

// type traits that MSL exposes in namespace metal
using std::conditional;
using std::conditional_t;
using std::enable_if;
using std::enable_if_t;
using std::is_same;
using std::is_same_v;
using std::is_floating_point;
using std::is_integral;
using std::is_signed;
using std::is_unsigned;
using std::remove_cv_t;
using std::remove_reference_t;
using std::make_unsigned_t;
using std::make_signed_t;
template <class T> struct is_scalar : std::integral_constant<bool, !mslemu::is_vec_v<T>> {};
template <class T> struct is_vector : std::integral_constant<bool, mslemu::is_vec_v<T>> {};
template <class T> struct vec_elements : std::integral_constant<int, vinfo<T>::n> {};

// ----------------------------------------------------------------------------
// bit casts
// ----------------------------------------------------------------------------
template <class To, class From> inline To as_type(const From &f) {
  static_assert(sizeof(To) == sizeof(From), "as_type: size mismatch");
  return __builtin_bit_cast(To, f);
}

// ----------------------------------------------------------------------------
// math (scalar float/half/bfloat + vectors, element-wise)
// ----------------------------------------------------------------------------
namespace detail {
template <class V, class F> inline V map1(const V &a, F f) {
  if constexpr (mslemu::is_vec_v<V>) {
    V r;
    for (int i = 0; i < vinfo<V>::n; ++i) r[i] = f(a[i]);
    return r;
  } else {
    return f(a);
  }
}
template <class V, class F> inline V map2(const V &a, const V &b, F f) {
  if constexpr (mslemu::is_vec_v<V>) {
    V r;
    for (int i = 0; i < vinfo<V>::n; ++i) r[i] = f(a[i], b[i]);
    return r;
  } else {
    return f(a, b);
  }
}
template <class V, class F> inline V map3(const V &a, const V &b, const V &c, F f) {
  if constexpr (mslemu::is_vec_v<V>) {
    V r;
    for (int i = 0; i < vinfo<V>::n; ++i) r[i] = f(a[i], b[i], c[i]);
    return r;
  } else {
    return f(a, b, c);
  }
}
template <class T> using fp_t = std::enable_if_t<mslemu::is_fp_v<T>, T>;
template <class T> using int_t = std::enable_if_t<mslemu::is_int_v<T>, T>;
template <class T> using num_t = std::enable_if_t<mslemu::is_fp_v<T> || mslemu::is_int_v<T>, T>;
}  // namespace detail

#define MSLEMU_F1(name, expr)                                                          \
  template <class T> inline detail::fp_t<T> name(T x) {                                \
    return detail::map1(x, [](auto e) {                                                \
      using E = decltype(e);                                                           \
      float v = (float)e;                                                              \
      (void)v;                                                                         \
      return (E)(expr);                                                                \
    });                                                                                \
  }
#define MSLEMU_F2(name, expr)                                                          \
  template <class T> inline detail::fp_t<T> name(T x, T y) {                           \
    return detail::map2(x, y, [](auto e1, auto e2) {                                   \
      using E = decltype(e1);                                                          \
      float a = (float)e1, b = (float)e2;                                              \
      return (E)(expr);                                                                \
    });                                                                                \
  }                                                                                    \
  template <class T, std::enable_if_t<mslemu::is_vec_v<T>, int> = 0>                   \
  inline detail::fp_t<T> name(T x, mslemu::elem_t<T> y) { return name(x, T(y)); }     \
  template <class T, std::enable_if_t<mslemu::is_vec_v<T>, int> = 0>                   \
  inline detail::fp_t<T> name(mslemu::elem_t<T> x, T y) { return name(T(x), y); }
MSLEMU_F1(exp, std::exp(v))
MSLEMU_F1(exp2, std::exp2(v))
MSLEMU_F1(exp10, std::pow(10.0f, v))
MSLEMU_F1(log, std::log(v))
MSLEMU_F1(log2, std::log2(v))
MSLEMU_F1(log10, std::log10(v))
MSLEMU_F1(sqrt, std::sqrt(v))
MSLEMU_F1(rsqrt, 1.0f / std::sqrt(v))
MSLEMU_F1(sin, std::sin(v))
MSLEMU_F1(cos, std::cos(v))
MSLEMU_F1(tan, std::tan(v))
MSLEMU_F1(asin, std::asin(v))
MSLEMU_F1(acos, std::acos(v))
MSLEMU_F1(atan, std::atan(v))
MSLEMU_F1(sinh, std::sinh(v))
MSLEMU_F1(cosh, std::cosh(v))
MSLEMU_F1(tanh, std::tanh(v))
MSLEMU_F1(asinh, std::asinh(v))
MSLEMU_F1(acosh, std::acosh(v))
MSLEMU_F1(atanh, std::atanh(v))
MSLEMU_F1(sinpi, std::sin(M_PI_F * v))
MSLEMU_F1(cospi, std::cos(M_PI_F * v))
MSLEMU_F1(tanpi, std::tan(M_PI_F * v))
MSLEMU_F1(floor, std::floor(v))
MSLEMU_F1(ceil, std::ceil(v))
MSLEMU_F1(trunc, std::trunc(v))
MSLEMU_F1(round, std::round(v))
MSLEMU_F1(rint, std::rint(v))
MSLEMU_F1(fract, std::fmin(v - std::floor(v), 0x1.fffffep-1f))
MSLEMU_F1(fabs, std::fabs(v))
MSLEMU_F1(saturate, std::fmin(std::fmax(v, 0.0f), 1.0f))
MSLEMU_F1(sign, (v > 0.0f ? 1.0f : (v < 0.0f ? -1.0f : 0.0f)))
MSLEMU_F1(erf, std::erf(v))
MSLEMU_F2(pow, std::pow(a, b))
MSLEMU_F2(powr, std::pow(a, b))
MSLEMU_F2(atan2, std::atan2(a, b))
MSLEMU_F2(fmod, std::fmod(a, b))
MSLEMU_F2(fmax, std::fmax(a, b))
MSLEMU_F2(fmin, std::fmin(a, b))
MSLEMU_F2(fdim, std::fdim(a, b))
MSLEMU_F2(copysign, std::copysign(a, b))
MSLEMU_F2(divide, a / b)
MSLEMU_F2(step, (b < a ? 0.0f : 1.0f))
#undef MSLEMU_F1
#undef MSLEMU_F2
// non-template scalar overloads so fmax(0, x) / pow(x, 2) work as in MSL
#define MSLEMU_F2S(name)                                                 \
  inline float name(float x, float y) { return name<float>(x, y); }      \
  inline half name(half x, half y) { return name<half>(x, y); }
MSLEMU_F2S(pow) MSLEMU_F2S(powr) MSLEMU_F2S(atan2) MSLEMU_F2S(fmod) MSLEMU_F2S(fmax) MSLEMU_F2S(fmin)
MSLEMU_F2S(fdim) MSLEMU_F2S(copysign) MSLEMU_F2S(divide) MSLEMU_F2S(step)
#undef MSLEMU_F2S

template <class T> inline detail::fp_t<T> fma(T a, T b, T c) {
  return detail::map3(a, b, c, [](auto x, auto y, auto z) { using E = decltype(x); return (E)std::fma((float)x, (float)y, (float)z); });
}
template <class T> inline detail::fp_t<T> mix(T x, T y, T a) { return x + (y - x) * a; }
template <class T, std::enable_if_t<mslemu::is_vec_v<T>, int> = 0>
inline detail::fp_t<T> mix(T x, T y, mslemu::elem_t<T> a) { return x + (y - x) * a; }
template <class T> inline detail::fp_t<T> smoothstep(T e0, T e1, T x) {
  return detail::map3(e0, e1, x, [](auto a, auto b, auto c) {
    using E = decltype(a);
    float t = std::fmin(std::fmax(((float)c - (float)a) / ((float)b - (float)a), 0.0f), 1.0f);
    return (E)(t * t * (3.0f - 2.0f * t));
  });
}
template <class T> inline T abs(T x) {
  return detail::map1(x, [](auto e) { using E = decltype(e); return e < E(0) ? (E)-e : e; });
}
template <class T, class = detail::num_t<T>> inline T absdiff(T x, T y) { return x > y ? x - y : y - x; }

// min / max / clamp: non-template scalar overloads (so max(x, 0.0f) works for float x)
#define MSLEMU_MINMAX(T)                                                        \
  inline T max(T a, T b) { return a > b ? a : b; }                              \
  inline T min(T a, T b) { return a < b ? a : b; }                              \
  inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }               \
  inline T max3(T a, T b, T c) { return max(a, max(b, c)); }                    \
  inline T min3(T a, T b, T c) { return min(a, min(b, c)); }                    \
  inline T median3(T a, T b, T c) { return max(min(a, b), min(max(a, b), c)); }
MSLEMU_MINMAX(half)
MSLEMU_MINMAX(bfloat)
MSLEMU_MINMAX(int)
MSLEMU_MINMAX(uint)
MSLEMU_MINMAX(short)
MSLEMU_MINMAX(ushort)
MSLEMU_MINMAX(char)
MSLEMU_MINMAX(uchar)
MSLEMU_MINMAX(long)
MSLEMU_MINMAX(ulong)
#undef MSLEMU_MINMAX
// float: Metal max/min on floats behave like fmax/fmin
inline float max(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float clamp(float x, float lo, float hi) { return std::fmin(std::fmax(x, lo), hi); }
inline float max3(float a, float b, float c) { return max(a, max(b, c)); }
inline float min3(float a, float b, float c) { return min(a, min(b, c)); }
inline float median3(float a, float b, float c) { return max(min(a, b), min(max(a, b), c)); }
template <class V, std::enable_if_t<mslemu::is_vec_v<V>, int> = 0> inline V max(V a, V b) {
  return detail::map2(a, b, [](auto x, auto y) { return max(x, y); });
}
template <class V, std::enable_if_t<mslemu::is_vec_v<V>, int> = 0> inline V min(V a, V b) {
  return detail::map2(a, b, [](auto x, auto y) { return min(x, y); });
}
template <class V, std::enable_if_t<mslemu::is_vec_v<V>, int> = 0> inline V max(V a, mslemu::elem_t<V> b) { return max(a, V(b)); }
template <class V, std::enable_if_t<mslemu::is_vec_v<V>, int> = 0> inline V min(V a, mslemu::elem_t<V> b) { return min(a, V(b)); }
template <class V, std::enable_if_t<mslemu::is_vec_v<V>, int> = 0> inline V clamp(V x, V lo, V hi) { return min(max(x, lo), hi); }
template <class V, std::enable_if_t<mslemu::is_vec_v<V>, int> = 0>
inline V clamp(V x, mslemu::elem_t<V> lo, mslemu::elem_t<V> hi) { return min(max(x, V(lo)), V(hi)); }
template <class V, std::enable_if_t<mslemu::is_vec_v<V>, int> = 0> inline V max3(V a, V b, V c) { return max(a, max(b, c)); }
template <class V, std::enable_if_t<mslemu::is_vec_v<V>, int> = 0> inline V min3(V a, V b, V c) { return min(a, min(b, c)); }

template <class T> inline bool isnan(T x) { return std::isnan((float)x); }
template <class T> inline bool isinf(T x) { return std::isinf((float)x); }
template <class T> inline bool isfinite(T x) { return std::isfinite((float)x); }
template <class T> inline bool signbit(T x) { return std::signbit((float)x); }

// geometric
template <class V, std::enable_if_t<mslemu::is_vec_v<V>, int> = 0> inline mslemu::elem_t<V> dot(V a, V b) {
  mslemu::elem_t<V> s = 0;
  for (int i = 0; i < vinfo<V>::n; ++i) s += a[i] * b[i];
  return s;
}
template <class V> inline mslemu::elem_t<V> length_squared(V a) { return dot(a, a); }
template <class V> inline mslemu::elem_t<V> length(V a) { return (mslemu::elem_t<V>)std::sqrt((float)dot(a, a)); }
template <class V> inline mslemu::elem_t<V> distance(V a, V b) { return length(a - b); }
template <class V> inline V normalize(V a) { return a * (mslemu::elem_t<V>)(1.0f / std::sqrt((float)dot(a, a))); }
template <class V> inline V cross(V a, V b) { return V{a.y * b.z - a.z * b.y, a.z * b.x - a.x * b.z, a.x * b.y - a.y * b.x}; }

// relational
template <class V> inline bool all(V v) {
  if constexpr (mslemu::is_vec_v<V>) { for (int i = 0; i < vinfo<V>::n; ++i) if (!v[i]) return false; return true; }
  else return (bool)v;
}
template <class V> inline bool any(V v) {
  if constexpr (mslemu::is_vec_v<V>) { for (int i = 0; i < vinfo<V>::n; ++i) if (v[i]) return true; return false; }
  else return (bool)v;
}
template <class T, class C> inline T select(T a, T b, C c) {
  if constexpr (mslemu::is_vec_v<T>) {
    T r;
    for (int i = 0; i < vinfo<T>::n; ++i) {
      bool ci;
      if constexpr (mslemu::is_vec_v<C>) ci = (bool)c[i]; else ci = (bool)c;
      r[i] = ci ? b[i] : a[i];
    }
    return r;
  } else {
    return c ? b : a;
  }
}

// integer
template <class T> inline detail::int_t<T> popcount(T x) {
  return detail::map1(x, [](auto e) { using E = decltype(e); return (E)__builtin_popcountll((unsigned long long)(std::make_unsigned_t<E>)e); });
}
template <class T> inline detail::int_t<T> clz(T x) {
  return detail::map1(x, [](auto e) {
    using E = decltype(e); using U = std::make_unsigned_t<E>;
    U u = (U)e; if (!u) return (E)(sizeof(E) * 8);
    return (E)(__builtin_clzll((unsigned long long)u) - (64 - sizeof(E) * 8));
  });
}
template <class T> inline detail::int_t<T> ctz(T x) {
  return detail::map1(x, [](auto e) {
    using E = decltype(e); using U = std::make_unsigned_t<E>;
    U u = (U)e; if (!u) return (E)(sizeof(E) * 8);
    return (E)__builtin_ctzll((unsigned long long)u);
  });
}
template <class T> inline detail::int_t<T> extract_bits(T x, uint offset, uint bits) {
  return detail::map1(x, [=](auto e) {
    using E = decltype(e); using U = std::make_unsigned_t<E>;
    if (bits == 0) return (E)0;
    U m = bits >= sizeof(E) * 8 ? (U)~(U)0 : (U)(((U)1 << bits) - 1);
    U v = (U)(((U)e >> offset) & m);
    if constexpr (std::is_signed_v<E>) {
      if (bits < sizeof(E) * 8 && (v >> (bits - 1)) & 1) v |= (U)~m;
    }
    return (E)v;
  });
}
template <class T> inline detail::int_t<T> insert_bits(T base, T ins, uint offset, uint bits) {
  return detail::map2(base, ins, [=](auto b, auto i) {
    using E = decltype(b); using U = std::make_unsigned_t<E>;
    U m = bits >= sizeof(E) * 8 ? (U)~(U)0 : (U)(((U)1 << bits) - 1);
    return (E)(((U)b & ~(U)(m << offset)) | (U)(((U)i & m) << offset));
  });
}
template <class T> inline detail::int_t<T> reverse_bits(T x) {
  return detail::map1(x, [](auto e) {
    using E = decltype(e); using U = std::make_unsigned_t<E>;
    U u = (U)e, r = 0;
    for (unsigned i = 0; i < sizeof(E) * 8; ++i) { r = (U)((r << 1) | (u & 1)); u >>= 1; }
    return (E)r;
  });
}
template <class T> inline detail::int_t<T> mulhi(T a, T b) {
  return detail::map2(a, b, [](auto x, auto y) {
    using E = decltype(x);
    if constexpr (sizeof(E) == 8) {
      using W = std::conditional_t<std::is_signed_v<E>, __int128, unsigned __int128>;
      return (E)(((W)x * (W)y) >> 64);
    } else {
      using W = std::conditional_t<std::is_signed_v<E>, long long, unsigned long long>;
      return (E)(((W)x * (W)y) >> (sizeof(E) * 8));
    }
  });
}


// ----------------------------------------------------------------------------
// matrices: floatCxR = C columns of vec<T,R> (same layout/size as Metal)
// ----------------------------------------------------------------------------
template <class T, int C, int R> struct matrix {
  vec<T, R> columns[C];
  matrix() = default;
  explicit matrix(T d) {
    for (int c = 0; c < C; ++c) for (int r = 0; r < R; ++r) columns[c][r] = c == r ? d : T(0);
  }
  template <class... V, std::enable_if_t<sizeof...(V) == C && C != 1, int> = 0>
  matrix(const V &...cols) : columns{mslemu::mk<vec<T, R>>(cols)...} {}
  template <class... S, std::enable_if_t<sizeof...(S) == C * R && C * R != C, int> = 0>
  matrix(S... s) {
    T v[C * R] = {mslemu::cvt<T>(s)...};
    for (int c = 0; c < C; ++c) for (int r = 0; r < R; ++r) columns[c][r] = v[c * R + r];
  }
  template <class U> explicit matrix(const matrix<U, C, R> &o) {
    for (int c = 0; c < C; ++c) for (int r = 0; r < R; ++r) columns[c][r] = mslemu::cvt<T>(o.columns[c][r]);
  }
  vec<T, R> &operator[](int c) { return columns[c]; }
  const vec<T, R> &operator[](int c) const { return columns[c]; }
  matrix &operator+=(const matrix &o) { for (int c = 0; c < C; ++c) columns[c] += o.columns[c]; return *this; }
  matrix &operator-=(const matrix &o) { for (int c = 0; c < C; ++c) columns[c] -= o.columns[c]; return *this; }
  matrix &operator*=(T s) { for (int c = 0; c < C; ++c) columns[c] *= s; return *this; }
};
template <class T, int C, int R> inline matrix<T, C, R> operator+(matrix<T, C, R> a, const matrix<T, C, R> &b) { return a += b; }
template <class T, int C, int R> inline matrix<T, C, R> operator-(matrix<T, C, R> a, const matrix<T, C, R> &b) { return a -= b; }
template <class T, int C, int R> inline matrix<T, C, R> operator*(matrix<T, C, R> a, T s) { return a *= s; }
template <class T, int C, int R> inline matrix<T, C, R> operator*(T s, matrix<T, C, R> a) { return a *= s; }
template <class T, int C, int R> inline vec<T, R> operator*(const matrix<T, C, R> &m, const vec<T, C> &v) {
  vec<T, R> r = T(0);
  for (int c = 0; c < C; ++c) r += m.columns[c] * v[c];
  return r;
}
template <class T, int C, int R> inline vec<T, C> operator*(const vec<T, R> &v, const matrix<T, C, R> &m) {
  vec<T, C> r;
  for (int c = 0; c < C; ++c) r[c] = dot(v, m.columns[c]);
  return r;
}
template <class T, int C, int R, int K> inline matrix<T, C, R> operator*(const matrix<T, K, R> &a, const matrix<T, C, K> &b) {
  matrix<T, C, R> r;
  for (int c = 0; c < C; ++c) r.columns[c] = a * b.columns[c];
  return r;
}
template <class T, int C, int R> inline matrix<T, R, C> transpose(const matrix<T, C, R> &m) {
  matrix<T, R, C> r;
  for (int c = 0; c < C; ++c) for (int k = 0; k < R; ++k) r.columns[k][c] = m.columns[c][k];
  return r;
}

namespace fast {
using metal::acos; using metal::asin; using metal::atan; using metal::atan2; using metal::ceil; using metal::clamp;
using metal::cos; using metal::cosh; using metal::cospi; using metal::divide; using metal::exp; using metal::exp10;
using metal::exp2; using metal::fabs; using metal::floor; using metal::fmax; using metal::fmin; using metal::fmod;
using metal::fract; using metal::log; using metal::log10; using metal::log2; using metal::max; using metal::min;
using metal::pow; using metal::powr; using metal::rint; using metal::round; using metal::rsqrt; using metal::saturate;
using metal::sin; using metal::sinh; using metal::sinpi; using metal::sqrt; using metal::tan; using metal::tanh;
using metal::tanpi; using metal::trunc; using metal::sign; using metal::normalize; using metal::length; using metal::distance;
}  // namespace fast
namespace precise {
using namespace fast;
}

// ----------------------------------------------------------------------------
// synchronisation
// ----------------------------------------------------------------------------
enum class mem_flags : uint { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4,
                              mem_threadgroup_imageblock = 8, mem_object_data = 16 };
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags((uint)a | (uint)b); }
constexpr mem_flags operator&(mem_flags a, mem_flags b) { return mem_flags((uint)a & (uint)b); }
}  // namespace metal

namespace mslemu {
// call-site key: identical for every lane executing the same source location
inline uint64_t site_key(const char *file, unsigned line, unsigned col) {
  return ((uint64_t)(uintptr_t)file * 0x9E3779B97F4A7C15ull) ^ ((uint64_t)line << 20) ^ (uint64_t)col;
}
}  // namespace mslemu
#define MSLEMU_SITE() ::mslemu::site_key(__builtin_FILE(), __builtin_LINE(), __builtin_COLUMN())

// counting builds (accounting.h): per-thread simd-group operations
#ifdef MSLEMU_ACCOUNTING
#define MSLEMU_COUNT(field, n) do { if (::mslemu::tl_acct) ::mslemu::tl_acct->c.field += (n); } while (0)
#else
#define MSLEMU_COUNT(field, n) do { } while (0)
#endif

namespace metal {
// The flags matter to checked builds: only mem_threadgroup orders threadgroup memory and
// only mem_device orders device memory between the threads of a threadgroup.
inline void threadgroup_barrier(mem_flags f = mem_flags::mem_none, uint64_t site = MSLEMU_SITE()) {
  mslemu::barrier_wait(site, (uint)f);
}
namespace detail {
inline void simd_sync(uint64_t site, uint32_t fence = 0) {
  uint32_t m;
  mslemu::simd_exchange(nullptr, 0, site, &m, nullptr, nullptr, fence);
}
}  // namespace detail
inline void simdgroup_barrier(mem_flags f = mem_flags::mem_none, uint64_t site = MSLEMU_SITE()) {
  MSLEMU_COUNT(simd_ops, 1);
  detail::simd_sync(site, (uint)f);
}

// ----------------------------------------------------------------------------
// SIMD-group functions (32 lanes; inactive = exited or divergent lanes)
// ----------------------------------------------------------------------------
namespace detail {
template <class T> struct SimdView {
  const unsigned char (*tab)[mslemu::kSlotBytes];
  uint32_t mask;
  mslemu::SimdGroup *grp;
  uint64_t epoch;
  T get(uint32_t l) const { T v; memcpy(&v, tab[l], sizeof(T)); return v; }
  bool active(uint32_t l) const { return l < 32 && ((mask >> l) & 1u); }
};
template <class T> inline SimdView<T> exch(const T &x, uint64_t site) {
  static_assert(sizeof(T) <= mslemu::kSlotBytes, "simd_* value too large");
  SimdView<T> v;
  MSLEMU_COUNT(simd_ops, 1);
  v.tab = mslemu::simd_exchange(&x, sizeof(T), site, &v.mask, &v.grp, &v.epoch);
  return v;
}
inline uint32_t lane() { return mslemu::ctx().tiisg; }
template <class T, class Op> inline T tree_reduce(const SimdView<T> &v, Op op) {
  // every lane of the group gets the same value: compute once, cache per resolution
  if (v.grp->cache_epoch == v.epoch) { T r; memcpy(&r, v.grp->cache, sizeof(T)); return r; }
  // pairwise tree over active lanes (deterministic; close to a GPU butterfly)
  T buf[32]; bool has[32];
  for (uint32_t l = 0; l < 32; ++l) { has[l] = v.active(l); if (has[l]) buf[l] = v.get(l); }
  for (uint32_t s = 1; s < 32; s <<= 1)
    for (uint32_t l = 0; l + s < 32; l += 2 * s) {
      if (has[l] && has[l + s]) buf[l] = op(buf[l], buf[l + s]);
      else if (has[l + s]) { buf[l] = buf[l + s]; has[l] = true; }
    }
  memcpy(v.grp->cache, &buf[0], sizeof(T));
  v.grp->cache_epoch = v.epoch;
  return buf[0];
}
}  // namespace detail

template <class T> inline T simd_sum(T x, uint64_t site = MSLEMU_SITE()) {
  return detail::tree_reduce(detail::exch(x, site), [](T a, T b) { return T(a + b); });
}
template <class T> inline T simd_product(T x, uint64_t site = MSLEMU_SITE()) {
  return detail::tree_reduce(detail::exch(x, site), [](T a, T b) { return T(a * b); });
}
template <class T> inline T simd_max(T x, uint64_t site = MSLEMU_SITE()) {
  return detail::tree_reduce(detail::exch(x, site), [](T a, T b) { return max(a, b); });
}
template <class T> inline T simd_min(T x, uint64_t site = MSLEMU_SITE()) {
  return detail::tree_reduce(detail::exch(x, site), [](T a, T b) { return min(a, b); });
}
template <class T> inline T simd_and(T x, uint64_t site = MSLEMU_SITE()) {
  return detail::tree_reduce(detail::exch(x, site), [](T a, T b) { return T(a & b); });
}
template <class T> inline T simd_or(T x, uint64_t site = MSLEMU_SITE()) {
  return detail::tree_reduce(detail::exch(x, site), [](T a, T b) { return T(a | b); });
}
template <class T> inline T simd_xor(T x, uint64_t site = MSLEMU_SITE()) {
  return detail::tree_reduce(detail::exch(x, site), [](T a, T b) { return T(a ^ b); });
}
template <class T> inline T simd_shuffle(T x, ushort src, uint64_t site = MSLEMU_SITE()) {
  auto v = detail::exch(x, site);
  return v.active(src) ? v.get(src) : x;
}
template <class T> inline T simd_broadcast(T x, ushort src, uint64_t site = MSLEMU_SITE()) {
  return simd_shuffle(x, src, site);
}
template <class T> inline T simd_shuffle_xor(T x, ushort m, uint64_t site = MSLEMU_SITE()) {
  auto v = detail::exch(x, site);
  uint32_t s = detail::lane() ^ m;
  return v.active(s) ? v.get(s) : x;
}
template <class T> inline T simd_shuffle_down(T x, ushort d, uint64_t site = MSLEMU_SITE()) {
  auto v = detail::exch(x, site);
  uint32_t s = detail::lane() + d;
  return (s < 32 && v.active(s)) ? v.get(s) : x;
}
template <class T> inline T simd_shuffle_up(T x, ushort d, uint64_t site = MSLEMU_SITE()) {
  auto v = detail::exch(x, site);
  int s = (int)detail::lane() - (int)d;
  return (s >= 0 && v.active((uint32_t)s)) ? v.get((uint32_t)s) : x;
}
template <class T> inline T simd_shuffle_rotate_down(T x, ushort d, uint64_t site = MSLEMU_SITE()) {
  auto v = detail::exch(x, site);
  uint32_t s = (detail::lane() + d) & 31u;
  return v.active(s) ? v.get(s) : x;
}
template <class T> inline T simd_shuffle_rotate_up(T x, ushort d, uint64_t site = MSLEMU_SITE()) {
  auto v = detail::exch(x, site);
  uint32_t s = (detail::lane() - d) & 31u;
  return v.active(s) ? v.get(s) : x;
}
template <class T> inline T simd_shuffle_and_fill_down(T x, T fill, ushort d, uint64_t site = MSLEMU_SITE()) {
  auto v = detail::exch(x, site);
  uint32_t s = detail::lane() + d;
  return s < 32 ? (v.active(s) ? v.get(s) : x) : fill;
}
template <class T> inline T simd_broadcast_first(T x, uint64_t site = MSLEMU_SITE()) {
  auto v = detail::exch(x, site);
  return v.get((uint32_t)__builtin_ctz(v.mask));
}
template <class T> inline T simd_prefix_inclusive_sum(T x, uint64_t site = MSLEMU_SITE()) {
  auto v = detail::exch(x, site);
  T s = T(0);
  for (uint32_t l = 0; l <= detail::lane(); ++l) if (v.active(l)) s = T(s + v.get(l));
  return s;
}
template <class T> inline T simd_prefix_exclusive_sum(T x, uint64_t site = MSLEMU_SITE()) {
  auto v = detail::exch(x, site);
  T s = T(0);
  for (uint32_t l = 0; l < detail::lane(); ++l) if (v.active(l)) s = T(s + v.get(l));
  return s;
}
template <class T> inline T simd_prefix_inclusive_product(T x, uint64_t site = MSLEMU_SITE()) {
  auto v = detail::exch(x, site);
  T s = T(1);
  for (uint32_t l = 0; l <= detail::lane(); ++l) if (v.active(l)) s = T(s * v.get(l));
  return s;
}
template <class T> inline T simd_prefix_exclusive_product(T x, uint64_t site = MSLEMU_SITE()) {
  auto v = detail::exch(x, site);
  T s = T(1);
  for (uint32_t l = 0; l < detail::lane(); ++l) if (v.active(l)) s = T(s * v.get(l));
  return s;
}
struct simd_vote {
  typedef ulong vote_t;
  vote_t v;
  explicit constexpr simd_vote(vote_t x = 0) : v(x) {}
  explicit constexpr operator vote_t() const { return v; }
  bool any() const { return v != 0; }
};
inline simd_vote simd_ballot(bool b, uint64_t site = MSLEMU_SITE()) {
  auto v = detail::exch((uint32_t)b, site);
  ulong r = 0;
  for (uint32_t l = 0; l < 32; ++l) if (v.active(l) && v.get(l)) r |= 1ull << l;
  return simd_vote(r);
}
inline bool simd_all(bool b, uint64_t site = MSLEMU_SITE()) {
  auto v = detail::exch((uint32_t)b, site);
  for (uint32_t l = 0; l < 32; ++l) if (v.active(l) && !v.get(l)) return false;
  return true;
}
inline bool simd_any(bool b, uint64_t site = MSLEMU_SITE()) {
  auto v = detail::exch((uint32_t)b, site);
  for (uint32_t l = 0; l < 32; ++l) if (v.active(l) && v.get(l)) return true;
  return false;
}
inline simd_vote simd_active_threads_mask(uint64_t site = MSLEMU_SITE()) {
  auto v = detail::exch((uint32_t)1, site);
  return simd_vote(v.mask);
}
inline bool simd_is_first(uint64_t site = MSLEMU_SITE()) {
  auto v = detail::exch((uint32_t)1, site);
  return detail::lane() == (uint32_t)__builtin_ctz(v.mask);
}
// quad (4-lane) variants
template <class T> inline T quad_shuffle_xor(T x, ushort m, uint64_t site = MSLEMU_SITE()) {
  auto v = detail::exch(x, site);
  uint32_t s = (detail::lane() & ~3u) | ((detail::lane() ^ m) & 3u);
  return v.active(s) ? v.get(s) : x;
}
template <class T> inline T quad_shuffle(T x, ushort q, uint64_t site = MSLEMU_SITE()) {
  auto v = detail::exch(x, site);
  uint32_t s = (detail::lane() & ~3u) | (q & 3u);
  return v.active(s) ? v.get(s) : x;
}
template <class T> inline T quad_broadcast(T x, ushort q, uint64_t site = MSLEMU_SITE()) { return quad_shuffle(x, q, site); }
template <class T> inline T quad_sum(T x, uint64_t site = MSLEMU_SITE()) {
  auto v = detail::exch(x, site);
  uint32_t b = detail::lane() & ~3u;
  T s = T(0);
  for (uint32_t l = b; l < b + 4; ++l) if (v.active(l)) s = T(s + v.get(l));
  return s;
}
template <class T> inline T quad_max(T x, uint64_t site = MSLEMU_SITE()) {
  auto v = detail::exch(x, site);
  uint32_t b = detail::lane() & ~3u;
  T s = x;
  for (uint32_t l = b; l < b + 4; ++l) if (v.active(l)) s = max(s, v.get(l));
  return s;
}

// ----------------------------------------------------------------------------
// atomics (real atomics: threadgroups run concurrently on several OS threads)
// ----------------------------------------------------------------------------
enum memory_order { memory_order_relaxed = 0, memory_order_acquire = 2, memory_order_release = 3,
                    memory_order_acq_rel = 4, memory_order_seq_cst = 5 };
enum memory_scope { memory_scope_thread, memory_scope_simdgroup, memory_scope_threadgroup, memory_scope_device };
template <class T> struct atomic {
  T __v;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<bool> atomic_bool;
typedef atomic<float> atomic_float;
typedef atomic<ulong> atomic_ulong;
typedef atomic<long> atomic_long;

#define MSLEMU_AT(A) std::enable_if_t<!std::is_void_v<decltype(std::declval<A &>().__v)>, int> = 0
template <class A, class T, MSLEMU_AT(A)> inline void atomic_store_explicit(A *o, T v, memory_order, ...) {
  mslemu::AtomicScope in_atomic;
  std::remove_cv_t<decltype(o->__v)> x = v; __atomic_store(&o->__v, &x, __ATOMIC_SEQ_CST);
}
template <class A, MSLEMU_AT(A)> inline auto atomic_load_explicit(A *o, memory_order, ...) {
  mslemu::AtomicScope in_atomic;
  std::remove_cv_t<decltype(o->__v)> x; __atomic_load(&o->__v, &x, __ATOMIC_SEQ_CST); return x;
}
template <class A, class T, MSLEMU_AT(A)> inline auto atomic_exchange_explicit(A *o, T v, memory_order, ...) {
  mslemu::AtomicScope in_atomic;
  std::remove_cv_t<decltype(o->__v)> x = v, r; __atomic_exchange(&o->__v, &x, &r, __ATOMIC_SEQ_CST); return r;
}
template <class A, class E, class T, MSLEMU_AT(A)>
inline bool atomic_compare_exchange_weak_explicit(A *o, E *expected, T desired, memory_order, memory_order, ...) {
  mslemu::AtomicScope in_atomic;
  std::remove_cv_t<decltype(o->__v)> d = desired;
  return __atomic_compare_exchange(&o->__v, expected, &d, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}
template <class A, class E, class T, MSLEMU_AT(A)>
inline bool atomic_compare_exchange_strong_explicit(A *o, E *expected, T desired, memory_order a, memory_order b, ...) {
  return atomic_compare_exchange_weak_explicit(o, expected, desired, a, b);
}
namespace detail {
template <class A, class T, class F> inline auto atomic_rmw(A *o, T v, F f) {
  mslemu::AtomicScope in_atomic;
  using V = std::remove_cv_t<decltype(o->__v)>;
  V old, nv;
  __atomic_load(&o->__v, &old, __ATOMIC_RELAXED);
  do { nv = f(old, (V)v); } while (!__atomic_compare_exchange(&o->__v, &old, &nv, true, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED));
  return old;
}
}  // namespace detail
#define MSLEMU_ATOMIC_RMW(name, expr)                                                               \
  template <class A, class T, MSLEMU_AT(A)> inline auto atomic_fetch_##name##_explicit(A *o, T v, memory_order, ...) { \
    return detail::atomic_rmw(o, v, [](auto a, auto b) { return decltype(a)(expr); });             \
  }
MSLEMU_ATOMIC_RMW(add, a + b)
MSLEMU_ATOMIC_RMW(sub, a - b)
MSLEMU_ATOMIC_RMW(and, a & b)
MSLEMU_ATOMIC_RMW(or, a | b)
MSLEMU_ATOMIC_RMW(xor, a ^ b)
MSLEMU_ATOMIC_RMW(max, (a > b ? a : b))
MSLEMU_ATOMIC_RMW(min, (a < b ? a : b))
#undef MSLEMU_ATOMIC_RMW
#undef MSLEMU_AT

// ----------------------------------------------------------------------------
// simdgroup_matrix (replicated emulation: every lane holds the whole matrix;
// load/store/multiply are simdgroup sync points, so lockstep semantics hold).
// thread_elements() is NOT supported (lane ownership layout is not modelled).
// ----------------------------------------------------------------------------
template <class T, int R, int C> struct simdgroup_matrix {
  T m[R][C];
  simdgroup_matrix() = default;
  explicit simdgroup_matrix(T diag) {
    for (int r = 0; r < R; ++r) for (int c = 0; c < C; ++c) m[r][c] = r == c ? diag : T(0);
  }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;
template <class T, int R, int C = R> inline simdgroup_matrix<T, R, C> make_filled_simdgroup_matrix(T v) {
  simdgroup_matrix<T, R, C> s;
  for (int r = 0; r < R; ++r) for (int c = 0; c < C; ++c) s.m[r][c] = v;
  return s;
}
template <class T, int R, int C, class U>
inline void simdgroup_load(simdgroup_matrix<T, R, C> &d, const U *src, ulong elements_per_row = C,
                           ulong2 origin = ulong2(0), bool transpose = false, uint64_t site = MSLEMU_SITE()) {
  {
    const bool leader = mslemu::simd_leader();
    if (leader) MSLEMU_COUNT(matrix_loads, 1);
    mslemu::AccessMute mute(!leader);  // one simdgroup load (counted, checked), not one per lane
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) {
        ulong row = origin.y + (transpose ? c : r), col = origin.x + (transpose ? r : c);
        d.m[r][c] = (T)src[row * elements_per_row + col];
      }
  }
  detail::simd_sync(site);
}
template <class T, int R, int C, class U>
inline void simdgroup_store(const simdgroup_matrix<T, R, C> &a, U *dst, ulong elements_per_row = C,
                            ulong2 origin = ulong2(0), bool transpose = false, uint64_t site = MSLEMU_SITE()) {
  // every lane writes its (identical) copy; the sync below keeps lanes in lockstep
  {
    const bool leader = mslemu::simd_leader();
    if (leader) MSLEMU_COUNT(matrix_stores, 1);
    mslemu::AccessMute mute(!leader);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) {
        ulong row = origin.y + (transpose ? c : r), col = origin.x + (transpose ? r : c);
        dst[row * elements_per_row + col] = (U)a.m[r][c];
      }
  }
  detail::simd_sync(site);
}
template <class TD, class TA, class TB, class TC, int M, int N, int K>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<TD, M, N> &d, const simdgroup_matrix<TA, M, K> &a,
                                          const simdgroup_matrix<TB, K, N> &b, const simdgroup_matrix<TC, M, N> &c) {
#ifdef MSLEMU_ACCOUNTING
  if (mslemu::acct_simd_leader()) MSLEMU_COUNT(matrix_macs, M * N * K);
#endif
  simdgroup_matrix<TD, M, N> r;
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      float s = (float)c.m[i][j];
      for (int k = 0; k < K; ++k) s += (float)a.m[i][k] * (float)b.m[k][j];
      r.m[i][j] = (TD)s;
    }
  d = r;
}
template <class TD, class TA, class TB, int M, int N, int K>
inline void simdgroup_multiply(simdgroup_matrix<TD, M, N> &d, const simdgroup_matrix<TA, M, K> &a,
                               const simdgroup_matrix<TB, K, N> &b) {
#ifdef MSLEMU_ACCOUNTING
  if (mslemu::acct_simd_leader()) MSLEMU_COUNT(matrix_macs, M * N * K);
#endif
  simdgroup_matrix<TD, M, N> r;
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      float s = 0;
      for (int k = 0; k < K; ++k) s += (float)a.m[i][k] * (float)b.m[k][j];
      r.m[i][j] = (TD)s;
    }
  d = r;
}

}  // namespace metal

#define MSLEMU_MAT_TYPES(T)                                                            \
  typedef metal::matrix<T, 2, 2> T##2x2; typedef metal::matrix<T, 2, 3> T##2x3;         \
  typedef metal::matrix<T, 2, 4> T##2x4; typedef metal::matrix<T, 3, 2> T##3x2;         \
  typedef metal::matrix<T, 3, 3> T##3x3; typedef metal::matrix<T, 3, 4> T##3x4;         \
  typedef metal::matrix<T, 4, 2> T##4x2; typedef metal::matrix<T, 4, 3> T##4x3;         \
  typedef metal::matrix<T, 4, 4> T##4x4;
MSLEMU_MAT_TYPES(float)
MSLEMU_MAT_TYPES(half)
MSLEMU_MAT_TYPES(bfloat)
#undef MSLEMU_MAT_TYPES

// ----------------------------------------------------------------------------
// glue helpers used by the generated launcher (mslemu/gen.py)
// ----------------------------------------------------------------------------
namespace mslemu {
namespace glue {
struct BufPtr {
  void *p;
  template <class T> operator T *() const { return static_cast<T *>(p); }
};
struct BufRef {
  void *p;
  template <class T> operator T &() const { return *static_cast<T *>(p); }
};
struct Bi3 {
  u3 v;
  operator uint() const { return v.x; }
  operator ushort() const { return (ushort)v.x; }
  operator uint2() const { return uint2{v.x, v.y}; }
  operator uint3() const { return uint3{v.x, v.y, v.z}; }
  operator ushort2() const { return ushort2{(ushort)v.x, (ushort)v.y}; }
  operator ushort3() const { return ushort3{(ushort)v.x, (ushort)v.y, (ushort)v.z}; }
};
struct Bi1 {
  uint v;
  operator uint() const { return v; }
  operator ushort() const { return (ushort)v; }
};
inline BufPtr buf_ptr(uint32_t i) { return BufPtr{buffer_ptr(i)}; }
inline BufRef buf_ref(uint32_t i) { return BufRef{buffer_ptr(i)}; }
inline BufPtr tg_ptr(uint32_t i) { return BufPtr{tg_mem_ptr(i)}; }
inline Bi3 tpig() { return Bi3{ctx().tpig}; }
inline Bi3 tgpig() { return Bi3{ctx().tgpig}; }
inline Bi3 tpitg() { return Bi3{ctx().tpitg}; }
inline Bi3 tptg() { return Bi3{ctx().tptg}; }
inline Bi3 dtptg() { return Bi3{ctx().dtptg}; }
inline Bi3 tgpg() { return Bi3{ctx().tgpg}; }
inline Bi3 tpg() { return Bi3{ctx().tpg}; }
inline Bi1 tiitg() { return Bi1{ctx().tiitg}; }
inline Bi1 sgitg() { return Bi1{ctx().sgitg}; }
inline Bi1 tiisg() { return Bi1{ctx().tiisg}; }
inline Bi1 sgptg() { return Bi1{ctx().sgptg}; }
inline Bi1 tpsg() { return Bi1{(uint)kSimdWidth}; }
}  // namespace glue
}  // namespace mslemu

// ----------------------------------------------------------------------------
// MSL keywords.  Everything after this point is "MSL land".
// ----------------------------------------------------------------------------
#define __METAL_EMULATED__ 1
#ifndef __METAL_VERSION__
#define __METAL_VERSION__ 310
#endif
#define kernel
#define device
#define constant const
#define thread
#define threadgroup
#define threadgroup_imageblock
#define METAL_FUNC inline

// vector "constructors": float4(a, b, c, d) is not valid C++ for a builtin vector type
#define MSLEMU_CTOR(T)                                      \
  ::mslemu::mk<::T>
#define float2(...) MSLEMU_CTOR(float2)(__VA_ARGS__)
#define float3(...) MSLEMU_CTOR(float3)(__VA_ARGS__)
#define float4(...) MSLEMU_CTOR(float4)(__VA_ARGS__)
#define half2(...) MSLEMU_CTOR(half2)(__VA_ARGS__)
#define half3(...) MSLEMU_CTOR(half3)(__VA_ARGS__)
#define half4(...) MSLEMU_CTOR(half4)(__VA_ARGS__)
#define bfloat2(...) MSLEMU_CTOR(bfloat2)(__VA_ARGS__)
#define bfloat3(...) MSLEMU_CTOR(bfloat3)(__VA_ARGS__)
#define bfloat4(...) MSLEMU_CTOR(bfloat4)(__VA_ARGS__)
#define int2(...) MSLEMU_CTOR(int2)(__VA_ARGS__)
#define int3(...) MSLEMU_CTOR(int3)(__VA_ARGS__)
#define int4(...) MSLEMU_CTOR(int4)(__VA_ARGS__)
#define uint2(...) MSLEMU_CTOR(uint2)(__VA_ARGS__)
#define uint3(...) MSLEMU_CTOR(uint3)(__VA_ARGS__)
#define uint4(...) MSLEMU_CTOR(uint4)(__VA_ARGS__)
#define short2(...) MSLEMU_CTOR(short2)(__VA_ARGS__)
#define short3(...) MSLEMU_CTOR(short3)(__VA_ARGS__)
#define short4(...) MSLEMU_CTOR(short4)(__VA_ARGS__)
#define ushort2(...) MSLEMU_CTOR(ushort2)(__VA_ARGS__)
#define ushort3(...) MSLEMU_CTOR(ushort3)(__VA_ARGS__)
#define ushort4(...) MSLEMU_CTOR(ushort4)(__VA_ARGS__)
#define char2(...) MSLEMU_CTOR(char2)(__VA_ARGS__)
#define char3(...) MSLEMU_CTOR(char3)(__VA_ARGS__)
#define char4(...) MSLEMU_CTOR(char4)(__VA_ARGS__)
#define uchar2(...) MSLEMU_CTOR(uchar2)(__VA_ARGS__)
#define uchar3(...) MSLEMU_CTOR(uchar3)(__VA_ARGS__)
#define uchar4(...) MSLEMU_CTOR(uchar4)(__VA_ARGS__)
#define long2(...) MSLEMU_CTOR(long2)(__VA_ARGS__)
#define long3(...) MSLEMU_CTOR(long3)(__VA_ARGS__)
#define long4(...) MSLEMU_CTOR(long4)(__VA_ARGS__)
#define ulong2(...) MSLEMU_CTOR(ulong2)(__VA_ARGS__)
#define ulong3(...) MSLEMU_CTOR(ulong3)(__VA_ARGS__)
#define ulong4(...) MSLEMU_CTOR(ulong4)(__VA_ARGS__)
#define bfloat(...) MSLEMU_CTOR(bfloat)(__VA_ARGS__)
