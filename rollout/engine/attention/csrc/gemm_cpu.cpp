// rollout's float32 CPU GEMM on panel-packed weights: the engine's default linear layers (`packed_linear`, called by
// engine/worker/onednn.py's PackedWeights on AVX-512 machines) and the batch-invariant mode's (`invariant_mm_packed`,
// engine/worker/invariant.py). One micro-kernel serves both, so the default engine's linear layers on these packed
// weights are batch-invariant too (an element's value does not depend on how many rows the step has).
//
// C [M, N] = A [M, K] @ W [N, K]^T, W packed once in column panels ([P, K, kCols], zero past N). Each element of C is
// one chain of fused multiply-adds over k = 0..K-1 in ascending order, starting from 0: acc = fma(A[m, k], W[n, k],
// acc), and a bias, when there is one, is added after the chain. A tile of up to kRows rows by kCols columns keeps its
// accumulators in registers (the broadcast-A outer-product micro-kernel of a BLIS GEMM, Van Zee and van de Geijn 2015:
// one lane per column, so no lane sum); edge tiles run the same chain per element. Threads split rows and columns,
// never K. No GEMV special case, no dispatch by shape.
//
// Why our own: oneDNN's inner product on packed weights (vLLM's CPU backend's `onednn_mm`) pays a fixed cost per call
// that the few-row GEMMs of decode feel. On this project's 2-core Zen 4 EPYC a pass of SmolLM2-135M's 211 linear
// layers took 20.2 ms here against 29.8 on oneDNN's packed weights at 2 rows, 48.4 against 56.4 at 32 rows and 700.7
// against 706.0 at 512 rows (scripts/bench_cpu_linear.py at e341d09, docs/engine.md).
//
// Sibling projections (q/k/v, gate/up) are packed as one tensor whose panels never straddle two members (each member
// padded to whole panels), so one call writes each member's output into its own contiguous tensor: no split, no copy.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "fma16.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kCols = 32;  // two 16-lane vectors
constexpr int64_t kRows = 8;   // 16 accumulators
constexpr int64_t kInlineFmas = int64_t{1} << 20;  // below this many FMAs, no OpenMP region
constexpr int64_t kTaskRows = 128;  // rows of A per task: a panel of W is read once per task

// W [N, K] (any strides) -> [ceil(N / kCols), K, kCols], zero past N.
at::Tensor invariant_pack(const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2, "invariant_pack: float32 [N, K]");
  const int64_t N = w.size(0), K = w.size(1), P = (N + kCols - 1) / kCols;
  at::Tensor out = at::zeros({P, K, kCols}, w.options());
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t sn = w.stride(0), sk = w.stride(1);
  // Written in order, read as kCols streams advancing together (each cache line of a row used for 16 k's).
  auto pack = [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) {
      const int64_t cols = std::min(kCols, N - p * kCols);
      const float* rows = wp + p * kCols * sn;
      float* dst = op + p * K * kCols;
      for (int64_t k = 0; k < K; ++k, dst += kCols)
        for (int64_t j = 0; j < cols; ++j) dst[j] = rows[j * sn + k * sk];
    }
  };
  if (N * K < (int64_t{1} << 18)) {
    pack(0, P);
  } else {
    at::parallel_for(0, P, 1, pack);
  }
  return out;
}

// One tile: MR rows of A against one panel; `bias` (nullptr for none) holds the panel's first column's bias.
template <int MR>
inline void panel_tile(const float* a, int64_t lda, const float* bp, int64_t K, float* c, int64_t ldc, int64_t cols,
                       const float* bias) {
  vf acc0[MR], acc1[MR];
  for (int i = 0; i < MR; ++i) acc0[i] = vzero(), acc1[i] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    const vf b0 = vload(bp + k * kCols), b1 = vload(bp + k * kCols + 16);
    for (int i = 0; i < MR; ++i) {
#ifdef __AVX512F__
      const vf av = _mm512_set1_ps(a[i * lda + k]);
#else
      vf av;
      for (int l = 0; l < 16; ++l) av.l[l] = a[i * lda + k];
#endif
      acc0[i] = vfma(av, b0, acc0[i]);
      acc1[i] = vfma(av, b1, acc1[i]);
    }
  }
  if (bias != nullptr) {
    const vf bias0 = vload_n(bias, std::min<int64_t>(16, cols));
    const vf bias1 = cols > 16 ? vload_n(bias + 16, cols - 16) : vzero();
    for (int i = 0; i < MR; ++i) acc0[i] = vadd(acc0[i], bias0), acc1[i] = vadd(acc1[i], bias1);
  }
  for (int i = 0; i < MR; ++i) {
    float* row = c + i * ldc;
    if (cols == kCols) {
      vstore(row, acc0[i]);
      vstore(row + 16, acc1[i]);
    } else {
      vstore_n(row, acc0[i], std::min<int64_t>(16, cols));
      if (cols > 16) vstore_n(row + 16, acc1[i], cols - 16);
    }
  }
}

template <int MR>
inline void panel_rows(const float* a, int64_t lda, const float* bp, int64_t K, float* c, int64_t ldc, int64_t cols,
                       const float* bias, int64_t rows) {
  // rows < kRows: the same chain per element, in a tile of exactly `rows` rows.
  if constexpr (MR > 1) {
    if (rows < MR) return panel_rows<MR - 1>(a, lda, bp, K, c, ldc, cols, bias, rows);
  }
  panel_tile<MR>(a, lda, bp, K, c, ldc, cols, bias);
}

// Where one panel's columns go: output `member`, starting at its column `col`, `cols` of them.
struct PanelTarget {
  int64_t member, col, cols;
};

// A [M, K] (contiguous last dimension) @ the packed members' W^T: one new [M, sizes[i]] tensor per member, whose
// panels are ceil(sizes[i] / kCols) consecutive panels of `packed`; `bias` [sum(sizes)] or none.
std::vector<at::Tensor> packed_linear(const at::Tensor& a, const at::Tensor& packed, at::IntArrayRef sizes,
                                      const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(a.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, "packed_linear: float32 only");
  TORCH_CHECK(a.dim() == 2 && a.stride(1) == 1, "packed_linear: a must be [M, K] with a contiguous last dimension");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kCols && packed.is_contiguous() && packed.size(1) == a.size(1),
              "packed_linear: packed must be invariant_pack's [P, K, 32] for a's K");
  const int64_t M = a.size(0), K = a.size(1);
  std::vector<PanelTarget> targets;
  std::vector<at::Tensor> outs;
  int64_t total = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    TORCH_CHECK(sizes[i] >= 0, "packed_linear: sizes must not be negative");
    outs.push_back(at::empty({M, sizes[i]}, a.options()));
    for (int64_t col = 0; col < sizes[i]; col += kCols)
      targets.push_back({static_cast<int64_t>(i), col, std::min(kCols, sizes[i] - col)});
    total += sizes[i];
  }
  const int64_t P = static_cast<int64_t>(targets.size());
  TORCH_CHECK(packed.size(0) == P, "packed_linear: packed has ", packed.size(0), " panels, sizes need ", P);
  const float* biasp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == total,
                "packed_linear: bias must be float32 [sum(sizes)], contiguous");
    biasp = bias->data_ptr<float>();
  }
  if (M == 0) return outs;
  std::vector<int64_t> offsets(sizes.size(), 0);  // each member's first column in the bias
  for (size_t i = 1; i < sizes.size(); ++i) offsets[i] = offsets[i - 1] + sizes[i - 1];
  std::vector<float*> outp;
  for (auto& o : outs) outp.push_back(o.data_ptr<float>());
  const float* ap = a.data_ptr<float>();
  const float* bp = packed.data_ptr<float>();
  const int64_t lda = a.stride(0);
  const int64_t row_tasks = (M + kTaskRows - 1) / kTaskRows;
  auto task = [&](int64_t t) {
    const int64_t p = t % P, m0 = (t / P) * kTaskRows, m1 = std::min(M, m0 + kTaskRows);
    const PanelTarget& target = targets[p];
    const int64_t ldc = sizes[target.member];
    const float* panel = bp + p * K * kCols;
    const float* pbias = biasp != nullptr ? biasp + offsets[target.member] + target.col : nullptr;
    float* c = outp[target.member] + target.col;
    for (int64_t m = m0; m < m1; m += kRows)
      panel_rows<kRows>(ap + m * lda, lda, panel, K, c + m * ldc, ldc, target.cols, pbias, std::min(kRows, m1 - m));
  };
  const int64_t tasks = P * row_tasks;
  if (M * total * K < kInlineFmas) {
    for (int64_t t = 0; t < tasks; ++t) task(t);
  } else {
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) task(t);
    });
  }
  return outs;
}

// A [M, K] @ the packed W^T -> [M, N] (the batch-invariant mode's form: one member, no bias).
at::Tensor invariant_mm_packed(const at::Tensor& a, const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(N > (packed.size(0) - 1) * kCols && N <= packed.size(0) * kCols,
              "invariant_mm: N does not match the packed panels");
  return packed_linear(a, packed, {N}, std::nullopt)[0];
}

// A [M, K] @ W [N, K]^T with W packed for this call.
at::Tensor invariant_mm(const at::Tensor& a, const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && a.dim() == 2 && a.size(1) == w.size(1), "invariant_mm: a [M, K] and w [N, K], got ",
              a.sizes(), " and ", w.sizes());
  return invariant_mm_packed(a, invariant_pack(w), w.size(0));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rollout_cpu, m) {
  m.def("invariant_pack(Tensor w) -> Tensor");
  m.def("invariant_mm(Tensor a, Tensor b) -> Tensor");
  m.def("invariant_mm_packed(Tensor a, Tensor packed, int n) -> Tensor");
  m.def("packed_linear(Tensor a, Tensor packed, int[] sizes, Tensor? bias) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(rollout_cpu, CPU, m) {
  m.impl("invariant_pack", &invariant_pack);
  m.impl("invariant_mm", &invariant_mm);
  m.impl("invariant_mm_packed", &invariant_mm_packed);
  m.impl("packed_linear", &packed_linear);
}
