// rollout's CPU kernel for an unmerged LoRA adapter's product (rollout/lora/slots.py): out += ((x A^T) * mask) B,
// one row at a time.
//
// Why a kernel for so small a product (a decode step of 16 rows at rank 8: 0.3 M multiply-adds per layer): the
// engine's steps run in the manager's background thread, and there each OpenMP parallel region that MKL or oneDNN
// opens costs 50-110 us (measured with torch 2.13's GNU OpenMP on the project's 2-core EPYC: a [16, 576] x [576, 8]
// torch.mm took 8 us in the main thread and 86-114 us in another one once the main thread had run a parallel region;
// with two threads' pools on two cores, libgomp throttles its workers' spinning, so each region waits for a worker to
// wake). Two such GEMMs per hooked layer (210 layers in SmolLM2) made an adapter's decode step 1.7x the base model's.
// Here a step's rows run inline below about 2 M multiply-adds (no parallel region), and are split over threads by
// rows above (prefill), so every row's result is computed in one fixed order whatever the other rows.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

// Rows per parallel task: about this many multiply-adds (a decode step's rows stay in the calling thread).
constexpr int64_t kWorkPerTask = int64_t{1} << 21;

// The dot product of two float32 rows of length n.
inline float dot(const float* __restrict x, const float* __restrict a, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t k = 0; k < n; ++k) sum += x[k] * a[k];
  return sum;
}

// out [T, N] += ((x [T, K] a^T [K, W]) * mask [T, W]) b [W, N], in place; float32; x, out and mask may have any row
// stride, a and b are contiguous. A row whose masked product is zero (a base-model token) reads no row of b.
void lora_add_(at::Tensor out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
               const std::optional<at::Tensor>& mask) {
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && a.dim() == 2 && b.dim() == 2, "lora_add_: 2-D tensors expected");
  TORCH_CHECK(out.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat && a.scalar_type() == at::kFloat &&
                  b.scalar_type() == at::kFloat,
              "lora_add_: float32 tensors expected");
  const int64_t T = x.size(0), K = x.size(1), W = a.size(0), N = b.size(1);
  TORCH_CHECK(a.size(1) == K && b.size(0) == W && out.size(0) == T && out.size(1) == N, "lora_add_: shapes differ");
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous(), "lora_add_: a and b must be contiguous");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "lora_add_: x and out must have contiguous rows");
  const float* m = nullptr;
  int64_t m_stride = 0;
  if (mask.has_value()) {
    TORCH_CHECK(mask->dim() == 2 && mask->size(0) == T && mask->size(1) == W && mask->stride(1) == 1 &&
                    mask->scalar_type() == at::kFloat,
                "lora_add_: mask must be float32 [T, W] with contiguous rows");
    m = mask->data_ptr<float>();
    m_stride = mask->stride(0);
  }
  const float* xp = x.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t x_stride = x.stride(0), o_stride = out.stride(0);
  const int64_t grain = std::max<int64_t>(1, kWorkPerTask / std::max<int64_t>(1, W * (K + N)));
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> s(W);
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = xp + t * x_stride;
      for (int64_t w = 0; w < W; ++w) {
        const float scale = m != nullptr ? m[t * m_stride + w] : 1.f;
        s[w] = scale == 0.f ? 0.f : dot(xr, ap + w * K, K) * scale;
      }
      float* __restrict orow = op + t * o_stride;
      for (int64_t w = 0; w < W; ++w) {
        const float sw = s[w];
        if (sw == 0.f) continue;
        const float* __restrict br = bp + w * N;
#pragma omp simd
        for (int64_t n = 0; n < N; ++n) orow[n] += sw * br[n];
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rollout_cpu, m) {
  m.def("lora_add_(Tensor(a!) out, Tensor x, Tensor a, Tensor b, Tensor? mask) -> ()");
}

TORCH_LIBRARY_IMPL(rollout_cpu, CPU, m) { m.impl("lora_add_", &lora_add_); }
