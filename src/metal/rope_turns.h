// cos and sin of a rope angle from the turn table (rope_turn_table): shared by
// rope.metal and decoder_layer.metal (MSL only).
//
// The table holds each pair's turns per position as a 64-bit fraction (two
// 32-bit words, low words first); position * rate mod 2^64 is integer
// arithmetic, and only the remainder after the nearest quarter turn becomes a
// float (|r| <= pi/4), so fast math cannot spoil it and large positions keep
// full precision. The CPU kernel (src/cpp/cpu/rope.cpp) computes the same values.
#pragma once

#include <metal_stdlib>

using namespace metal;

// 2 pi / 2^32: radians per unit of the 32-bit turn fraction.
static constant constexpr float kRadPerUnit = 1.4629180792671596e-09f;
// Taylor coefficients; the first omitted terms are < 2e-9 on |r| <= pi/4.
static constant constexpr float kS3 = -1.0f / 6.0f;
static constant constexpr float kS5 = 1.0f / 120.0f;
static constant constexpr float kS7 = -1.0f / 5040.0f;
static constant constexpr float kS9 = 1.0f / 362880.0f;
static constant constexpr float kC2 = -1.0f / 2.0f;
static constant constexpr float kC4 = 1.0f / 24.0f;
static constant constexpr float kC6 = -1.0f / 720.0f;
static constant constexpr float kC8 = 1.0f / 40320.0f;
static constant constexpr float kC10 = -1.0f / 3628800.0f;

// (cos, sin) * mscale of position * 2 pi * rate; position = ph:pl, rate = gh:gl.
inline float2 rope_cos_sin(uint pl, uint ph, uint gl, uint gh, float mscale) {
  uint top = pl * gh + ph * gl + mulhi(pl, gl);  // turn fraction, 2^-32 units
  uint q = (top + (1u << 29)) >> 30;             // nearest quarter turn
  int rem = as_type<int>(top - (q << 30));       // [-2^29, 2^29)
  float r = float(rem) * kRadPerUnit;            // [-pi/4, pi/4]
  float r2 = r * r;
  float sp = r + r * r2 * (kS3 + r2 * (kS5 + r2 * (kS7 + r2 * kS9)));
  float cp = 1.0f + r2 * (kC2 + r2 * (kC4 + r2 * (kC6 + r2 * (kC8 + r2 * kC10))));
  float s = (q & 1u) ? cp : sp;
  float c = (q & 1u) ? sp : cp;
  if ((q & 2u) != 0u) {
    s = -s;
  }
  if (((q + 1u) & 2u) != 0u) {
    c = -c;
  }
  return float2(c * mscale, s * mscale);
}
