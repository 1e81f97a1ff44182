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
//
// lora_add_group_ runs sibling layers that read one input (q/k/v, gate/up) in one call: the fused forward
// (rollout/engine/worker/fused_layer.py) adds a decoder layer's adapters with 4 calls and no Python hook.

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

// One row's product: orow [N] += ((xr [K] a^T [K, W]) * mrow [W]) b [W, N] (mrow null: no mask), s [W] scratch. A
// masked-out or zero column reads no row of b. Both ops run their rows through it, so a member of a group gets the
// same bits as lora_add_ alone.
inline void add_row(const float* __restrict xr, const float* __restrict ap, const float* __restrict bp,
                    const float* mrow, float* __restrict orow, float* __restrict s, int64_t K, int64_t W, int64_t N) {
  for (int64_t w = 0; w < W; ++w) {
    const float scale = mrow != nullptr ? mrow[w] : 1.f;
    s[w] = scale == 0.f ? 0.f : dot(xr, ap + w * K, K) * scale;
  }
  for (int64_t w = 0; w < W; ++w) {
    const float sw = s[w];
    if (sw == 0.f) continue;
    const float* __restrict br = bp + w * N;
#pragma omp simd
    for (int64_t n = 0; n < N; ++n) orow[n] += sw * br[n];
  }
}

// The mask's data and row stride (null and 0 without one), checked as [T, W] float32 with contiguous rows.
const float* mask_rows(const std::optional<at::Tensor>& mask, int64_t T, int64_t W, int64_t* stride, const char* op) {
  if (!mask.has_value()) return nullptr;
  TORCH_CHECK(mask->dim() == 2 && mask->size(0) == T && mask->size(1) == W && mask->stride(1) == 1 &&
                  mask->scalar_type() == at::kFloat,
              op, ": mask must be float32 [T, W] with contiguous rows");
  *stride = mask->stride(0);
  return mask->data_ptr<float>();
}

// Checks one member (out [T, N] += ((x [T, K] a^T) * mask) b, a [W, K], b [W, N]) and returns its W.
int64_t check_member(const at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                     const char* op) {
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && a.dim() == 2 && b.dim() == 2, op, ": 2-D tensors expected");
  TORCH_CHECK(out.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat && a.scalar_type() == at::kFloat &&
                  b.scalar_type() == at::kFloat,
              op, ": float32 tensors expected");
  const int64_t T = x.size(0), K = x.size(1), W = a.size(0), N = b.size(1);
  TORCH_CHECK(a.size(1) == K && b.size(0) == W && out.size(0) == T && out.size(1) == N, op, ": shapes differ");
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous(), op, ": a and b must be contiguous");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, op, ": x and out must have contiguous rows");
  return W;
}

// Sibling layers on one input (q/k/v, gate/up): outs[i] [T, N_i] += ((x a[i]^T) * mask) b[i], each row of x taken
// once for every member in turn, so a step runs one call (and at most one parallel region) per group. The rows are
// split by the work of all members together; each member's row is add_row's. Members may differ in W only without a
// mask. op_name names the calling op in errors.
void add_members(at::TensorList outs, const at::Tensor& x, at::TensorList a, at::TensorList b,
                 const std::optional<at::Tensor>& mask, const char* op_name) {
  const int64_t G = static_cast<int64_t>(outs.size());
  TORCH_CHECK(static_cast<int64_t>(a.size()) == G && static_cast<int64_t>(b.size()) == G, op_name,
              ": outs, a and b must have one tensor per member");
  if (G == 0) return;
  TORCH_CHECK(x.dim() == 2, op_name, ": 2-D tensors expected");
  const int64_t T = x.size(0), K = x.size(1);
  std::vector<int64_t> W(G), N(G), o_stride(G);
  std::vector<const float*> ap(G), bp(G);
  std::vector<float*> op(G);
  int64_t work = 0, w_max = 0;
  for (int64_t i = 0; i < G; ++i) {
    W[i] = check_member(outs[i], x, a[i], b[i], op_name);
    N[i] = b[i].size(1);
    ap[i] = a[i].data_ptr<float>();
    bp[i] = b[i].data_ptr<float>();
    op[i] = outs[i].data_ptr<float>();
    o_stride[i] = outs[i].stride(0);
    work += W[i] * (K + N[i]);
    w_max = std::max(w_max, W[i]);
  }
  int64_t m_stride = 0;
  const float* m = mask_rows(mask, T, w_max, &m_stride, op_name);
  TORCH_CHECK(m == nullptr || std::all_of(W.begin(), W.end(), [&](int64_t w) { return w == w_max; }), op_name,
              ": with a mask, every member's a must have the mask's W rows");
  const float* xp = x.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  const int64_t grain = std::max<int64_t>(1, kWorkPerTask / std::max<int64_t>(1, work));
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> s(w_max);
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = xp + t * x_stride;
      const float* mrow = m != nullptr ? m + t * m_stride : nullptr;
      for (int64_t i = 0; i < G; ++i) {
        add_row(xr, ap[i], bp[i], mrow, op[i] + t * o_stride[i], s.data(), K, W[i], N[i]);
      }
    }
  });
}

// out [T, N] += ((x [T, K] a^T [K, W]) * mask [T, W]) b [W, N], in place; float32; x, out and mask may have any row
// stride, a and b are contiguous. A row whose masked product is zero (a base-model token) reads no row of b.
void lora_add_(at::Tensor out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
               const std::optional<at::Tensor>& mask) {
  add_members({out}, x, {a}, {b}, mask, "lora_add_");
}

// lora_add_ for sibling layers on one input (add_members), so a member's result is lora_add_'s bit for bit.
void lora_add_group_(at::TensorList outs, const at::Tensor& x, at::TensorList a, at::TensorList b,
                     const std::optional<at::Tensor>& mask) {
  add_members(outs, x, a, b, mask, "lora_add_group_");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rollout_cpu, m) {
  m.def("lora_add_(Tensor(a!) out, Tensor x, Tensor a, Tensor b, Tensor? mask) -> ()");
  m.def("lora_add_group_(Tensor(a!)[] outs, Tensor x, Tensor[] a, Tensor[] b, Tensor? mask) -> ()");
}

TORCH_LIBRARY_IMPL(rollout_cpu, CPU, m) {
  m.impl("lora_add_", &lora_add_);
  m.impl("lora_add_group_", &lora_add_group_);
}
