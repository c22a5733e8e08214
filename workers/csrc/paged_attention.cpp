// Paged decode attention on CPU: one query token per sequence, reading K and V where they lie in the paged
// cache (no gather of every sequence's blocks into a padded copy, which was a third of a decode step).
//
// q: [S, Hq, D] float32, contiguous. k_cache, v_cache: [slots, B, Hkv, D] float32 views whose last three dims
// are contiguous (a slot's stride may be larger: every layer of a block shares one slot). table: [S, W] int64,
// the slots of each sequence's blocks from its first read block on; key position p (relative to that block's
// start) is at slot table[s][p / B], offset p % B. Sequence s attends to positions [lo[s], lo[s] + len[s]).
// Per (sequence, kv head): every score first (a key row read once for the kv head's G query heads), then the
// softmax with vectorized exp, then the weighted sum of the value rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor table,
                           torch::Tensor lo, torch::Tensor len, double scale) {
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
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lop = lo.data_ptr<int64_t>();
  const int64_t* lenp = len.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, S * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = i / Hkv, h = i % Hkv, first = lop[s], L = lenp[s];
      scores.resize(G * L);
      const float* qs = qp + (s * Hq + h * G) * D;
      for (int64_t p = 0; p < L; ++p) {  // the scores: each key row read once for the G query heads
        const int64_t at = first + p;
        const float* k = kp + tp[s * W + at / B] * k_slot + (at % B) * tok + h * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qs + g * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * k[d];
          scores[g * L + p] = dot * sc;
        }
      }
      std::vector<float> total(G);
      for (int64_t g = 0; g < G; ++g) {  // softmax numerators, exp vectorized (libmvec: -fno-math-errno)
        float* sg = scores.data() + g * L;
        float mx = -INFINITY;
        for (int64_t p = 0; p < L; ++p) mx = sg[p] > mx ? sg[p] : mx;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t p = 0; p < L; ++p) {
          sg[p] = std::exp(sg[p] - mx);
          sum += sg[p];
        }
        total[g] = sum;
      }
      for (int64_t g = 0; g < G; ++g) {  // the weighted values
        const float* sg = scores.data() + g * L;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t p = 0; p < L; ++p) {
          const int64_t at = first + p;
          const float* v = vp + tp[s * W + at / B] * v_slot + (at % B) * tok + h * D;
          const float w = sg[p];
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) acc[d] += w * v[d];
        }
        float* o = op + (s * Hq + h * G + g) * D;
        const float inv = total[g] > 0.f ? 1.f / total[g] : 0.f;
        for (int64_t d = 0; d < D; ++d) o[d] = acc[d] * inv;
      }
    }
  });
  return out;
}
