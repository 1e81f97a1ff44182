// rollout's CPU kernels' 16-lane float32 helpers with explicit fused multiply-adds, shared by gemm_cpu.cpp and
// invariant_cpu.cpp (inline: one definition however many files include it). Unlike vec16.h's vector type, every
// multiply-add here is an explicit FMA, so no compiler contraction choice can differ between two tiles or two files.
#pragma once

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef __AVX512F__
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vload_n(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline void vstore_n(float* p, vf v, int64_t n) { _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v); }
#else
struct vf {
  float l[16];
};
inline vf vzero() { return vf{}; }
inline vf vload(const float* p) {
  vf v;
  std::memcpy(v.l, p, sizeof v.l);
  return v;
}
inline vf vload_n(const float* p, int64_t n) {
  vf v{};
  std::memcpy(v.l, p, sizeof(float) * n);
  return v;
}
inline vf vfma(vf a, vf b, vf c) {
  for (int i = 0; i < 16; ++i) c.l[i] = std::fma(a.l[i], b.l[i], c.l[i]);
  return c;
}
inline vf vadd(vf a, vf b) {
  for (int i = 0; i < 16; ++i) a.l[i] += b.l[i];
  return a;
}
inline float vsum(vf v) {
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) v.l[i] += v.l[i + w];
  return v.l[0];
}
inline void vstore(float* p, vf v) { std::memcpy(p, v.l, sizeof v.l); }
inline void vstore_n(float* p, vf v, int64_t n) { std::memcpy(p, v.l, sizeof(float) * n); }
#endif
