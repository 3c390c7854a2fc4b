// ISA helpers of the bf16 kernels: bf16 <-> fp32, the dot products, prefetches, and the vector loops of the fused
// decode layer. With quant.h and attention_tiles.h, the only place with ISA #ifs: MOE_AVX512BF16 (vdpbf16ps),
// MOE_AVX2 (FMA on widened bf16), else a portable loop; jit.py defines one of them from /proc/cpuinfo at build time.
//
//   x [H] bf16 --(one pass over W [N, H], fp32 accumulation)--> y [N] fp32, rounded to bf16 by the callers
//
// Why: a decode step reads every selected weight once and does 2 flops per weight, so it is bound by memory
// bandwidth; torch's bf16 F.linear for one row reaches about half of it. These loops stream each weight row once and
// keep x in L1. Everything here is inline: the row loops of gemm.cpp, moe.cpp and decode.cpp must inline them.
// Legend: H input features, N output rows, M tokens, D head dim.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#if defined(MOE_AVX512BF16) || defined(MOE_AVX2)
#include <immintrin.h>
#endif

#if defined(MOE_AVX512BF16)
// torch's own vectorised exp (libtorch_cpu exports it; 1-ulp accuracy). Weak: a torch build without it leaves the
// pointer null and softmax_row takes the scalar loop, instead of the whole library failing to load.
extern "C" __m512 Sleef_expf16_u10(__m512) __attribute__((weak));
#endif

namespace moe_cpu {

inline float bf2f(uint16_t v) { uint32_t u = uint32_t(v) << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline uint16_t f2bf(float f) { return c10::BFloat16(f).x; }  // round to nearest even, as torch

// sum_j w[j] * x[j] with fp32 accumulation, one row at a time: consecutive rows of a [N, H] matrix are then
// one sequential stream, which the hardware prefetcher follows at full speed (reading 4 rows interleaved, i.e.
// 4 short streams restarting every 4 rows, measured at half the bandwidth). Four accumulators hide the FMA
// latency. A row's result depends only on the row, never on how rows were split over threads.
#if defined(MOE_AVX512BF16)
// software prefetch of the weight stream, BF_PF bytes ahead (4 lines: one 128-element step)
#ifndef BF_PF
#define BF_PF 4096
#endif
#define BF_PREFETCH(p) do { const char* q_ = reinterpret_cast<const char*>(p) + BF_PF; \
  _mm_prefetch(q_, _MM_HINT_T0); _mm_prefetch(q_ + 64, _MM_HINT_T0); _mm_prefetch(q_ + 128, _MM_HINT_T0); \
  _mm_prefetch(q_ + 192, _MM_HINT_T0); } while (0)
inline float dot_row(const uint16_t* w, const uint16_t* x, int64_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t j = 0;
  for (; j + 128 <= n; j += 128) {
    BF_PREFETCH(w + j);
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + j), (__m512bh)_mm512_loadu_si512(x + j));
    a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w + j + 32), (__m512bh)_mm512_loadu_si512(x + j + 32));
    a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(w + j + 64), (__m512bh)_mm512_loadu_si512(x + j + 64));
    a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(w + j + 96), (__m512bh)_mm512_loadu_si512(x + j + 96));
  }
  for (; j + 32 <= n; j += 32)
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + j), (__m512bh)_mm512_loadu_si512(x + j));
  if (j < n) {  // tail: masked loads read zeros past the row end
    __mmask32 m = (__mmask32)((1ull << (n - j)) - 1);
    a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_maskz_loadu_epi16(m, w + j), (__m512bh)_mm512_maskz_loadu_epi16(m, x + j));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}
#elif defined(MOE_AVX2)
// 8 bf16 -> 8 fp32 (exact: a bf16 is the top half of an fp32)
inline __m256 load8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
#endif

// dot_row of one weight row with up to 4 tokens at once: each weight chunk is loaded once for all of them, and
// each token's sum is formed exactly as dot_row forms it (same accumulators, same order, same reduction).
#if defined(MOE_AVX512BF16)
template <int T>
inline void dot_rows(const uint16_t* w, const uint16_t* const* x, int64_t n, float* out) {
  __m512 a[T][4];
  for (int t = 0; t < T; ++t) a[t][0] = a[t][1] = a[t][2] = a[t][3] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 128 <= n; j += 128) {
    BF_PREFETCH(w + j);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + j), w1 = (__m512bh)_mm512_loadu_si512(w + j + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + j + 64), w3 = (__m512bh)_mm512_loadu_si512(w + j + 96);
    for (int t = 0; t < T; ++t) {
      a[t][0] = _mm512_dpbf16_ps(a[t][0], w0, (__m512bh)_mm512_loadu_si512(x[t] + j));
      a[t][1] = _mm512_dpbf16_ps(a[t][1], w1, (__m512bh)_mm512_loadu_si512(x[t] + j + 32));
      a[t][2] = _mm512_dpbf16_ps(a[t][2], w2, (__m512bh)_mm512_loadu_si512(x[t] + j + 64));
      a[t][3] = _mm512_dpbf16_ps(a[t][3], w3, (__m512bh)_mm512_loadu_si512(x[t] + j + 96));
    }
  }
  for (; j + 32 <= n; j += 32) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + j);
    for (int t = 0; t < T; ++t) a[t][0] = _mm512_dpbf16_ps(a[t][0], w0, (__m512bh)_mm512_loadu_si512(x[t] + j));
  }
  if (j < n) {
    __mmask32 m = (__mmask32)((1ull << (n - j)) - 1);
    const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(m, w + j);
    for (int t = 0; t < T; ++t) a[t][1] = _mm512_dpbf16_ps(a[t][1], w0, (__m512bh)_mm512_maskz_loadu_epi16(m, x[t] + j));
  }
  for (int t = 0; t < T; ++t)
    out[t] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[t][0], a[t][1]), _mm512_add_ps(a[t][2], a[t][3])));
}

// out[t] = dot(w, x[t]) for M tokens, in tiles of 4.
inline void dot_many(const uint16_t* w, const uint16_t* const* x, int64_t M, int64_t n, float* out) {
  int64_t t = 0;
  for (; t + 4 <= M; t += 4) dot_rows<4>(w, x + t, n, out + t);
  switch (M - t) {
    case 3: dot_rows<3>(w, x + t, n, out + t); break;
    case 2: dot_rows<2>(w, x + t, n, out + t); break;
    case 1: out[t] = dot_row(w, x[t], n); break;
  }
}
#endif

// ---- activations read many times: converted once --------------------------------------------------------------------
// A row loop reads the same activation x for every weight row. AVX512-BF16 multiplies bf16 pairs as stored (xval is
// bf16: dot_row / dot_many above); AVX2 and the portable loop multiply fp32, so there x is widened once per call
// (as_x), not once per weight row: with two cores each streaming ~18 GB/s of bf16 weights, AVX2's widening shuffles,
// not the memory, bounded the row rate. Widening is exact, so the sums are those of the former bf16-activation loops,
// product for product and in the same order (bit-identical).
#if defined(MOE_AVX512BF16)
using xval = uint16_t;
inline const xval* as_x(const uint16_t* x, int64_t, std::vector<float>&) { return x; }
inline float dot_row_x(const uint16_t* w, const xval* x, int64_t n) { return dot_row(w, x, n); }
inline void dot_many_x(const uint16_t* w, const xval* const* x, int64_t M, int64_t n, float* out) {
  dot_many(w, x, M, n, out);
}
#else
using xval = float;
// x [n] bf16 widened into buf; the pointer the row loops read
inline const xval* as_x(const uint16_t* x, int64_t n, std::vector<float>& buf) {
  buf.resize(n);
  for (int64_t j = 0; j < n; ++j) buf[j] = bf2f(x[j]);
  return buf.data();
}
#if defined(MOE_AVX2)
#ifndef AVX2_PF
#define AVX2_PF 2048  // software prefetch of the weight stream, this many bytes ahead
#endif
// out[t] = sum_j w[j] * x[t][j] for T tokens of fp32 activations: the row's bf16 chunk is widened once for all T;
// four accumulators per token hide the FMA latency, and each token's sum does not depend on T (same accumulators,
// order, reduction and scalar tail). T <= 2 keeps the 4 T accumulators and 4 widened weights in 16 registers.
// The accumulators are named variables, not an array: GCC kept an a[T][4] array on the stack, every FMA then a load
// and a store in its dependency chain (gemm_bf16 of 16 tokens ran at ~55 GFLOP/s on two cores, in cache or not).
inline float dot_finish_x(const uint16_t* w, const float* x, int64_t j, int64_t n, __m256 a0, __m256 a1, __m256 a2,
                          __m256 a3) {
  __m256 v = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  float r = _mm_cvtss_f32(s);
  for (int64_t k = j; k < n; ++k) r += bf2f(w[k]) * x[k];
  return r;
}
template <int T>
inline void dot_rows_x(const uint16_t* w, const float* const* x, int64_t n, float* out) {
  static_assert(T == 1 || T == 2, "dot_rows_x: one or two tokens");
  const float* x0 = x[0];
  const float* x1 = x[T - 1];
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(w + j) + AVX2_PF, _MM_HINT_T0);  // one 64-byte line per step
    const __m256 w0 = load8(w + j), w1 = load8(w + j + 8), w2 = load8(w + j + 16), w3 = load8(w + j + 24);
    a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0 + j), a0);
    a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x0 + j + 8), a1);
    a2 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x0 + j + 16), a2);
    a3 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x0 + j + 24), a3);
    if constexpr (T == 2) {
      b0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x1 + j), b0);
      b1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x1 + j + 8), b1);
      b2 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x1 + j + 16), b2);
      b3 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x1 + j + 24), b3);
    }
  }
  for (; j + 8 <= n; j += 8) {
    const __m256 w0 = load8(w + j);
    a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0 + j), a0);
    if constexpr (T == 2) b0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x1 + j), b0);
  }
  out[0] = dot_finish_x(w, x0, j, n, a0, a1, a2, a3);
  if constexpr (T == 2) out[1] = dot_finish_x(w, x1, j, n, b0, b1, b2, b3);
}
#else
template <int T>
inline void dot_rows_x(const uint16_t* w, const float* const* x, int64_t n, float* out) {
  for (int t = 0; t < T; ++t) {
    float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // 8 partial sums: lets the compiler vectorise without -ffast-math
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
      for (int l = 0; l < 8; ++l) s[l] += bf2f(w[j + l]) * x[t][j + l];
    float r = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    for (; j < n; ++j) r += bf2f(w[j]) * x[t][j];
    out[t] = r;
  }
}
#endif
inline float dot_row_x(const uint16_t* w, const xval* x, int64_t n) {
  float r;
  dot_rows_x<1>(w, &x, n, &r);
  return r;
}
// out[t] = dot(w, x[t]) for M tokens, in tiles of 2
inline void dot_many_x(const uint16_t* w, const xval* const* x, int64_t M, int64_t n, float* out) {
  int64_t t = 0;
  for (; t + 2 <= M; t += 2) dot_rows_x<2>(w, x + t, n, out + t);
  if (t < M) dot_rows_x<1>(w, x + t, n, out + t);
}
#endif

// ---- the fused decode layer's attention (decode.cpp) --------------------------------------------------------------

// s = softmax(s) in place, fp32 (max subtracted first)
inline void softmax_row(float* s, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity(), sum = 0.0f;
  int64_t i = 0;
#if defined(MOE_AVX512BF16)
  if (Sleef_expf16_u10 == nullptr) {
    for (; i < n; ++i) mx = std::max(mx, s[i]);
    for (i = 0; i < n; ++i) { s[i] = std::exp(s[i] - mx); sum += s[i]; }
    for (i = 0; i < n; ++i) s[i] /= sum;
    return;
  }
  __m512 vmx = _mm512_set1_ps(mx);
  for (; i + 16 <= n; i += 16) vmx = _mm512_max_ps(vmx, _mm512_loadu_ps(s + i));
  mx = _mm512_reduce_max_ps(vmx);
  for (int64_t j = i; j < n; ++j) mx = std::max(mx, s[j]);
  const __m512 m = _mm512_set1_ps(mx);
  __m512 vs = _mm512_setzero_ps();
  for (i = 0; i + 16 <= n; i += 16) {
    const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_loadu_ps(s + i), m));
    _mm512_storeu_ps(s + i, e);
    vs = _mm512_add_ps(vs, e);
  }
  sum = _mm512_reduce_add_ps(vs);
  for (int64_t j = i; j < n; ++j) { s[j] = std::exp(s[j] - mx); sum += s[j]; }
  const __m512 d = _mm512_set1_ps(sum);
  for (i = 0; i + 16 <= n; i += 16) _mm512_storeu_ps(s + i, _mm512_div_ps(_mm512_loadu_ps(s + i), d));
  for (; i < n; ++i) s[i] /= sum;
#else
  for (; i < n; ++i) mx = std::max(mx, s[i]);
  for (i = 0; i < n; ++i) { s[i] = std::exp(s[i] - mx); sum += s[i]; }
  for (i = 0; i < n; ++i) s[i] /= sum;
#endif
}

#ifndef PF_ROWS
#define PF_ROWS 16
#endif
inline void prefetch_row(const uint16_t* p, int64_t n) {  // every cache line of n bf16 values
#if defined(MOE_AVX512BF16) || defined(MOE_AVX2)
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < n * 2; b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
#else
  (void)p; (void)n;
#endif
}

// o[d] += a * v[d] over D values (v bf16): a value row into a head's fp32 output (decode.cpp), a latent row into
// MLA's fp32 sums (mla.cpp)
inline void axpy_bf16(float* o, float a, const uint16_t* v, int64_t D) {
  int64_t d = 0;
#if defined(MOE_AVX512BF16)
  const __m512 av = _mm512_set1_ps(a);
  for (; d + 16 <= D; d += 16) {
    const __m512 vv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(v + d))), 16));
    _mm512_storeu_ps(o + d, _mm512_fmadd_ps(av, vv, _mm512_loadu_ps(o + d)));
  }
#elif defined(MOE_AVX2)
  const __m256 av = _mm256_set1_ps(a);
  for (; d + 8 <= D; d += 8)
    _mm256_storeu_ps(o + d, _mm256_fmadd_ps(av, load8(v + d), _mm256_loadu_ps(o + d)));
#endif
  for (; d < D; ++d) o[d] += a * bf2f(v[d]);
}

// A quantized KV row (decode.cpp, runtime/kv_quant.py): out[d] = bf16(value(q[d]) * s), rounded to nearest even;
// value = the int8 code, or (fp8) the e4m3fn code's value: sign, 4 exponent bits biased by 7, 3 mantissa bits, the
// codes with a zero exponent subnormal (m x 2^-9); 16 at a time (AVX-512 BF16) or 8 (AVX2). Returns the number of
// values done (the rest: the caller's loop).
inline int64_t codes_to_bf16(const uint8_t* q, bool fp8, float s, int64_t D, uint16_t* out) {
  int64_t d = 0;
#if defined(MOE_AVX512BF16)
  const __m512 sv = _mm512_set1_ps(s);
  const __m512i low7 = _mm512_set1_epi32(0x7F), bias = _mm512_set1_epi32(120 << 23), eight = _mm512_set1_epi32(8);
  for (; d + 16 <= D; d += 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + d));
    __m512 v;
    if (!fp8) {
      v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    } else {
      const __m512i x = _mm512_cvtepu8_epi32(b), mag = _mm512_and_si512(x, low7);
      const __m512 normal = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(mag, 20), bias));
      const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(1.0f / 512.0f));
      v = _mm512_mask_blend_ps(_mm512_cmplt_epi32_mask(mag, eight), normal, sub);
      v = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v),
                                              _mm512_slli_epi32(_mm512_andnot_si512(low7, x), 24)));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(v, sv)));
  }
#elif defined(MOE_AVX2)
  const __m256 sv = _mm256_set1_ps(s);
  const __m256i low7 = _mm256_set1_epi32(0x7F), bias = _mm256_set1_epi32(120 << 23), eight = _mm256_set1_epi32(8);
  const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7FFF);
  for (; d + 8 <= D; d += 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + d));
    __m256 v;
    if (!fp8) {
      v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    } else {
      const __m256i x = _mm256_cvtepu8_epi32(b), mag = _mm256_and_si256(x, low7);
      const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20), bias));
      const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.0f / 512.0f));
      v = _mm256_blendv_ps(normal, sub, _mm256_castsi256_ps(_mm256_cmpgt_epi32(eight, mag)));
      v = _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(v),
                                              _mm256_slli_epi32(_mm256_andnot_si256(low7, x), 24)));
    }
    // to bf16, rounded to nearest even as f2bf (c10::BFloat16) rounds: + 0x7FFF + the kept low bit, then the top half
    __m256i u = _mm256_castps_si256(_mm256_mul_ps(v, sv));
    u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(half, _mm256_and_si256(_mm256_srli_epi32(u, 16), one))), 16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + d),
                     _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)));
  }
#else
  (void)q; (void)fp8; (void)s; (void)out;
#endif
  return d;
}

// ---- MLA decode (mla.cpp): fp32 vectors against bf16 rows -----------------------------------------------------

// sum_j w[j] * x[j], w bf16, x fp32 (AVX2 FMA on widened bf16; the AVX-512 machines run it too)
inline float dot_bf16_f32(const uint16_t* w, const float* x, int64_t n) {
  int64_t j = 0;
  float r = 0.0f;
#if defined(MOE_AVX512BF16) || defined(MOE_AVX2)
  __m256 a0 = _mm256_setzero_ps(), a1 = a0;
  for (; j + 16 <= n; j += 16) {
    const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(w + j))), 16));
    const __m256 w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(w + j + 8))), 16));
    a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + j), a0);
    a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + j + 8), a1);
  }
  const __m256 v = _mm256_add_ps(a0, a1);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  r = _mm_cvtss_f32(s);
#endif
  for (; j < n; ++j) r += bf2f(w[j]) * x[j];
  return r;
}

}  // namespace moe_cpu
