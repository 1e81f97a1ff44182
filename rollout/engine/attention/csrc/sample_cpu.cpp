// rollout's CPU kernel for inverse-CDF sampling (rollout/engine/sample/sampler.py): each row's token is the first
// index whose float64 running sum of the row's probabilities exceeds u times the row's total.
//
// Why a kernel: the sampler's torch form (probs.double(), torch.cumsum, torch.searchsorted) writes a float64 copy of
// the probabilities and their running sums, [S, V] twice, and torch's cumsum walks the rows one after another on one
// thread (a GRPO decode step of SmolLM2 draws 64 rows of 49,152 entries; scripts/bench_sampler.py). Here each row is
// summed once in the same order (so the same float64 sums, bit for bit, and the same token), the running sum kept at
// the end of every block of kBlock entries; the token's block is found among those, and only that block is summed
// again. Rows are split over threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kBlock = 1024;

// probs float32 [S, V] with contiguous rows, u float64 [S] -> int64 [S]: for row s the first i with
// cdf[i] > u[s] * cdf[V - 1] (cdf the float64 running sum in index order: torch.cumsum(probs.double(), -1), then
// torch.searchsorted(cdf, u * cdf[:, -1], right=True)), V - 1 where none is.
at::Tensor inverse_cdf_sample(const at::Tensor& probs, const at::Tensor& u) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat && probs.stride(1) == 1,
              "inverse_cdf_sample: probs must be float32 [S, V] with contiguous rows");
  TORCH_CHECK(u.dim() == 1 && u.scalar_type() == at::kDouble && u.size(0) == probs.size(0),
              "inverse_cdf_sample: u must be float64 [S]");
  TORCH_CHECK(probs.size(1) > 0, "inverse_cdf_sample: V must be > 0");
  const int64_t S = probs.size(0), V = probs.size(1), stride = probs.stride(0);
  const int64_t blocks = (V + kBlock - 1) / kBlock;
  at::Tensor out = at::empty({S}, probs.options().dtype(at::kLong));
  const at::Tensor uc = u.contiguous();
  const float* pp = probs.data_ptr<float>();
  const double* up = uc.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> marks(blocks);  // the running sum at the end of each block
    for (int64_t s = begin; s < end; ++s) {
      const float* p = pp + s * stride;
      double acc = 0.0;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t stop = std::min(V, (b + 1) * kBlock);
        for (int64_t i = b * kBlock; i < stop; ++i) acc += static_cast<double>(p[i]);
        marks[b] = acc;
      }
      const double target = up[s] * acc;
      int64_t b = 0;
      while (b < blocks && !(marks[b] > target)) ++b;
      if (b == blocks) {
        op[s] = V - 1;
        continue;
      }
      double run = b == 0 ? 0.0 : marks[b - 1];
      const int64_t stop = std::min(V, (b + 1) * kBlock);
      int64_t i = b * kBlock;
      for (; i < stop; ++i) {
        run += static_cast<double>(p[i]);
        if (run > target) break;
      }
      op[s] = std::min(i, V - 1);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rollout_cpu, m) { m.def("inverse_cdf_sample(Tensor probs, Tensor u) -> Tensor"); }

TORCH_LIBRARY_IMPL(rollout_cpu, CPU, m) { m.impl("inverse_cdf_sample", &inverse_cdf_sample); }
