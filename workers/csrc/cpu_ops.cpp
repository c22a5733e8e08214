// The small operators of a CPU fp32 forward pass, fused: each replaces several torch operators, whose
// dispatch and per-operator overhead was most of a lone sequence's decode step outside its matmuls
// (bench/README.md, decode_bench.py), and a matmul of one row that reads the weight at the memory's speed.
//
// Built with -ffp-contract=off: the elementwise operators (the residual add, rope, silu * up) then round
// as torch's eager ones do (a product, then a sum); only the reductions (rms_norm's mean of squares, a row's
// dot products) sum in another order than torch's.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#include "vec_exp.h"

namespace {

// rows per task: a decode step's few rows run inline on the calling thread (no parallel region to open)
int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elems)); }

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1,
              name, ": a CPU float32 [rows, n] tensor with contiguous rows is needed");
}

void norm_row(const float* in, const float* w, float eps, int64_t n, float* out) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) ss += double(in[i]) * double(in[i]);
  const float r = 1.0f / std::sqrt(float(ss / double(n)) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (in[i] * r);
}

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// y[i][k] = w0[k, :] . x[i] for NW weight rows and NX input rows (x[i] at x + i * ldx): NW * NX accumulators in
// registers, each weight chunk loaded once for the NX rows. Every output sums its products in the same order
// whatever the tile (eight lanes along the row, their sum, then the row's tail), so a row's result is the same
// whatever batch it is in and whatever tile takes it.
template <int NW, int NX>
inline void dot_tile(const float* x, int64_t ldx, const float* w0, int64_t n, float* y, int64_t ldy,
                     const float* next) {
  const int64_t n8 = n - n % 8;
  __m256 a[NX][NW];
  for (int i = 0; i < NX; ++i)
    for (int k = 0; k < NW; ++k) a[i][k] = _mm256_setzero_ps();
  for (int64_t c = 0; c < n8; c += 8) {
    if (next != nullptr && c % 16 == 0)  // the next weight rows on their way while these are summed
      for (int k = 0; k < NW; ++k) _mm_prefetch(reinterpret_cast<const char*>(next + k * n + c), _MM_HINT_T0);
    __m256 xc[NX];
    for (int i = 0; i < NX; ++i) xc[i] = _mm256_loadu_ps(x + i * ldx + c);
    for (int k = 0; k < NW; ++k) {
      const __m256 wk = _mm256_loadu_ps(w0 + k * n + c);
      for (int i = 0; i < NX; ++i) a[i][k] = _mm256_fmadd_ps(wk, xc[i], a[i][k]);
    }
  }
  for (int i = 0; i < NX; ++i)
    for (int k = 0; k < NW; ++k) {
      float s = hsum(a[i][k]);
      for (int64_t c = n8; c < n; ++c) s += w0[k * n + c] * x[i * ldx + c];
      y[i * ldy + k] = s;
    }
}

// the last `left` (< NX) input rows: one tile of exactly that many
template <int NW, int NX>
inline void dot_rest(const float* x, int64_t ldx, int64_t left, const float* w0, int64_t n, float* y, int64_t ldy,
                     const float* next) {
  if (left == NX)
    dot_tile<NW, NX>(x, ldx, w0, n, y, ldy, next);
  else if constexpr (NX > 1)
    dot_rest<NW, NX - 1>(x, ldx, left, w0, n, y, ldy, next);
}

// NW weight rows at w0 against all R input rows, NX at a time: the weight rows come from memory on the first pass
// and from cache on the others
template <int NW, int NX>
inline void dot_all_rows(const float* x, int64_t ldx, int64_t R, const float* w0, int64_t n, float* y, int64_t ldy,
                         const float* next) {
  int64_t i = 0;
  for (; i + NX <= R; i += NX, next = nullptr) dot_tile<NW, NX>(x + i * ldx, ldx, w0, n, y + i * ldy, ldy, next);
  if constexpr (NX > 1)
    if (i < R) dot_rest<NW, NX - 1>(x + i * ldx, ldx, R - i, w0, n, y + i * ldy, ldy, next);
}

// y[i][r] = w[r, :] . x[i] for weight rows [r0, r1): NW at a time, the rest one at a time
template <int NW, int NX>
void dot_rows_tiled(const float* x, int64_t ldx, int64_t R, const float* w, int64_t n, int64_t r0, int64_t r1,
                    float* y, int64_t ldy) {
  int64_t r = r0;
  for (; r + NW <= r1; r += NW) {
    const float* w0 = w + r * n;
    dot_all_rows<NW, NX>(x, ldx, R, w0, n, y + r, ldy, r + 2 * NW <= r1 ? w0 + NW * n : nullptr);
  }
  for (; r < r1; ++r) dot_all_rows<1, NX>(x, ldx, R, w + r * n, n, y + r, ldy, nullptr);
}
#endif

// y[i][r] = w[r, :] . x[i] for weight rows [r0, r1) and the R input rows. Up to three rows: four weight rows at
// a time; more: two weight rows against six input rows (12 accumulators either way; at 6-16 rows 0.80-0.87x the
// time of four against three, which reads each weight chunk from cache once per three rows: linear_bench.py)
void dot_rows(const float* x, int64_t ldx, int64_t R, const float* w, int64_t n, int64_t r0, int64_t r1, float* y,
              int64_t ldy) {
#if defined(__AVX2__) && defined(__FMA__)
  if (R <= 3)
    dot_rows_tiled<4, 3>(x, ldx, R, w, n, r0, r1, y, ldy);
  else
    dot_rows_tiled<2, 6>(x, ldx, R, w, n, r0, r1, y, ldy);
#else
  for (int64_t r = r0; r < r1; ++r) {
    const float* wr = w + r * n;
    for (int64_t i = 0; i < R; ++i) {
      const float* xi = x + i * ldx;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t c = 0; c < n; ++c) s += wr[c] * xi[c];
      y[i * ldy + r] = s;
    }
  }
#endif
}

}  // namespace

// x [R, in] @ w[out, in]^T (+ bias) for a few rows (a small decode batch), split by output rows over the threads:
// the weight read from memory once, where oneDNN's matmul at 2-16 rows ran at ~half the memory's speed
// (linear_bench.py)
torch::Tensor linear_rows(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  check_rows(x, "linear_rows");
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.dim() == 2 && w.size(1) == x.size(1),
              "linear_rows: x [rows, in] and a contiguous float32 w [out, in] are needed");
  const int64_t R = x.size(0), out_f = w.size(0), in_f = w.size(1);
  auto y = torch::empty({R, out_f}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  at::parallel_for(0, (out_f + 3) / 4, 64, [&](int64_t b, int64_t e) {
    dot_rows(xp, ldx, R, wp, in_f, b * 4, std::min(out_f, e * 4), yp, out_f);
  });
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

// RMSNorm of each row, times the weight (transformers' Llama/Qwen RMSNorm in fp32)
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "rms_norm");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == n, "rms_norm: weight must be [", n, "]");
  auto out = torch::empty({rows, n}, x.options());
  const float* w = weight.data_ptr<float>();
  at::parallel_for(0, rows, grain(n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      norm_row(x.data_ptr<float>() + r * x.stride(0), w, float(eps), n, out.data_ptr<float>() + r * n);
  });
  return out;
}

// residual += x, then x = rms_norm(residual) * weight, both in place: a layer's residual add and the next
// norm in one pass (vLLM's fused_add_rms_norm)
void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(x, "add_rms_norm_");
  check_rows(residual, "add_rms_norm_");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(residual.size(0) == rows && residual.size(1) == n && weight.is_contiguous() && weight.numel() == n,
              "add_rms_norm_: x, residual [rows, n] and weight [n] are needed");
  const float* w = weight.data_ptr<float>();
  at::parallel_for(0, rows, grain(n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float* xr = x.data_ptr<float>() + r * x.stride(0);
      float* hr = residual.data_ptr<float>() + r * residual.stride(0);
      for (int64_t i = 0; i < n; ++i) hr[i] = xr[i] + hr[i];
      norm_row(hr, w, float(eps), n, xr);
    }
  });
}

// rotate-half rope in place on the first `heads` heads of each row of qkv [T, >= heads * D]:
// x * cos + rotate_half(x) * sin, with cos, sin [T, D]
void rope_(torch::Tensor qkv, int64_t heads, int64_t D, torch::Tensor cos, torch::Tensor sin) {
  check_rows(qkv, "rope_");
  const int64_t T = qkv.size(0), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && heads * D <= qkv.size(1), "rope_: ", heads, " heads of ", D, " do not fit a row");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == torch::kFloat32 &&
                  sin.scalar_type() == torch::kFloat32 && cos.size(0) == T && cos.size(1) == D &&
                  sin.sizes() == cos.sizes(),
              "rope_: cos and sin must be contiguous float32 [T, D]");
  at::parallel_for(0, T, grain(heads * D), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* c = cos.data_ptr<float>() + t * D;
      const float* s = sin.data_ptr<float>() + t * D;
      float* row = qkv.data_ptr<float>() + t * qkv.stride(0);
      for (int64_t h = 0; h < heads; ++h) {
        float* x = row + h * D;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = x[i], x2 = x[i + half];
          x[i] = x1 * c[i] + -x2 * s[i];
          x[i + half] = x2 * c[i + half] + x1 * s[i + half];
        }
      }
    }
  });
}

// silu(gate) * up of gate_up [T, 2I] (gate's I columns, then up's): [T, I]. e^-g eight at a time (vec_exp.h,
// ~1 ulp, as torch's vectorized silu is not glibc's expf either): with std::exp a call an element, this took
// 4x torch's time, ~8% of a 1,024-token prefill step (bench/README.md)
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "silu_mul");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * I, "silu_mul: gate_up needs an even number of columns");
  auto out = torch::empty({T, I}, gate_up.options());
  at::parallel_for(0, T, grain(I), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* g = gate_up.data_ptr<float>() + t * gate_up.stride(0);
      const float* u = g + I;
      float* o = out.data_ptr<float>() + t * I;
      int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
      const __m256 one = _mm256_set1_ps(1.0f);
      for (; i + 8 <= I; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
      }
#endif
      for (; i < I; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

// One token per row of logits x [N, V], drawn at temperature[r] by inverting the row's cumulative distribution
// at u[r] in [0, 1) (workers/sampling.py `_draw`, whose torch operators this replaces where neither top-k nor
// top-p sorts the row: softmax, cumsum and searchsorted over every row were ~8% of a 64-sequence decode step).
// The first token whose running sum of e^(x/T - max) passes u times the row's total (the same sum, in the same
// order), so a token of zero probability (a -inf logit) is never drawn.
torch::Tensor sample_rows(torch::Tensor x, torch::Tensor temperature, torch::Tensor u) {
  check_rows(x, "sample_rows");
  const int64_t N = x.size(0), V = x.size(1);
  TORCH_CHECK(V > 0, "sample_rows: an empty vocabulary");
  for (const auto* t : {&temperature, &u})
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->numel() == N,
                "sample_rows: temperature and u must be contiguous float32 [rows]");
  auto out = torch::empty({N}, x.options().dtype(torch::kInt64));
  const float* xp = x.data_ptr<float>();
  const float* tp = temperature.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t ld = x.stride(0);
  for (int64_t r = 0; r < N; ++r) TORCH_CHECK(tp[r] > 0.f, "sample_rows: temperature must be > 0");
  at::parallel_for(0, N, 1, [&](int64_t b, int64_t e) {
    std::vector<float> w(V);
    for (int64_t r = b; r < e; ++r) {
      const float* row = xp + r * ld;
      const float T = tp[r];
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < V; ++i) mx = row[i] > mx ? row[i] : mx;
      mx /= T;  // division rounds monotonically: the max of x / T
      int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
      const __m256 vt = _mm256_set1_ps(T), vm = _mm256_set1_ps(mx);
      for (; i + 8 <= V; i += 8)
        _mm256_storeu_ps(w.data() + i, exp8(_mm256_sub_ps(_mm256_div_ps(_mm256_loadu_ps(row + i), vt), vm)));
#endif
      for (; i < V; ++i) w[i] = std::exp(row[i] / T - mx);
      float total = 0.f;
      for (int64_t k = 0; k < V; ++k) total += w[k];
      float target = up[r] * total;
      if (!(target < total)) target = std::nextafter(total, 0.f);
      float run = 0.f;
      int64_t pick = -1;
      for (int64_t k = 0; k < V; ++k) {
        run += w[k];
        if (run > target) {
          pick = k;
          break;
        }
      }
      if (pick < 0) {  // NaN logits: the last token of positive weight, if any
        pick = 0;
        for (int64_t k = 0; k < V; ++k)
          if (w[k] > 0.f) pick = k;
      }
      op[r] = pick;
    }
  });
  return out;
}
