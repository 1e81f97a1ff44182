// rollout's CPU kernels' 16-lane float32 vector helpers, shared by paged_attention_cpu.cpp, fused_cpu.cpp and
// invariant_cpu.cpp (inline: one definition however many files include it).
#pragma once

#include <cstdint>
#include <cstring>

// 16 float32 lanes as a GCC/Clang vector: one AVX-512 register, two AVX2 ones, four SSE ones (the compiler splits
// it for the ISA -march=native gives), so the loops below are written once for every x86 machine.
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof v); }

// exp(x) lane by lane for x <= 0 (std::exp is a scalar libm call): x = n ln2 + r with |r| <= ln2 / 2, exp(r) by
// Cephes' degree-6 polynomial for expf (relative error about 1e-7), times 2^n built in the exponent bits. n is
// rounded with the 1.5 * 2^23 trick, whose sum also holds n in its low mantissa bits. x below -87 gives about 1e-38
// rather than 0 (masked keys are set to 0 apart).
inline f32x16 exp_nonpositive(f32x16 x) {
  const f32x16 magic = f32x16{} + 12582912.f;
  x = x < -87.f ? f32x16{} - 87.f : x;
  const f32x16 t = x * 1.44269504088896341f + magic;
  const f32x16 n = t - magic;
  f32x16 r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  f32x16 y = f32x16{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.f;
  const i32x16 bits = ((reinterpret_cast<i32x16>(t) - reinterpret_cast<i32x16>(magic)) + 127) << 23;
  return y * reinterpret_cast<f32x16>(bits);
}

// silu(x) = x * sigmoid(x) lane by lane, sigmoid from e = exp(-|x|) <= 1 (no overflow): 1 / (1 + e) for x >= 0,
// e / (1 + e) below; exp by the polynomial above. Shared by fused_cpu.cpp (silu_and_mul) and invariant_cpu.cpp.
inline f32x16 silu16(f32x16 x) {
  const f32x16 e = exp_nonpositive(x < 0.f ? x : -x);
  return x * ((x < 0.f ? e : f32x16{} + 1.f) / (e + 1.f));
}
