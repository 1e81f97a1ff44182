// rollout's batch-invariant CPU kernels (ContinuousBatchingConfig(batch_invariant=True), rollout.batch_invariant()):
// every output element is computed by one fixed sequence of float32 operations that depends only on its own row, never
// on how many rows the call has, where the row sits in the tensor, how the rows were split over threads, or how a
// sequence was split into chunks. The engine's step and the trainer's plain transformers forward both run these
// kernels (engine/worker/invariant.py), so a token's logprob is the same float on both sides.
//
// The rules (Thinking Machines' batch_invariant_ops and SGLang's deterministic mode, in CPU terms; the code is
// rollout's):
// - GEMM (`invariant_mm`, `invariant_mm_packed` on `invariant_pack`'s copy of W, in gemm_cpu.cpp, which the engine's
//   default float32 linear layers run too): every element one chain of fused multiply-adds over K in ascending order.
// - Row reductions (`invariant_mean`, `invariant_log_softmax`, `invariant_logsumexp`): each row alone, 16 lanes in ascending order, one
//   fixed lane tree.
// - Elementwise transcendental ops (`invariant_unary`: silu, gelu, cos, sin): the same code for every element,
//   wherever it lies (ATen's vectorized loops compute the tail of a range with scalar libm calls, which round
//   differently from the vector ones, so an element's value would depend on its position).
// - Attention (`invariant_attention_dense`, `invariant_paged_attention`): each query alone over its visible keys in
//   ascending position, scores by the same dot product, exp and weighted sum in one order; the paged form reads the
//   keys from the cache after the step wrote them, so a token's keys take the same path whether they were computed
//   in this step or an earlier one (prefill, chunked prefill, decode, prefix-cache hits, forks, preemption).
//
// float32 only: the mode is for the trainer's float32 forward on CPU.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "fma16.h"
#include "vec16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

namespace {

// dot(a, b) over n floats: 16 lanes in ascending order, then one fixed lane tree (the attention's scores).
inline float dot(const float* a, const float* b, int64_t n) {
  vf acc = vzero();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) acc = vfma(vload(a + k), vload(b + k), acc);
  if (k < n) acc = vfma(vload_n(a + k, n - k), vload_n(b + k, n - k), acc);
  return vsum(acc);
}

// ---- Row reductions over the last dimension of x [R, C] (contiguous rows).

void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, what, ": float32 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, what, ": x must be [rows, width] with a contiguous last dimension");
}

template <class F>
void for_rows(int64_t rows, int64_t width, F f) {
  if (rows * width < (int64_t{1} << 18)) {
    for (int64_t r = 0; r < rows; ++r) f(r);
  } else {
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, width));
    at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) f(r);
    });
  }
}

// The sum of n floats: 16 lanes in ascending order, the last partial group masked, then one fixed lane tree.
inline float row_sum(const float* x, int64_t n) {
  vf acc = vzero();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) acc = vadd(acc, vload(x + k));
  if (k < n) acc = vadd(acc, vload_n(x + k, n - k));
  return vsum(acc);
}

// mean(x, -1): [R].
at::Tensor invariant_mean(const at::Tensor& x) {
  check_rows(x, "invariant_mean");
  const int64_t R = x.size(0), C = x.size(1);
  at::Tensor out = at::empty({R}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for_rows(R, C, [&](int64_t r) { op[r] = row_sum(xp + r * x.stride(0), C) / static_cast<float>(C); });
  return out;
}

// exp(x) for x <= 0, 16 at a time (vec16.h's polynomial), applied to n floats in place; the last partial group runs
// through the same vector code on a padded copy, so every element gets the same computation.
void exp_nonpositive_inplace(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store16(x + i, exp_nonpositive(load16(x + i)));
  if (i < n) {
    float pad[16] = {0.f};
    std::memcpy(pad, x + i, sizeof(float) * (n - i));
    store16(pad, exp_nonpositive(load16(pad)));
    std::memcpy(x + i, pad, sizeof(float) * (n - i));
  }
}

// The log of the sum of exp over each row: max (exact in any order) + log(sum of exp(x - max) in 16 lanes ascending).
// log_softmax is x - this, so TRL's `selected_logit - logsumexp(logits)` and `log_softmax(logits)[token]` are one
// computation.
inline float row_logsumexp(const float* row, int64_t C, std::vector<float>& e) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t k = 0; k < C; ++k) m = std::max(m, row[k]);
  if (!std::isfinite(m)) return m;  // all -inf (or an inf/NaN logit): as the stock definitions
  e.resize(C);
  for (int64_t k = 0; k < C; ++k) e[k] = row[k] - m;
  exp_nonpositive_inplace(e.data(), C);
  return m + std::log(row_sum(e.data(), C));
}

// log_softmax(x, -1): [R, C].
at::Tensor invariant_log_softmax(const at::Tensor& x) {
  check_rows(x, "invariant_log_softmax");
  const int64_t R = x.size(0), C = x.size(1);
  at::Tensor out = at::empty({R, C}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for_rows(R, C, [&](int64_t r) {
    std::vector<float> e;
    const float* row = xp + r * x.stride(0);
    const float lse = row_logsumexp(row, C, e);
    for (int64_t k = 0; k < C; ++k) op[r * C + k] = row[k] - lse;
  });
  return out;
}

// logsumexp(x, -1): [R].
at::Tensor invariant_logsumexp(const at::Tensor& x) {
  check_rows(x, "invariant_logsumexp");
  const int64_t R = x.size(0), C = x.size(1);
  at::Tensor out = at::empty({R}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for_rows(R, C, [&](int64_t r) {
    std::vector<float> e;
    op[r] = row_logsumexp(xp + r * x.stride(0), C, e);
  });
  return out;
}

// ---- Elementwise ops, one formula per element wherever it lies (op: 0 silu, 1 gelu tanh, 2 gelu erf, 3 cos, 4 sin).
// silu (every layer of the Llama family) runs on 16 lanes; the others (Gemma's gelu, the rotary tables) are scalar.

at::Tensor invariant_unary(const at::Tensor& x_in, int64_t op) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat, "invariant_unary: float32 only");
  TORCH_CHECK(op >= 0 && op <= 4, "invariant_unary: op must be 0..4, got ", op);
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  const int64_t n = x.numel();
  auto run = [&](int64_t b, int64_t e) {
    switch (op) {
      case 0: {
        // vec16.h's silu16, 16 lanes; the last partial group on a padded copy through the same code.
        int64_t i = b;
        for (; i + 16 <= e; i += 16) store16(yp + i, silu16(load16(xp + i)));
        if (i < e) {
          float pad[16] = {0.f};
          std::memcpy(pad, xp + i, sizeof(float) * (e - i));
          store16(pad, silu16(load16(pad)));
          std::memcpy(yp + i, pad, sizeof(float) * (e - i));
        }
        break;
      }
      case 1:
        for (int64_t i = b; i < e; ++i) {
          const float v = xp[i];
          yp[i] = 0.5f * v * (1.f + std::tanh(0.7978845608028654f * (v + 0.044715f * v * v * v)));
        }
        break;
      case 2:
        for (int64_t i = b; i < e; ++i) yp[i] = 0.5f * xp[i] * (1.f + std::erf(xp[i] * 0.7071067811865476f));
        break;
      case 3:
        for (int64_t i = b; i < e; ++i) yp[i] = std::cos(xp[i]);
        break;
      default:
        for (int64_t i = b; i < e; ++i) yp[i] = std::sin(xp[i]);
    }
  };
  if (n < (int64_t{1} << 15)) {
    run(0, n);
  } else {
    at::parallel_for(0, n, int64_t{1} << 14, run);
  }
  return out;
}

// ---- Attention: one query against its visible keys in ascending position.

struct Scratch {
  std::vector<float> scores, acc;
};

// out [D] = softmax(scale * q . k_j) . v_j over the n keys key(0..n-1), value(0..n-1) in that order; 0 if n == 0.
// Returns the log of the softmax's denominator, logsumexp_j(scale * q . k_j) (+inf when no key: a backward that
// reads it then gives the row no gradient).
template <class KeyAt, class ValueAt>
inline float attend_one(const float* q, int64_t D, int64_t n, KeyAt key, ValueAt value, float scale, float softcap,
                       float* out, Scratch& s) {
  if (n == 0) {
    std::fill(out, out + D, 0.f);
    return std::numeric_limits<float>::infinity();
  }
  s.scores.resize(n);
  float* sc = s.scores.data();
  for (int64_t j = 0; j < n; ++j) {
    float v = dot(q, key(j), D) * scale;
    if (softcap > 0.f) v = softcap * std::tanh(v / softcap);
    sc[j] = v;
  }
  float m = sc[0];
  for (int64_t j = 1; j < n; ++j) m = std::max(m, sc[j]);
  for (int64_t j = 0; j < n; ++j) sc[j] = sc[j] - m;
  exp_nonpositive_inplace(sc, n);
  float total = 0.f;
  for (int64_t j = 0; j < n; ++j) total += sc[j];
  const float inv = 1.f / total;
  for (int64_t d = 0; d < D; d += 16) {
    const int64_t w = std::min<int64_t>(16, D - d);
    vf acc = vzero();
    for (int64_t j = 0; j < n; ++j) {
      const float p = sc[j];
#ifdef __AVX512F__
      const vf pv = _mm512_set1_ps(p);
#else
      vf pv;
      for (int i = 0; i < 16; ++i) pv.l[i] = p;
#endif
      acc = vfma(pv, w == 16 ? vload(value(j) + d) : vload_n(value(j) + d, w), acc);
    }
    float lanes[16];
    vstore(lanes, acc);
    for (int64_t i = 0; i < w; ++i) out[d + i] = lanes[i] * inv;
  }
  return m + std::log(total);
}

// q [B, H, T, D], k and v [B, Hkv, S, D] (any strides), allowed bool [B, T, S]: query t of batch row b sees key j
// where allowed[b, t, j]. Returns (out [B, H, T, D] laid out as [B, T, H, D], the layout of ATen's CPU flash
// attention; logsumexp [B, H, T], its second output).
std::tuple<at::Tensor, at::Tensor> invariant_attention_dense(const at::Tensor& q, const at::Tensor& k,
                                                             const at::Tensor& v, const at::Tensor& allowed_in,
                                                             double scale, double softcap) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "invariant_attention_dense: float32 only");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes(), "q [B, H, T, D], k and v [B, Hkv, S, D]");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && H % Hkv == 0, "q and k/v disagree: ", q.sizes(), " ", k.sizes());
  const at::Tensor allowed = allowed_in.to(at::kBool).contiguous();
  TORCH_CHECK(allowed.dim() == 3 && allowed.size(0) == B && allowed.size(1) == T && allowed.size(2) == S,
              "allowed must be bool [B, T, S]");
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  at::Tensor out = at::empty({B, T, H, D}, q.options());
  at::Tensor lse = at::empty({B, H, T}, q.options());
  const float *qp = qc.data_ptr<float>(), *kp = kc.data_ptr<float>(), *vp = vc.data_ptr<float>();
  const bool* ap = allowed.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const int64_t G = H / Hkv;
  at::parallel_for(0, B * T, 1, [&](int64_t begin, int64_t end) {
    Scratch s;
    std::vector<int64_t> keys;
    for (int64_t bt = begin; bt < end; ++bt) {
      const int64_t b = bt / T, t = bt % T;
      keys.clear();
      const bool* row = ap + (b * T + t) * S;
      for (int64_t j = 0; j < S; ++j)
        if (row[j]) keys.push_back(j);
      for (int64_t h = 0; h < H; ++h) {
        const float* kb = kp + ((b * Hkv + h / G) * S) * D;
        const float* vb = vp + ((b * Hkv + h / G) * S) * D;
        lp[(b * H + h) * T + t] = attend_one(
            qp + ((b * H + h) * T + t) * D, D, static_cast<int64_t>(keys.size()),
            [&](int64_t i) { return kb + keys[i] * D; }, [&](int64_t i) { return vb + keys[i] * D; },
            static_cast<float>(scale), static_cast<float>(softcap), op + ((b * T + t) * H + h) * D, s);
      }
    }
  });
  return {out.transpose(1, 2), lse};
}

// The paged form, with rollout_cpu::paged_attention's inputs: q [T, H, D]; k_cache, v_cache [num_blocks,
// block_size, Hkv, D]; sequence b's queries are rows cu_seqlens_q[b]..cu_seqlens_q[b + 1] (none: row b alone) at the
// last positions of its keys (cu_seqlens_k differences or seqused_k), read through block_table int32 [B, W]; a query
// at position p sees keys max(0, p - window_left)..p (window_left < 0: from 0). Rows past the last sequence get 0.
at::Tensor invariant_paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                     const std::optional<at::Tensor>& cu_seqlens_q,
                                     const std::optional<at::Tensor>& cu_seqlens_k,
                                     const std::optional<at::Tensor>& seqused_k, const at::Tensor& block_table,
                                     double scale, int64_t window_left, double softcap) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [T, H, D] with a contiguous last dimension");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.strides() == v_cache.strides() &&
                  k_cache.stride(3) == 1,
              "k_cache and v_cache must be [num_blocks, block_size, Hkv, D] of one shape and strides");
  TORCH_CHECK(cu_seqlens_k.has_value() != seqused_k.has_value(), "give one of cu_seqlens_k and seqused_k");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % Hkv == 0, "the cache's heads or head dim disagree with q's");
  const at::Tensor tables = block_table.to(at::kInt).contiguous();
  const int64_t B = tables.size(0), W = tables.size(1);
  std::vector<int64_t> q_start(B), q_len(B), k_len(B);
  if (cu_seqlens_q.has_value()) {
    const at::Tensor c = cu_seqlens_q->to(at::kLong).contiguous();
    TORCH_CHECK(c.numel() == B + 1, "cu_seqlens_q must have B + 1 entries");
    const int64_t* cp = c.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) q_start[b] = cp[b], q_len[b] = cp[b + 1] - cp[b];
  } else {
    TORCH_CHECK(T == B, "without cu_seqlens_q, q must have one row per sequence");
    for (int64_t b = 0; b < B; ++b) q_start[b] = b, q_len[b] = 1;
  }
  if (cu_seqlens_k.has_value()) {
    const at::Tensor c = cu_seqlens_k->to(at::kLong).contiguous();
    TORCH_CHECK(c.numel() == B + 1, "cu_seqlens_k must have B + 1 entries");
    const int64_t* cp = c.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) k_len[b] = cp[b + 1] - cp[b];
  } else {
    const at::Tensor u = seqused_k->to(at::kLong).contiguous();
    TORCH_CHECK(u.numel() == B, "seqused_k must have B entries");
    const int64_t* up = u.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) k_len[b] = up[b];
  }
  std::vector<int64_t> row_seq(T, -1);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(q_len[b] >= 0 && q_len[b] <= k_len[b] && k_len[b] <= W * bs, "sequence ", b, ": ", q_len[b],
                " queries, ", k_len[b], " keys, a table of ", W, " blocks");
    TORCH_CHECK(q_start[b] + q_len[b] <= T, "sequence ", b, "'s queries run past q");
    for (int64_t i = 0; i < q_len[b]; ++i) row_seq[q_start[b] + i] = b;
  }
  at::Tensor out = at::empty({T, H, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float *kp = k_cache.data_ptr<float>(), *vp = v_cache.data_ptr<float>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const int64_t s_block = k_cache.stride(0), s_slot = k_cache.stride(1), s_head = k_cache.stride(2);
  const int64_t G = H / Hkv;
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    Scratch s;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = row_seq[t];
      if (b < 0) {
        std::fill(op + t * H * D, op + (t + 1) * H * D, 0.f);
        continue;
      }
      const int64_t pos = k_len[b] - q_len[b] + (t - q_start[b]);
      const int64_t lo = window_left >= 0 ? std::max<int64_t>(0, pos - window_left) : 0;
      const int32_t* table = tp + b * W;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t kvh = h / G;
        auto at_pos = [&](const float* base, int64_t i) {
          const int64_t j = lo + i;
          return base + static_cast<int64_t>(table[j / bs]) * s_block + (j % bs) * s_slot + kvh * s_head;
        };
        attend_one(
            qp + t * q.stride(0) + h * q.stride(1), D, pos - lo + 1, [&](int64_t i) { return at_pos(kp, i); },
            [&](int64_t i) { return at_pos(vp, i); }, static_cast<float>(scale), static_cast<float>(softcap),
            op + (t * H + h) * D, s);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rollout_cpu, m) {
  m.def("invariant_mean(Tensor x) -> Tensor");
  m.def("invariant_log_softmax(Tensor x) -> Tensor");
  m.def("invariant_logsumexp(Tensor x) -> Tensor");
  m.def("invariant_unary(Tensor x, int op) -> Tensor");
  m.def(
      "invariant_attention_dense(Tensor q, Tensor k, Tensor v, Tensor allowed, float scale, float softcap) -> "
      "(Tensor, Tensor)");
  m.def(
      "invariant_paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? cu_seqlens_q, "
      "Tensor? cu_seqlens_k, Tensor? seqused_k, Tensor block_table, float scale, int window_left, float softcap) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(rollout_cpu, CPU, m) {
  m.impl("invariant_mean", &invariant_mean);
  m.impl("invariant_log_softmax", &invariant_log_softmax);
  m.impl("invariant_logsumexp", &invariant_logsumexp);
  m.impl("invariant_unary", &invariant_unary);
  m.impl("invariant_attention_dense", &invariant_attention_dense);
  m.impl("invariant_paged_attention", &invariant_paged_attention);
}
