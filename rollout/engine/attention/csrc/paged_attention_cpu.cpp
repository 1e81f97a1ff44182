// Paged attention on CPU: each query row reads its sequence's keys and values in place, through the block
// table, with no gather into a contiguous copy.
//
// Semantics are flash-attn 2's `flash_attn_varlen_func` with a paged cache (flash_attn_interface.py): the causal
// mask is aligned to the bottom right of each sequence's (queries x keys) matrix, so query row i of a sequence of
// q_len queries and k_len keys sits at position p = k_len - q_len + i and sees keys j with
// p - window_left <= j <= p (window_left < 0: from key 0); softcap > 0 caps the scaled scores as
// softcap * tanh(score / softcap). Rows after the last sequence (cu_seqlens_q[B] <= t < T) belong to no sequence:
// their output is 0. vLLM's CPU backend has a kernel of this kind (`cpu_attention_with_kv_cache`); this one is
// written for rollout from those semantics.
//
// Work is split over tiles of up to 16 query rows of one sequence, in parallel over ATen's OpenMP threads (the build
// passes -fopenmp, whose calls resolve to torch's own libgomp), which take the tiles largest first from a shared
// counter. A tile computes every head, so each key and value row of the cache (all KV heads, contiguous) is read once
// per tile, in cache order: the kernel streams the blocks as they lie in memory (per KV head, a row would be a 1/Hkv
// slice of every cache line span). Scores are computed in float32 whatever the cache's dtype, then a softmax over each
// row's visible keys; the output has q's dtype.
//
// A tile of a prefill is a small matrix product, QK^T then PV, and is computed as one: the keys are taken kChunk
// (32) consecutive positions at a time, a chunk's rows of one KV head are transposed into a D x 32 buffer once, and
// its scores against the head's queries are accumulated in registers, 8 queries x 32 keys at a time with AVX-512,
// each loaded row of the transposed keys feeding 16 vector FMAs with a query's element broadcast (the outer-product
// micro-kernel of a GEMM); the weighted sum keeps a few queries' D-wide accumulators in registers across a chunk,
// each value row loaded once for them. Computed one score at a time instead, a dot product ends in a lane sum per
// (query, key) and the weighted sum loads and stores a query's accumulator for every key, which made prefills
// several times slower than vLLM's CPU attention (issue 35). The idea is flash-attention's (Dao et al. 2022: a block
// of queries against a block of keys as matrix products on the fast units) and vLLM's CPU attention's
// (csrc/cpu/cpu_attn_vec.hpp: a tile GEMM of 8 broadcast query rows by 32 keys); the code is rollout's. Tiles with
// few queries per KV head (a decode step's) keep the dot-product path (kGemmQueries says why).
//
// Speed (scripts/bench_cpu_attention.py, docs/profile.md): a decode step reads every layer's keys and values from
// memory, so the rows of the next block are prefetched while a block is computed on; dot products, exp and the
// weighted sums run on 16-lane vectors, with the head dim a compile-time constant for 64 and 128. The G samples of
// one prompt (prompt forks) share the prompt's blocks: a decode step's consecutive sequences whose block tables begin
// with the same blocks form one work item (attend_decode_group) that reads each shared key and value row once for all
// of them, with every row's arithmetic unchanged (the idea of cascade attention for shared prefixes: FlashInfer's
// "cascade inference", vLLM's cascade attention; they merge two partial softmaxes, this one keeps one softmax per row
// over all its keys, so its output is bit for bit the ungrouped one).

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <torch/library.h>

#include "vec16.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {


// The sum of the 16 lanes as a tree of shuffles where AVX-512 has one (an in-order chain of 15 scalar adds otherwise,
// which is what GCC makes of `omp simd reduction` here).
inline float hsum(f32x16 v) {
#ifdef __AVX512F__
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#else
  const float* l = reinterpret_cast<const float*>(&v);
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
  for (int i = 0; i < 16; i += 4) s0 += l[i], s1 += l[i + 1], s2 += l[i + 2], s3 += l[i + 3];
  return (s0 + s1) + (s2 + s3);
#endif
}

// The largest of the 16 lanes, as hsum.
inline float hmax(f32x16 v) {
#ifdef __AVX512F__
  return _mm512_reduce_max_ps(reinterpret_cast<__m512>(v));
#else
  const float* l = reinterpret_cast<const float*>(&v);
  float m0 = l[0], m1 = l[1], m2 = l[2], m3 = l[3];
  for (int i = 4; i < 16; i += 4)
    m0 = std::max(m0, l[i]), m1 = std::max(m1, l[i + 1]), m2 = std::max(m2, l[i + 2]), m3 = std::max(m3, l[i + 3]);
  return std::max(std::max(m0, m1), std::max(m2, m3));
#endif
}

// The dot product of a float32 query and a float32 key row. kD > 0 (a multiple of 16) fixes D at compile time: a few
// vector FMAs and one lane sum; kD = 0 reads D at run time.
template <int kD>
inline float dot(const float* __restrict q, const float* __restrict k, int64_t D) {
  if constexpr (kD > 0) {
    f32x16 acc = load16(q) * load16(k);
    for (int d = 16; d < kD; d += 16) acc += load16(q + d) * load16(k + d);
    return hsum(acc);
  } else {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t d = 0; d < D; ++d) sum += q[d] * k[d];
    return sum;
  }
}

// acc += p * v over D (vectorized).
template <int kD>
inline void add_scaled(float* __restrict acc, float p, const float* __restrict v, int64_t D) {
  const int64_t n = kD > 0 ? kD : D;
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) acc[d] += p * v[d];
}

// A key or value row of one KV head as float32: the cache row itself for a float32 cache, else converted into buf.
template <typename scalar_t>
inline const float* as_float(const scalar_t* row, float* buf, int64_t D) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return row;
  } else {
    for (int64_t d = 0; d < D; ++d) buf[d] = static_cast<float>(row[d]);
    return buf;
  }
}

// Keys per chunk of the GEMM-shaped path: two 16-lane vectors of scores per query, one block of SmolLM2's cache.
constexpr int kChunk = 32;
// Queries per call of the score micro-kernel (2 accumulators each) and vectors a value micro-kernel keeps as
// accumulators: with AVX-512's 32 registers, 16 accumulators leave room for the loaded keys or values; an f32x16 is
// two registers with AVX2 (16 of them), so there the blocks are a quarter the size.
#ifdef __AVX512F__
constexpr int kScoreQueries = 8;
constexpr int kValueVectors = 16;
#else
constexpr int kScoreQueries = 2;
constexpr int kValueVectors = 4;
#endif
// A tile takes the GEMM-shaped path when each KV head has at least this many of its queries. A chunk's transpose
// (64 shuffles per 16 x 16 floats) is paid once per KV head and shared by its queries, while the lane sums and the
// per-key stores of the accumulator it saves are per query: with fewer queries it costs about as much as it saves.
// A decode step (one row per sequence) of a model with query groups under 8 (SmolLM2's are 3) so keeps the
// dot-product path tuned for it, whose time is mostly the cache's reads from memory.
constexpr int64_t kGemmQueries = 8;

// kT[d * kChunk + i] = rows[i][d] for the kChunk rows of a chunk (D floats each): one 16-lane load of kT then holds
// dimension d of 16 keys. With AVX-512 a 16 x 16 block is transposed in four rounds of 16 two-register shuffles (pairs,
// then quads within each 128-bit lane, then 128-bit lanes twice), otherwise element by element.
template <int kD>
inline void transpose_chunk(const float* const* rows, float* __restrict kT, int64_t D) {
#ifdef __AVX512F__
  if constexpr (kD > 0) {
    for (int half = 0; half < kChunk; half += 16)
      for (int d0 = 0; d0 < kD; d0 += 16) {
        __m512 r[16], t[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(rows[half + i] + d0);
        for (int i = 0; i < 16; i += 2) {
          t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
          t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
        }
        // r[4 * k + c], 128-bit lane l: column 4 * l + c of rows 4 * k .. 4 * k + 3.
        for (int i = 0; i < 16; i += 4) {
          r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
          r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
          r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
          r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
        }
        for (int c = 0; c < 4; ++c) {
          const __m512 a = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88), b = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xDD);
          const __m512 e = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
          const __m512 f = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xDD);
          float* col = kT + (d0 + c) * kChunk + half;
          _mm512_storeu_ps(col, _mm512_shuffle_f32x4(a, e, 0x88));
          _mm512_storeu_ps(col + 4 * kChunk, _mm512_shuffle_f32x4(b, f, 0x88));
          _mm512_storeu_ps(col + 8 * kChunk, _mm512_shuffle_f32x4(a, e, 0xDD));
          _mm512_storeu_ps(col + 12 * kChunk, _mm512_shuffle_f32x4(b, f, 0xDD));
        }
      }
    return;
  }
#endif
  for (int i = 0; i < kChunk; ++i)
    for (int64_t d = 0; d < D; ++d) kT[d * kChunk + i] = rows[i][d];
}

// out[j][0:kChunk] = the scores of query j against the chunk's keys, for N queries at once: each row of kT (dimension
// d of the chunk's keys, two vectors) is loaded once and feeds 2N FMAs with q_j[d] broadcast, the outer-product form
// of a GEMM's micro-kernel, with no lane sum per score.
template <int kD, int N>
inline void score_chunk(const float* const* qs, const float* __restrict kT, float* const* out, int64_t D) {
  const float* q[N];
  for (int j = 0; j < N; ++j) q[j] = qs[j];
  f32x16 lo[N], hi[N];
  for (int j = 0; j < N; ++j) lo[j] = hi[j] = f32x16{};
  const int64_t dims = kD > 0 ? kD : D;
  for (int64_t d = 0; d < dims; ++d) {
    const f32x16 k0 = load16(kT + d * kChunk), k1 = load16(kT + d * kChunk + 16);
    for (int j = 0; j < N; ++j) {
      const float qd = q[j][d];
      lo[j] += qd * k0;
      hi[j] += qd * k1;
    }
  }
  float* o[N];
  for (int j = 0; j < N; ++j) o[j] = out[j];
  for (int j = 0; j < N; ++j) {
    store16(o[j], lo[j]);
    store16(o[j] + 16, hi[j]);
  }
}

// score_chunk for n <= N queries (a group's remainder), its query count made a compile-time constant.
template <int kD, int N>
inline void score_queries(int n, const float* const* qs, const float* kT, float* const* out, int64_t D) {
  if constexpr (N > 1) {
    if (n < N) return score_queries<kD, N - 1>(n, qs, kT, out, D);
  }
  score_chunk<kD, N>(qs, kT, out, D);
}

// acc_j[0:kD] += sum over the chunk's keys i of p_j[i] * v_i[0:kD], for N queries: their accumulators stay in
// registers across the chunk (kD / 16 vectors each) and each value vector is loaded once for the N of them. A
// partial chunk is padded with zero rows (its padding's probabilities are 0 too): with a trip count known at compile
// time GCC keeps the accumulators in registers, where a loop that may run 0 times also gets copies on the stack.
template <int kD, int N>
inline void weigh_chunk(float* const* accs, const float* const* ps, const float* const* vs) {
  constexpr int kB = kD / 16;
  // Local copies of the pointers: a store through store16's memcpy may alias anything, the caller's arrays of
  // pointers included, which would then be read again after every store.
  float* a[N];
  const float* p[N];
  for (int j = 0; j < N; ++j) a[j] = accs[j], p[j] = ps[j];
  f32x16 acc[N][kB];
  for (int j = 0; j < N; ++j)
    for (int b = 0; b < kB; ++b) acc[j][b] = load16(a[j] + 16 * b);
  for (int i = 0; i < kChunk; ++i) {
    const float* v = vs[i];
    for (int b = 0; b < kB; ++b) {
      const f32x16 vb = load16(v + 16 * b);
      for (int j = 0; j < N; ++j) acc[j][b] += p[j][i] * vb;
    }
  }
  for (int j = 0; j < N; ++j)
    for (int b = 0; b < kB; ++b) store16(a[j] + 16 * b, acc[j][b]);
}

// weigh_chunk for n <= N queries, as score_queries.
template <int kD, int N>
inline void weigh_queries(int n, float* const* accs, const float* const* ps, const float* const* vs) {
  if constexpr (N > 1) {
    if (n < N) return weigh_queries<kD, N - 1>(n, accs, ps, vs);
  }
  weigh_chunk<kD, N>(accs, ps, vs);
}

// The softmax of one query vector's scores sm[0:ns] over its visible keys [first, last]: scaled (or soft-capped)
// in place, then probabilities; masked keys (and the row's padding) get 0. The loops run over groups of 16 keys from
// a multiple of 16 (a row's padding to ns, a multiple of 16, keeps each group inside it), the lanes outside the
// visible keys masked: a row's result depends on its scores and [first, last] alone.
inline void softmax_row(float* sm, int64_t first, int64_t last, int64_t ns, float scale, float softcap) {
  i32x16 lane;
  for (int l = 0; l < 16; ++l) lane[l] = l;
  const float factor = softcap > 0.f ? 1.f : scale;  // softcap's loop scales the scores itself
  const int64_t begin = first / 16 * 16, end = last / 16 * 16 + 16;
  if (softcap > 0.f)
    for (int64_t i = first; i <= last; ++i) sm[i] = softcap * std::tanh(sm[i] * scale / softcap);
  auto visible = [&](int64_t i) {
    const i32x16 key = lane + static_cast<int32_t>(i);
    return (key >= static_cast<int32_t>(first)) & (key <= static_cast<int32_t>(last));
  };
  f32x16 tops = f32x16{} - std::numeric_limits<float>::infinity();
  for (int64_t i = begin; i < end; i += 16) {
    const f32x16 x = load16(sm + i) * factor;
    store16(sm + i, x);
    tops = visible(i) & (x > tops) ? x : tops;
  }
  const float top = hmax(tops);
  // exp(score - top), masked lanes set to 0 and so left out of the sum (exp's argument clamped to <= 0 there).
  f32x16 sums{};
  for (int64_t i = begin; i < end; i += 16) {
    const f32x16 x = load16(sm + i) - top;
    const f32x16 e = exp_nonpositive(x > 0.f ? f32x16{} : x);
    const f32x16 p = visible(i) ? e : f32x16{};
    store16(sm + i, p);
    sums += p;
  }
  const float inv = 1.f / hsum(sums);
  for (int64_t i = begin; i < end; i += 16) store16(sm + i, load16(sm + i) * inv);
  std::fill(sm, sm + begin, 0.f);
  std::fill(sm + end, sm + ns, 0.f);
}

// The thread's scratch buffers, reused across its work items. The scores of a tile take R x H x (keys) floats:
// 16 rows x 32 heads x 32k keys is 64 MB per thread, the price of reading every cache row once per tile.
struct Scratch {
  std::vector<float> q, scores, acc, row, stage, kT, zero;
  std::vector<int64_t> queries;
};

// One tile of consecutive query rows of one sequence (rows r = 0..R-1 at positions p0 + r), every head: the tile's
// R x H queries over keys [lo(0), p0 + R - 1], row r masked to [lo(r), p0 + r] where
// lo(r) = max(0, p0 + r - window_left) (0 without a window). Query heads g*G..g*G+G-1 read KV head g. Each key and
// value row is read once for the whole tile, in cache order, and used by its G x R queries while it is in L1.
template <typename scalar_t, int kD>
void attend_tile(const scalar_t* q, int64_t q_row_stride, int64_t q_head_stride, int64_t R, int64_t p0,
                 int64_t window_left, const scalar_t* k_cache, const scalar_t* v_cache, const int32_t* table,
                 int64_t block_size, int64_t block_stride, int64_t token_stride, int64_t head_stride, int64_t H,
                 int64_t G, int64_t D_runtime, float scale, float softcap, scalar_t* out, int64_t out_row_stride,
                 const scalar_t* after, Scratch& s) {
  const int64_t D = kD > 0 ? kD : D_runtime;
  const int64_t Hkv = H / G;
  const int64_t M = R * H;  // query vectors of the tile: m = r * H + h
  auto lo_of = [&](int64_t r) { return window_left >= 0 ? std::max<int64_t>(0, p0 + r - window_left) : int64_t{0}; };
  const int64_t jlo = lo_of(0), jhi = p0 + R - 1, n = jhi - jlo + 1;
  // A row of scores is padded to whole chunks, which the GEMM-shaped path stores whole.
  const int64_t ns = (n + kChunk - 1) / kChunk * kChunk;
  const bool gemm = R * G >= kGemmQueries;
  // Calls fn(i = j - jlo, offset of key position j's row) for j = jlo..jhi, a block at a time: one table read per
  // block, no division per key.
  // Each key row is fetched ahead: while a block is read, the same rows of the next block (of the table, or at the
  // last block, of the stream read after this one: the values' first block, then the next tile's keys) are
  // prefetched, so the cache lines arrive while the rows before them are computed on (blocks lie anywhere in the
  // cache, so the hardware prefetchers, which follow addresses, cannot guess the next one).
  const int64_t row_bytes = Hkv * head_stride * static_cast<int64_t>(sizeof(scalar_t));
  const int64_t last_block = jhi / block_size;
  auto block_start = [&](const scalar_t* cache, int64_t block) {
    return reinterpret_cast<const char*>(cache + static_cast<int64_t>(table[block]) * block_stride);
  };
  auto for_each_key = [&](const scalar_t* cache, const char* following, auto&& fn) {
    for (int64_t j = jlo; j <= jhi;) {
      const int64_t block = j / block_size, last = std::min(jhi, (block + 1) * block_size - 1);
      const int64_t base = static_cast<int64_t>(table[block]) * block_stride;
      const char* next = block < last_block ? block_start(cache, block + 1) : following;
      for (int64_t off = j - block * block_size; j <= last; ++j, ++off) {
        if (next != nullptr) {
          const char* ahead = next + off * token_stride * static_cast<int64_t>(sizeof(scalar_t));
          for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(ahead + b, 0, 3);
        }
        fn(j - jlo, base + off * token_stride);
      }
    }
  };
  // Calls fn(i0, count, offsets of the rows of keys jlo + i0 .. jlo + i0 + count - 1) for chunks of kChunk
  // consecutive keys (a chunk may span blocks), the last one of count < kChunk keys when kChunk does not divide n.
  auto for_each_chunk = [&](const scalar_t* cache, const char* following, auto&& fn) {
    int64_t rows[kChunk];
    int count = 0;
    for_each_key(cache, following, [&](int64_t i, int64_t row) {
      rows[count++] = row;
      if (count == kChunk || i == n - 1) {
        fn(i + 1 - count, count, rows);
        count = 0;
      }
    });
  };

  s.q.resize(M * D);
  s.row.resize(D);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < H; ++h) {
      const scalar_t* qh = q + r * q_row_stride + h * q_head_stride;
      float* qm = s.q.data() + (r * H + h) * D;
      for (int64_t d = 0; d < D; ++d) qm[d] = static_cast<float>(qh[d]);
    }
  s.scores.resize(M * ns);
  float* scores = s.scores.data();
  const float* qs = s.q.data();
  float* buf = s.row.data();
  // The GEMM-shaped path: KV head g's queries, m = r * H + g * G + u, listed at queries[g * R * G ..], and a chunk's
  // rows of one KV head as float32 (a float32 cache's own rows, else converted into stage; zero rows pad a chunk).
  const int64_t RG = R * G;
  const float* chunk_rows[kChunk];
  auto chunk_of = [&](const scalar_t* cache, const int64_t* rows, int count, int64_t g) {
    for (int c = 0; c < kChunk; ++c)
      chunk_rows[c] =
          c < count ? as_float(cache + rows[c] + g * head_stride, s.stage.data() + c * D, D) : s.zero.data();
  };
  if (gemm) {
    s.queries.resize(Hkv * RG);
    for (int64_t g = 0; g < Hkv; ++g)
      for (int64_t r = 0; r < R; ++r)
        for (int64_t u = 0; u < G; ++u) s.queries[g * RG + r * G + u] = r * H + g * G + u;
    s.stage.resize(kChunk * D);
    s.kT.resize(kChunk * D);
    s.zero.assign(D, 0.f);
  }
  // Scores: each key row is read once for the tile's queries of its KV head. GEMM-shaped: a chunk's keys of one KV
  // head are transposed once, then scored against every query of that head, kScoreQueries at a time.
  if (gemm) {
    for_each_chunk(k_cache, block_start(v_cache, jlo / block_size), [&](int64_t i0, int count, const int64_t* rows) {
      for (int64_t g = 0; g < Hkv; ++g) {
        chunk_of(k_cache, rows, count, g);
        transpose_chunk<kD>(chunk_rows, s.kT.data(), D);
        const int64_t* mg = s.queries.data() + g * RG;
        for (int64_t j = 0; j < RG; j += kScoreQueries) {
          const int group = static_cast<int>(std::min<int64_t>(kScoreQueries, RG - j));
          const float* qp[kScoreQueries];
          float* op[kScoreQueries];
          for (int u = 0; u < group; ++u) qp[u] = qs + mg[j + u] * D, op[u] = scores + mg[j + u] * ns + i0;
          score_queries<kD, kScoreQueries>(group, qp, s.kT.data(), op, D);
        }
      }
    });
  } else {
    for_each_key(k_cache, block_start(v_cache, jlo / block_size), [&](int64_t i, int64_t row) {
      for (int64_t g = 0; g < Hkv; ++g) {
        const float* k = as_float(k_cache + row + g * head_stride, buf, D);
        for (int64_t r = 0; r < R; ++r)
          for (int64_t m = r * H + g * G; m < r * H + (g + 1) * G; ++m)
            scores[m * ns + i] = dot<kD>(qs + m * D, k, D);
      }
    });
  }
  // Softmax per query vector over its visible keys.
  for (int64_t m = 0; m < M; ++m) {
    const int64_t r = m / H;
    softmax_row(scores + m * ns, lo_of(r) - jlo, p0 + r - jlo, ns, scale, softcap);  // visible: [first, last]
  }
  // The weighted sum of the values: each value row is read once for the tile's queries of its KV head. GEMM-shaped
  // (a head dim known at compile time): per chunk and KV head, each query's accumulator is loaded and stored once.
  s.acc.assign(M * D, 0.f);
  float* acc = s.acc.data();
  if constexpr (kD > 0) {
    if (gemm) {
      constexpr int kValueQueries = std::max(1, kValueVectors / (kD / 16));
      for_each_chunk(v_cache, reinterpret_cast<const char*>(after), [&](int64_t i0, int count, const int64_t* rows) {
        for (int64_t g = 0; g < Hkv; ++g) {
          chunk_of(v_cache, rows, count, g);
          const int64_t* mg = s.queries.data() + g * RG;
          for (int64_t j = 0; j < RG; j += kValueQueries) {
            const int group = static_cast<int>(std::min<int64_t>(kValueQueries, RG - j));
            float* ap[kValueQueries];
            const float* pp[kValueQueries];
            for (int u = 0; u < group; ++u) ap[u] = acc + mg[j + u] * D, pp[u] = scores + mg[j + u] * ns + i0;
            weigh_queries<kD, kValueQueries>(group, ap, pp, chunk_rows);
          }
        }
      });
    }
  }
  if (kD == 0 || !gemm) {
    for_each_key(v_cache, reinterpret_cast<const char*>(after), [&](int64_t i, int64_t row) {
      for (int64_t g = 0; g < Hkv; ++g) {
        const float* v = as_float(v_cache + row + g * head_stride, buf, D);
        for (int64_t r = 0; r < R; ++r)
          for (int64_t m = r * H + g * G; m < r * H + (g + 1) * G; ++m)
            add_scaled<kD>(acc + m * D, scores[m * ns + i], v, D);
      }
    });
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < H; ++h) {
      scalar_t* oh = out + r * out_row_stride + h * D;
      const float* am = s.acc.data() + (r * H + h) * D;
      for (int64_t d = 0; d < D; ++d) oh[d] = static_cast<scalar_t>(am[d]);
    }
}

// One query row of each of the `count` decode sequences first, first + 1, ... (sequence b's query at row b, its keys
// 0..lens[b] - 1, no window) whose block tables begin with the same blocks for their first `shared` keys: prompt
// forks, the G samples of one prompt, share the prompt's blocks. Each shared key and value row is read once for every member's queries
// (a decode step reads the cache from memory: the G forks of a prompt read its keys once instead of G times). Every
// member's scores, softmax and weighted sum are attend_tile's for one row: the same dot products, softmax_row over
// the same keys and the values added in key order, so its output is attend_tile's bit for bit: grouping changes what
// is read, not what is computed. Only for tiles that take attend_tile's dot-product path (G < kGemmQueries).
template <typename scalar_t, int kD>
void attend_decode_group(const scalar_t* q, int64_t q_row_stride, int64_t q_head_stride, int64_t first,
                         int64_t count, const int64_t* lens, int64_t shared, const scalar_t* k_cache,
                         const scalar_t* v_cache, const int32_t* tables, int64_t W, int64_t block_size,
                         int64_t block_stride, int64_t token_stride, int64_t head_stride, int64_t H, int64_t G,
                         int64_t D_runtime, float scale, float softcap, scalar_t* out, int64_t out_row_stride,
                         Scratch& s) {
  const int64_t D = kD > 0 ? kD : D_runtime;
  const int64_t Hkv = H / G;
  // Member u's scores: H rows of ns(u) floats (its keys padded to whole chunks, as attend_tile pads) from offset[u].
  std::vector<int64_t>& offset = s.queries;
  offset.assign(count + 1, 0);
  auto ns_of = [&](int64_t u) { return (offset[u + 1] - offset[u]) / H; };
  for (int64_t u = 0; u < count; ++u)
    offset[u + 1] = offset[u] + H * ((lens[first + u] + kChunk - 1) / kChunk * kChunk);
  s.scores.resize(offset[count]);
  s.q.resize(count * H * D);
  s.row.resize(D);
  float* scores = s.scores.data();
  float* qs = s.q.data();
  float* buf = s.row.data();
  for (int64_t u = 0; u < count; ++u)
    for (int64_t h = 0; h < H; ++h) {
      const scalar_t* qh = q + (first + u) * q_row_stride + h * q_head_stride;
      for (int64_t d = 0; d < D; ++d) qs[(u * H + h) * D + d] = static_cast<float>(qh[d]);
    }
  auto row_of = [&](const scalar_t* cache, int64_t seq, int64_t j) {
    return cache + static_cast<int64_t>(tables[seq * W + j / block_size]) * block_stride + (j % block_size) * token_stride;
  };
  // fn(j, row) for the keys j of member u (-1: the shared keys, read through the first member's table).
  auto for_keys = [&](const scalar_t* cache, int64_t u, auto&& fn) {
    const int64_t seq = first + (u < 0 ? 0 : u);
    for (int64_t j = u < 0 ? 0 : shared, end = u < 0 ? shared : lens[seq]; j < end; ++j) fn(j, row_of(cache, seq, j));
  };
  auto score = [&](int64_t u, int64_t j, int64_t g, const float* k) {
    float* su = scores + offset[u];
    const int64_t ns = ns_of(u);
    for (int64_t m = g * G; m < (g + 1) * G; ++m) su[m * ns + j] = dot<kD>(qs + (u * H + m) * D, k, D);
  };
  // fn(u, j, g, row j of KV head g as float32) for every member u and key j: the shared rows read once for all.
  auto for_member_keys = [&](const scalar_t* cache, auto&& fn) {
    for_keys(cache, -1, [&](int64_t j, const scalar_t* row) {
      for (int64_t g = 0; g < Hkv; ++g) {
        const float* x = as_float(row + g * head_stride, buf, D);
        for (int64_t u = 0; u < count; ++u) fn(u, j, g, x);
      }
    });
    for (int64_t u = 0; u < count; ++u)
      for_keys(cache, u, [&](int64_t j, const scalar_t* row) {
        for (int64_t g = 0; g < Hkv; ++g) fn(u, j, g, as_float(row + g * head_stride, buf, D));
      });
  };
  for_member_keys(k_cache, score);
  for (int64_t u = 0; u < count; ++u)
    for (int64_t m = 0; m < H; ++m)
      softmax_row(scores + offset[u] + m * ns_of(u), 0, lens[first + u] - 1, ns_of(u), scale, softcap);
  s.acc.assign(count * H * D, 0.f);
  float* acc = s.acc.data();
  auto weigh = [&](int64_t u, int64_t j, int64_t g, const float* v) {
    const float* su = scores + offset[u];
    const int64_t ns = ns_of(u);
    for (int64_t m = g * G; m < (g + 1) * G; ++m) add_scaled<kD>(acc + (u * H + m) * D, su[m * ns + j], v, D);
  };
  for_member_keys(v_cache, weigh);
  for (int64_t u = 0; u < count; ++u)
    for (int64_t h = 0; h < H; ++h) {
      scalar_t* oh = out + (first + u) * out_row_stride + h * D;
      const float* am = acc + (u * H + h) * D;
      for (int64_t d = 0; d < D; ++d) oh[d] = static_cast<scalar_t>(am[d]);
    }
}

// q [T, H, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_table int32 [B, W]. Sequence b's queries
// are rows cu_seqlens_q[b]..cu_seqlens_q[b + 1] (no cu_seqlens_q: row b alone, T = B), its keys number
// cu_seqlens_k[b + 1] - cu_seqlens_k[b] or seqused_k[b] (one of the two given).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& cu_seqlens_k,
                           const std::optional<at::Tensor>& seqused_k, const at::Tensor& block_table, double scale,
                           int64_t window_left, double softcap) {
  TORCH_CHECK(q.device().is_cpu(), "rollout::paged_attention_cpu: q must be on the CPU");
  TORCH_CHECK(q.dim() == 3, "q must be [T, H, D], got ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "k_cache and v_cache must be [num_blocks, block_size, Hkv, D] of one shape");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q, k_cache and v_cache must share a dtype");
  // Strided caches are read as they are (a layer narrower than its cache slot is a view with wider rows).
  TORCH_CHECK(k_cache.strides() == v_cache.strides() && k_cache.stride(3) == 1,
              "k_cache and v_cache must share strides, with a contiguous last dimension");
  TORCH_CHECK(q.stride(2) == 1, "q must have a contiguous last dimension");
  TORCH_CHECK(cu_seqlens_k.has_value() != seqused_k.has_value(), "give one of cu_seqlens_k and seqused_k");
  TORCH_CHECK(block_table.dim() == 2 && block_table.scalar_type() == at::kInt, "block_table must be int32 [B, W]");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D, "the cache's head dim must be q's");
  TORCH_CHECK(H % Hkv == 0, "KV heads (", Hkv, ") must divide query heads (", H, ")");
  const int64_t B = block_table.size(0), W = block_table.size(1);
  auto int32_host = [](const at::Tensor& t, int64_t n, const char* name) {
    TORCH_CHECK(t.scalar_type() == at::kInt && t.dim() == 1 && t.size(0) == n, name, " must be int32 [", n, "]");
    return t.contiguous();
  };
  // Each sequence's first query row, query count and key count.
  std::vector<int64_t> q_start(B), q_len(B), k_len(B);
  if (cu_seqlens_q.has_value()) {
    const auto cu = int32_host(*cu_seqlens_q, B + 1, "cu_seqlens_q");
    const int32_t* c = cu.data_ptr<int32_t>();
    TORCH_CHECK(c[0] == 0 && c[B] <= T, "cu_seqlens_q must start at 0 and end at most at T");
    for (int64_t b = 0; b < B; ++b) q_start[b] = c[b], q_len[b] = c[b + 1] - c[b];
  } else {
    TORCH_CHECK(T == B, "without cu_seqlens_q, q must have one row per sequence");
    for (int64_t b = 0; b < B; ++b) q_start[b] = b, q_len[b] = 1;
  }
  if (cu_seqlens_k.has_value()) {
    const auto cu = int32_host(*cu_seqlens_k, B + 1, "cu_seqlens_k");
    const int32_t* c = cu.data_ptr<int32_t>();
    for (int64_t b = 0; b < B; ++b) k_len[b] = c[b + 1] - c[b];
  } else {
    const auto used = int32_host(*seqused_k, B, "seqused_k");
    const int32_t* u = used.data_ptr<int32_t>();
    for (int64_t b = 0; b < B; ++b) k_len[b] = u[b];
  }
  const auto tables = block_table.contiguous();

  // The work: tiles of at most kRowTile consecutive rows of one sequence, checked before any work, and on a decode
  // step groups of consecutive sequences whose tables begin with the same blocks (attend_decode_group).
  constexpr int64_t kRowTile = 16;
  struct Tile {
    int64_t row, count, pos;  // first row, rows, position of the first row among its sequence's keys
    int32_t seq;
    int32_t group = -1;  // a decode group (then seq is its first member)
  };
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = q_len[b], m = k_len[b];
    TORCH_CHECK(n >= 0 && n <= m, "sequence ", b, " has ", n, " queries but ", m, " keys");
    TORCH_CHECK(m <= W * block_size, "sequence ", b, " has ", m, " keys, more than its table of ", W, " blocks holds");
  }
  const int64_t G = H / Hkv;
  struct Group {
    // Sequences first..first + count - 1, their first `shared` keys read through first's table; keys: all of the
    // members' keys (the group's work).
    int64_t first, count, shared, keys;
  };
  std::vector<Group> groups;
  std::vector<char> grouped(B, 0);
  const int32_t* table_rows = tables.data_ptr<int32_t>();
  if (!cu_seqlens_q.has_value() && window_left < 0 && G < kGemmQueries) {
    for (int64_t b = 0; b < B;) {
      // The run b..e - 1 of sequences whose tables begin with b's blocks, sharing at least one block's keys.
      int64_t shared = k_len[b], e = b + 1;
      for (; e < B; ++e) {
        const int64_t limit = std::min(shared, k_len[e]);
        int64_t blocks = 0;
        while (blocks * block_size < limit && table_rows[b * W + blocks] == table_rows[e * W + blocks]) ++blocks;
        const int64_t keys = std::min(blocks * block_size, limit);
        if (keys < block_size) break;
        shared = keys;
      }
      if (e - b >= 2) {
        int64_t keys = 0;
        for (int64_t i = b; i < e; ++i) keys += k_len[i], grouped[i] = 1;
        groups.push_back({b, e - b, shared, keys});
      }
      b = e;
    }
  }
  std::vector<Tile> tiles;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = q_len[b], m = k_len[b];
    if (grouped[b]) continue;
    for (int64_t i = 0; i < n; i += kRowTile)
      tiles.push_back({q_start[b] + i, std::min(kRowTile, n - i), m - n + i, static_cast<int32_t>(b)});
  }
  for (int64_t g = 0; g < static_cast<int64_t>(groups.size()); ++g) {
    const int64_t first = groups[g].first;
    tiles.push_back({first, groups[g].count, 0, static_cast<int32_t>(first), static_cast<int32_t>(g)});
  }
  // Largest first (rows x keys read): the tiles of a causal prefill grow with their position, and ATen's split of
  // the items into one contiguous range per thread gave one of two threads three quarters of a long prefill's work.
  // Taken largest first, one at a time, the threads finish together (longest-processing-time-first scheduling).
  // A tile's first visible key: its first row's, the lowest of its rows.
  auto first_key = [&](const Tile& t) {
    return window_left >= 0 ? std::max<int64_t>(0, t.pos - window_left) : int64_t{0};
  };
  auto work = [&](const Tile& t) {
    // A group's: every member's keys (its shared ones are read once, but scored for each).
    return t.group < 0 ? t.count * (t.pos + t.count - first_key(t)) : groups[t.group].keys;
  };
  std::stable_sort(tiles.begin(), tiles.end(), [&](const Tile& a, const Tile& b) { return work(a) > work(b); });
  auto out = at::zeros({T, H, D}, q.options());
  const int64_t items = static_cast<int64_t>(tiles.size());
  const float fscale = static_cast<float>(scale), fcap = static_cast<float>(softcap);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention_cpu", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k_cache.data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.data_ptr<scalar_t>();
    const int32_t* tp = table_rows;
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t q_row = q.stride(0), q_head = q.stride(1);
    // The threads take the tiles one at a time from a shared counter, largest first (the order of `tiles`), each
    // claiming its next tile before it computes the one it holds, whose first key block it then prefetches.
    std::atomic<int64_t> next{0};
    const int64_t workers = std::min<int64_t>(at::get_num_threads(), items);
    at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
      Scratch scratch;
      for (int64_t item = next.fetch_add(1); item < items;) {
        const int64_t upcoming = next.fetch_add(1);
        const Tile& tile = tiles[item];
        // The next tile's first key block, fetched ahead while this tile's values are read.
        const scalar_t* after = nullptr;
        if (upcoming < items) {
          const Tile& coming = tiles[upcoming];
          const int64_t lo = first_key(coming);
          after = kp + static_cast<int64_t>(tp[coming.seq * W + lo / block_size]) * k_cache.stride(0) +
                  (lo % block_size) * k_cache.stride(1);
        }
        auto run = [&](auto head_dim) {
          if (tile.group >= 0) {
            const Group& group = groups[tile.group];
            attend_decode_group<scalar_t, decltype(head_dim)::value>(
                qp, q_row, q_head, group.first, group.count, k_len.data(), group.shared, kp, vp, tp,
                W, block_size, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), H, G, D, fscale, fcap, op,
                H * D, scratch);
            return;
          }
          attend_tile<scalar_t, decltype(head_dim)::value>(
              qp + tile.row * q_row, q_row, q_head, tile.count, tile.pos, window_left, kp, vp, tp + tile.seq * W,
              block_size, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), H, G, D, fscale, fcap,
              op + tile.row * H * D, H * D, after, scratch);
        };
        // The usual head dims get unrolled loops; any other runs the same code with D read at run time.
        if (D == 64) {
          run(std::integral_constant<int, 64>{});
        } else if (D == 128) {
          run(std::integral_constant<int, 128>{});
        } else {
          run(std::integral_constant<int, 0>{});
        }
        item = upcoming;
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(rollout_cpu, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
      "Tensor? seqused_k, Tensor block_table, float scale, int window_left, float softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(rollout_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
