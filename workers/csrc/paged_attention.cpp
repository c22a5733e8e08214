// Paged decode attention on CPU: one query token per sequence, reading K and V where they lie in the paged
// cache (no gather of every sequence's blocks into a padded copy, which was a third of a decode step).
//
// q: [S, Hq, D] float32, contiguous. k_cache, v_cache: [slots, B, Hkv, D] float32 views whose last three dims
// are contiguous (a slot's stride may be larger: every layer of a block shares one slot). table: [S, W] int64,
// the slots of each sequence's blocks from its first read block on; key position p (relative to that block's
// start) is at slot table[s][p / B], offset p % B. Sequence s attends to positions [lo[s], lo[s] + len[s]).
//
// Work unit: a whole sequence (every kv head) when there are at least as many sequences as threads, else one
// (sequence, kv head). Scores go 16 keys at a time, every query head of the unit on a tile while its key rows
// are in cache; then the softmax with vectorized exp; then each query head's weighted sum of its value rows with
// the accumulator in registers. The step is memory-bound at decode batch sizes: what the layout buys is reading
// each byte of K and V once, in order within a block (bench/README.md, decode_bench.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define KV_AVX2 1  // the 8-wide paths below, where AVX-512 is not there (this project's CI machine: AVX2 only)
#endif
#include "vec_exp.h"

namespace {

#if defined(__AVX512F__)
// The 16 horizontal sums of a[0..15], in order, as one vector: a transposing add tree (45 shuffles and adds,
// where reducing each vector alone takes 128).
inline __m512 sum16(const __m512* a) {
  __m512 v[8], w[4];
  for (int i = 0; i < 8; ++i)
    v[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

#if defined(KV_AVX2)
// The 8 horizontal sums of a[0..7], in order, as one vector (AVX2's transposing add tree).
inline __m256 sum8(const __m256* a) {
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  // h0: a0..a3's sums of their lower halves, then of their upper halves; h1 the same of a4..a7
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}

// out[0..7] = q . k_t for the 8 keys k_t = k + t * stride (D a multiple of 8)
inline void dot8(const float* q, const float* k, int64_t stride, int64_t D, float* out) {
  __m256 acc[8];
  for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t c = 0; c < D; c += 8) {
    const __m256 qc = _mm256_loadu_ps(q + c);
    for (int t = 0; t < 8; ++t) acc[t] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + t * stride + c), acc[t]);
  }
  _mm256_storeu_ps(out, sum8(acc));
}
#endif

// out[t] = q . k_t for the n keys k_t = k + t * stride (n <= 16, D floats each)
inline void dot_tile(const float* q, const float* k, int64_t stride, int64_t D, int64_t n, float* out) {
#if defined(__AVX512F__)
  if (n == 16 && D % 16 == 0) {
    __m512 acc[16];
    for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t c = 0; c < D; c += 16) {
      const __m512 qc = _mm512_loadu_ps(q + c);
      for (int t = 0; t < 16; ++t) acc[t] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(k + t * stride + c), acc[t]);
    }
    _mm512_storeu_ps(out, sum16(acc));
    return;
  }
#elif defined(KV_AVX2)
  if (n % 8 == 0 && D % 8 == 0) {  // without it, 4x the decode attention's time (decode_bench.py)
    for (int64_t t = 0; t < n; t += 8) dot8(q, k + t * stride, stride, D, out + t);
    return;
  }
#endif
  for (int64_t t = 0; t < n; ++t) {
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < D; ++d) dot += q[d] * k[t * stride + d];
    out[t] = dot;
  }
}

// f(v, p) for the value row v of each key first + p, p < L in order, block by block: one division a block (a
// division a key was ~a quarter of the value pass's time)
template <class F>
inline void each_row(const float* v0, const int64_t* tab, int64_t first, int64_t L, int64_t B, int64_t slot,
                     int64_t tok, F f) {
  for (int64_t p = 0; p < L;) {
    const int64_t at = first + p, off = at % B, n = std::min(B - off, L - p);
    const float* v = v0 + tab[at / B] * slot + off * tok;
    for (int64_t i = 0; i < n; ++i) f(v + i * tok, p + i);
    p += n;
  }
}

#if defined(__AVX512F__)
template <int C>  // D = 16 * C: the accumulator stays in C registers
inline void weighted_values_c(const float* w, const float* v0, const int64_t* tab, int64_t first, int64_t L,
                              int64_t B, int64_t slot, int64_t tok, float* acc) {
  __m512 a[C];
  for (int c = 0; c < C; ++c) a[c] = _mm512_setzero_ps();
  each_row(v0, tab, first, L, B, slot, tok, [&](const float* v, int64_t p) {
    const __m512 wp = _mm512_set1_ps(w[p]);
    for (int c = 0; c < C; ++c) a[c] = _mm512_fmadd_ps(wp, _mm512_loadu_ps(v + 16 * c), a[c]);
  });
  for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + 16 * c, a[c]);
}
#elif defined(KV_AVX2)
// acc[0:64] = sum over p < L of w[p] * the 64 floats at v0 of the value row of key first + p, in 8 registers
inline void weighted_values_64(const float* w, const float* v0, const int64_t* tab, int64_t first, int64_t L,
                               int64_t B, int64_t slot, int64_t tok, float* acc) {
  __m256 a[8];
  for (int c = 0; c < 8; ++c) a[c] = _mm256_setzero_ps();
  each_row(v0, tab, first, L, B, slot, tok, [&](const float* v, int64_t p) {
    const __m256 wp = _mm256_set1_ps(w[p]);
    for (int c = 0; c < 8; ++c) a[c] = _mm256_fmadd_ps(wp, _mm256_loadu_ps(v + 8 * c), a[c]);
  });
  for (int c = 0; c < 8; ++c) _mm256_storeu_ps(acc + 8 * c, a[c]);
}

#endif

// acc[0:D] = sum over p < L of w[p] * the value row of key first + p (v0: head's offset in slot 0)
inline void weighted_values(const float* w, const float* v0, const int64_t* tab, int64_t first, int64_t L,
                            int64_t B, int64_t slot, int64_t tok, int64_t D, float* acc) {
#if defined(__AVX512F__)
  if (D == 64) return weighted_values_c<4>(w, v0, tab, first, L, B, slot, tok, acc);
  if (D == 128) return weighted_values_c<8>(w, v0, tab, first, L, B, slot, tok, acc);
#elif defined(KV_AVX2)
  if (D % 64 == 0) {  // 64 columns at a time: the 8 accumulators of 8 floats stay in registers
    for (int64_t c = 0; c < D; c += 64) weighted_values_64(w, v0 + c, tab, first, L, B, slot, tok, acc + c);
    return;
  }
#endif
  std::fill(acc, acc + D, 0.f);
  each_row(v0, tab, first, L, B, slot, tok, [&](const float* v, int64_t p) {
    const float wp = w[p];
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[d] += wp * v[d];
  });
}

// s[0:L] = e^(s[p] - max); returns the sum, and the max in *mx
inline float softmax_numerators(float* s, int64_t L, float* mx_out) {
  float mx = -INFINITY, sum = 0.f;
  int64_t p = 0;
#if defined(KV_AVX2) && !defined(__AVX512F__)
  if (L >= 8) {
    __m256 m = _mm256_loadu_ps(s);
    for (p = 8; p + 8 <= L; p += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + p));
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    for (float x : lanes) mx = x > mx ? x : mx;
    for (; p < L; ++p) mx = s[p] > mx ? s[p] : mx;
    const __m256 vm = _mm256_set1_ps(mx);
    __m256 acc = _mm256_setzero_ps();
    for (p = 0; p + 8 <= L; p += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + p), vm));
      _mm256_storeu_ps(s + p, e);
      acc = _mm256_add_ps(acc, e);
    }
    _mm256_storeu_ps(lanes, acc);
    for (float x : lanes) sum += x;
    for (; p < L; ++p) {
      s[p] = std::exp(s[p] - mx);
      sum += s[p];
    }
    *mx_out = mx;
    return sum;
  }
#endif
  for (p = 0; p < L; ++p) mx = s[p] > mx ? s[p] : mx;
#pragma omp simd reduction(+ : sum)
  for (p = 0; p < L; ++p) {
    s[p] = std::exp(s[p] - mx);
    sum += s[p];
  }
  *mx_out = mx;
  return sum;
}

}  // namespace

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor table,
                           torch::Tensor lo, torch::Tensor len, double scale, torch::Tensor lse) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32 &&
              v_cache.scalar_type() == torch::kFloat32, "paged_decode: float32 only");
  TORCH_CHECK(q.is_contiguous() && table.is_contiguous() && lo.is_contiguous() && len.is_contiguous(),
              "paged_decode: q, table, lo and len must be contiguous");
  const int64_t S = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t B = k_cache.size(1), Hkv = k_cache.size(2), W = table.size(1);
  TORCH_CHECK(k_cache.size(3) == D && Hq % Hkv == 0, "paged_decode: head shapes do not match");
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == D && k_cache.stride(1) == Hkv * D &&
              v_cache.stride(3) == 1 && v_cache.stride(2) == D && v_cache.stride(1) == Hkv * D,
              "paged_decode: a block's tokens must be contiguous");
  const int64_t G = Hq / Hkv, k_slot = k_cache.stride(0), v_slot = v_cache.stride(0), tok = Hkv * D;
  // lse: [S, Hq] float32 to receive each head's log-sum-exp of its scaled scores (to merge this part of the keys
  // with another: a shared prefix attended once for its sequences, workers/model.py), or empty for none
  TORCH_CHECK(lse.numel() == 0 || (lse.scalar_type() == torch::kFloat32 && lse.is_contiguous() &&
              lse.numel() == S * Hq), "paged_decode: lse must be empty or a contiguous float32 [S, Hq]");
  float* lsep = lse.numel() ? lse.data_ptr<float>() : nullptr;
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lop = lo.data_ptr<int64_t>();
  const int64_t* lenp = len.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t heads = S >= at::get_num_threads() ? Hkv : 1;  // kv heads a unit of work takes
  const int64_t split = Hkv / heads;
  // keys a score tile takes: 16 where every tile lies inside one block
  const int64_t tile_n = B % 16 == 0 ? 16 : 1;
  at::parallel_for(0, S * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(D);
    float tile[16];
    for (int64_t u = begin; u < end; ++u) {
      const int64_t s = u / split, h0 = (u % split) * heads, nq = heads * G;
      const int64_t first = lop[s], L = lenp[s];
      const int64_t* tab = tp + s * W;
      scores.resize(nq * L);
      const float* qs = qp + (s * Hq + h0 * G) * D;
      for (int64_t at = first - first % tile_n; at < first + L; at += tile_n) {
        const float* krow = kp + tab[at / B] * k_slot + (at % B) * tok + h0 * D;
        const int64_t a = std::max(at, first), b = std::min(at + tile_n, first + L);
        for (int64_t j = 0; j < nq; ++j) {
          // a whole tile even where it reaches past [a, b): its slots are the block's, and a key's garbage
          // stays in that key's score, which is not kept
          dot_tile(qs + j * D, krow + (j / G) * D, tok, D, tile_n, tile);
          float* sj = scores.data() + j * L - first;
          for (int64_t p = a; p < b; ++p) sj[p] = tile[p - at] * sc;
        }
      }
      for (int64_t j = 0; j < nq; ++j) {
        float* sj = scores.data() + j * L;
        float mx;
        const float sum = softmax_numerators(sj, L, &mx);
        weighted_values(sj, vp + (h0 + j / G) * D, tab, first, L, B, v_slot, tok, D, acc.data());
        float* o = op + (s * Hq + h0 * G + j) * D;
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        for (int64_t d = 0; d < D; ++d) o[d] = acc[d] * inv;
        if (lsep) lsep[s * Hq + h0 * G + j] = mx + std::log(sum);
      }
    }
  });
  return out;
}

// k_cache[slots[i], offsets[i]] = k[i] and the same of v, for i < n: the K and V of a step's new tokens written
// into their blocks (torch's index_put with two index tensors took ~3% of a 64-sequence decode step). k, v:
// [n, Hkv, D] float32 with each row's heads contiguous (views of the qkv projection's output); caches as above.
void paged_write(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                 torch::Tensor offsets) {
  TORCH_CHECK(k.scalar_type() == torch::kFloat32 && v.scalar_type() == torch::kFloat32 &&
              k_cache.scalar_type() == torch::kFloat32 && v_cache.scalar_type() == torch::kFloat32,
              "paged_write: float32 only");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && offsets.scalar_type() == torch::kInt64 &&
              slots.is_contiguous() && offsets.is_contiguous() && slots.numel() == k.size(0) &&
              offsets.numel() == k.size(0), "paged_write: slots and offsets must be contiguous int64 [n]");
  const int64_t n = k.size(0), Hkv = k_cache.size(2), D = k_cache.size(3), B = k_cache.size(1);
  const int64_t tok = Hkv * D;
  for (const auto* t : {&k, &v})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == n && t->size(1) == Hkv && t->size(2) == D && t->stride(2) == 1 &&
                t->stride(1) == D, "paged_write: k and v must be [n, kv heads, head_dim] with contiguous rows");
  for (const auto* c : {&k_cache, &v_cache})
    TORCH_CHECK(c->stride(3) == 1 && c->stride(2) == D && c->stride(1) == tok,
                "paged_write: a block's tokens must be contiguous");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* op = offsets.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < k_cache.size(0) && op[i] >= 0 && op[i] < B, "paged_write: row ", i,
                " goes to slot ", sp[i], " offset ", op[i], ", outside the cache's ", k_cache.size(0), " slots of ",
                B, " tokens");
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    std::copy(kp + i * k.stride(0), kp + i * k.stride(0) + tok, kc + sp[i] * k_cache.stride(0) + op[i] * tok);
    std::copy(vp + i * v.stride(0), vp + i * v.stride(0) + tok, vc + sp[i] * v_cache.stride(0) + op[i] * tok);
  }
}
