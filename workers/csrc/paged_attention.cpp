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
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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
#endif
  for (int64_t t = 0; t < n; ++t) {
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < D; ++d) dot += q[d] * k[t * stride + d];
    out[t] = dot;
  }
}

#if defined(__AVX512F__)
template <int C>  // D = 16 * C: the accumulator stays in C registers
inline void weighted_values_c(const float* w, const float* v0, const int64_t* tab, int64_t first, int64_t L,
                              int64_t B, int64_t slot, int64_t tok, float* acc) {
  __m512 a[C];
  for (int c = 0; c < C; ++c) a[c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < L; ++p) {
    const int64_t at = first + p;
    const float* v = v0 + tab[at / B] * slot + (at % B) * tok;
    const __m512 wp = _mm512_set1_ps(w[p]);
    for (int c = 0; c < C; ++c) a[c] = _mm512_fmadd_ps(wp, _mm512_loadu_ps(v + 16 * c), a[c]);
  }
  for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + 16 * c, a[c]);
}
#endif

// acc[0:D] = sum over p < L of w[p] * the value row of key first + p (v0: head's offset in slot 0)
inline void weighted_values(const float* w, const float* v0, const int64_t* tab, int64_t first, int64_t L,
                            int64_t B, int64_t slot, int64_t tok, int64_t D, float* acc) {
#if defined(__AVX512F__)
  if (D == 64) return weighted_values_c<4>(w, v0, tab, first, L, B, slot, tok, acc);
  if (D == 128) return weighted_values_c<8>(w, v0, tab, first, L, B, slot, tok, acc);
#endif
  std::fill(acc, acc + D, 0.f);
  for (int64_t p = 0; p < L; ++p) {
    const int64_t at = first + p;
    const float* v = v0 + tab[at / B] * slot + (at % B) * tok;
    const float wp = w[p];
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[d] += wp * v[d];
  }
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
        float* sj = scores.data() + j * L;  // softmax numerators, exp vectorized (libmvec: -fno-math-errno)
        float mx = -INFINITY;
        for (int64_t p = 0; p < L; ++p) mx = sj[p] > mx ? sj[p] : mx;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t p = 0; p < L; ++p) {
          sj[p] = std::exp(sj[p] - mx);
          sum += sj[p];
        }
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
