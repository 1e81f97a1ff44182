// rollout's fused CPU kernels for the decoder layer of the Llama family (rollout/engine/worker/fused_layer.py):
// RMSNorm, the residual add fused with RMSNorm, SiLU-and-mul, and the rotary embedding with the KV-cache write, each
// one pass over a row.
//
// The ideas are vLLM's CPU kernels (csrc/cpu/layernorm.cpp `rms_norm` and `fused_add_rms_norm`,
// csrc/cpu/activation.cpp `silu_and_mul`, csrc/cpu/pos_encoding.cpp `rotary_embedding`, csrc/cpu/cache.cpp
// `reshape_and_cache`); the code is rollout's. transformers' modules run each of these as four to
// seven elementwise ops (pow, mean, add, rsqrt, mul, mul; silu, mul), each a pass over memory and a dispatch
// (docs/profile.md: 275 `mul` and 182 `add` per decode step of SmolLM2).
//
// Every row is computed alone, in one fixed order (the sum of squares in float32 in a fixed lane order), so a row's
// result does not depend on the other rows of the step. Rows run inline below about 256 K elements (a decode step:
// no OpenMP region, which costs 60-80 us in the manager's thread, scripts/omp_thread_cost.py) and are split over
// threads above.
//
// What is computed, as transformers' LlamaRMSNorm does in float32: y = w * (x * rsqrt(mean(x^2) + eps)).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kElementsPerTask = int64_t{1} << 18;

int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(1, width)); }

void check_rows(const at::Tensor& t, int64_t rows, int64_t width, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32");
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == width && t.stride(1) == 1, name,
              " must be [rows, width] with contiguous rows");
}

// The inverse root mean square of a row of n floats: 16 partial sums (lanes), then added in a fixed tree.
inline float inv_rms(const float* __restrict x, int64_t n, double eps) {
  float lanes[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
#pragma omp simd
    for (int j = 0; j < 16; ++j) lanes[j] += x[i + j] * x[i + j];
  }
  for (int j = 0; i < n; ++i, ++j) lanes[j] += x[i] * x[i];
  for (int width = 8; width >= 1; width /= 2)
    for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  return 1.f / std::sqrt(lanes[0] / static_cast<float>(n) + static_cast<float>(eps));
}

// out [T, H] = rms_norm(x [T, H]) * weight [H].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t T = x.size(0), H = x.size(1);
  check_rows(x, T, H, "x");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1 && weight.size(0) == H &&
                  weight.is_contiguous(),
              "weight must be float32 [H], contiguous");
  at::Tensor out = at::empty({T, H}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, T, grain_rows(H), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* __restrict row = xp + t * xs;
      float* __restrict o = op + t * H;
      const float r = inv_rms(row, H, eps);
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) o[h] = w[h] * (row[h] * r);
    }
  });
  return out;
}

// residual [T, H] += x [T, H]; then x = rms_norm(residual) * weight, both in place (the next sublayer's input in x's
// memory, the sum kept in residual's).
void fused_add_rms_norm_(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  const int64_t T = x.size(0), H = x.size(1);
  check_rows(x, T, H, "x");
  check_rows(residual, T, H, "residual");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1 && weight.size(0) == H &&
                  weight.is_contiguous(),
              "weight must be float32 [H], contiguous");
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  at::parallel_for(0, T, grain_rows(H), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* __restrict xr = xp + t * xs;
      float* __restrict rr = rp + t * rs;
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) rr[h] += xr[h];
      const float r = inv_rms(rr, H, eps);
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) xr[h] = w[h] * (rr[h] * r);
    }
  });
}

// out [T, I] = silu(gate) * up, gate and up [T, I] (rows of any stride).
at::Tensor silu_and_mul(const at::Tensor& gate, const at::Tensor& up) {
  const int64_t T = gate.size(0), I = gate.size(1);
  check_rows(gate, T, I, "gate");
  check_rows(up, T, I, "up");
  at::Tensor out = at::empty({T, I}, gate.options());
  const float* gp = gate.data_ptr<float>();
  const float* upp = up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t gs = gate.stride(0), us = up.stride(0);
  at::parallel_for(0, T, grain_rows(I), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* __restrict g = gp + t * gs;
      const float* __restrict u = upp + t * us;
      float* __restrict o = op + t * I;
      // silu by vec16.h's silu16, 16 lanes at a time.
      int64_t i = 0;
      for (; i + 16 <= I; i += 16) store16(o + i, silu16(load16(g + i)) * load16(u + i));
      for (; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

// The rotary embedding of q [T, H * D] and k [T, Hkv * D] in place, in transformers' rotate-half form
// (apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, cos and sin [T, D] as the model's rotary_emb gives them,
// any scaling already in them), then the step's keys and values written into the layer's cache rows
// k_cache / v_cache [rows, Hkv, D] at slots [T]: vLLM's rotary_embedding and reshape_and_cache in one pass over a row.
void rotary_cache_write_(at::Tensor q, at::Tensor k, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                         at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots) {
  const int64_t T = q.size(0), D = cos.size(1);
  TORCH_CHECK(D % 2 == 0 && D > 0, "head_dim must be even");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == T && sin.sizes() == cos.sizes() && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "cos and sin must be float32 [T, head_dim], contiguous");
  TORCH_CHECK(q.dim() == 2 && q.size(1) % D == 0 && k.dim() == 2 && k.size(1) % D == 0, "q, k: [T, heads * head_dim]");
  const int64_t H = q.size(1) / D, Hkv = k.size(1) / D;
  check_rows(q, T, H * D, "q");
  check_rows(k, T, Hkv * D, "k");
  check_rows(v, T, Hkv * D, "v");
  for (const at::Tensor* c : {&k_cache, &v_cache}) {
    TORCH_CHECK(c->scalar_type() == at::kFloat && c->dim() == 3 && c->size(1) == Hkv && c->size(2) == D &&
                    c->stride(2) == 1,
                "the cache layer must be float32 [rows, Hkv, head_dim] with contiguous heads");
  }
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides(),
              "k_cache and v_cache must have one layout");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == T && slots.is_contiguous(),
              "slots must be int64 [T], contiguous");
  const int64_t rows = k_cache.size(0), s_row = k_cache.stride(0), s_head = k_cache.stride(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slot[t] >= 0 && slot[t] < rows, "slot ", slot[t], " outside the cache");
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const int64_t qs = q.stride(0), ks = k.stride(0), vs = v.stride(0), half = D / 2;
  auto rotate = [&](float* __restrict x, const float* __restrict c, const float* __restrict s) {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = x[i], x2 = x[i + half];
      x[i] = x1 * c[i] - x2 * s[i];
      x[i + half] = x2 * c[i + half] + x1 * s[i + half];
    }
  };
  at::parallel_for(0, T, grain_rows((H + 2 * Hkv) * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * D;
      const float* s = sp + t * D;
      for (int64_t h = 0; h < H; ++h) rotate(qp + t * qs + h * D, c, s);
      for (int64_t h = 0; h < Hkv; ++h) {
        float* kh = kp + t * ks + h * D;
        rotate(kh, c, s);
        std::memcpy(kc + slot[t] * s_row + h * s_head, kh, sizeof(float) * D);
        std::memcpy(vc + slot[t] * s_row + h * s_head, vp + t * vs + h * D, sizeof(float) * D);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rollout_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor gate, Tensor up) -> Tensor");
  m.def(
      "rotary_cache_write_(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor cos, Tensor sin, Tensor(c!) k_cache, "
      "Tensor(d!) v_cache, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(rollout_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm_", &fused_add_rms_norm_);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_cache_write_", &rotary_cache_write_);
}
