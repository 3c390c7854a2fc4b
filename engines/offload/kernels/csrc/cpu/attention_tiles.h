// The ISA tiles of the prefill attention (attention.cpp): a block of 4 query rows against KB keys. With vec.h and
// quant.h, the only place with ISA #ifs: vdpbf16ps products where MOE_AVX512BF16 is defined, scalar loops elsewhere.
//
//   scores:     s[4][KB] = q rows . packed keys                      fp32
//   exp_tile:   p = bf16(exp(s * scale - m')), the row's sum and m'   (keys outside [a, b) are -inf in s)
//   accumulate: o[4][Dv] = o * corr + p . packed values               fp32
//
// Legend: D/Dv key/value head dims, KB keys per block.
#pragma once

#include "vec.h"

namespace moe_cpu {
namespace attn {

constexpr int64_t KB = 64;  // keys per block (4 groups of 16 lanes)

#if defined(MOE_AVX512BF16)
inline __m512 exp16(__m512 x) {
  if (Sleef_expf16_u10 != nullptr) return Sleef_expf16_u10(x);
  alignas(64) float t[16];
  _mm512_store_ps(t, x);
  for (float& f : t) f = std::exp(f);
  return _mm512_load_ps(t);
}
#endif

// s[r][0..KB) = q_r . k_(k0 + i) for 4 rows; q rows are D bf16 each (a local copy, zero rows past the chunk)
inline void scores(const uint16_t* q, int64_t D, const uint16_t* kp, int64_t k0, float s[4][KB]) {
  const int64_t P = D / 2;
#if defined(MOE_AVX512BF16)
  __m512 a[4][4];
  for (auto& row : a)
    for (auto& x : row) x = _mm512_setzero_ps();
  const uint16_t* kb = kp + (k0 / 16) * P * 32;
  for (int64_t j = 0; j < P; ++j) {
    __m512bh kv[4];
    for (int g = 0; g < 4; ++g) kv[g] = (__m512bh)_mm512_loadu_si512(kb + (g * P + j) * 32);
    for (int r = 0; r < 4; ++r) {
      int32_t pair;
      std::memcpy(&pair, q + r * D + 2 * j, 4);
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(pair);
      for (int g = 0; g < 4; ++g) a[r][g] = _mm512_dpbf16_ps(a[r][g], qb, kv[g]);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int g = 0; g < 4; ++g) _mm512_storeu_ps(s[r] + g * 16, a[r][g]);
#else
  for (int r = 0; r < 4; ++r)
    for (int64_t i = 0; i < KB; ++i) {
      const int64_t b = (k0 + i) / 16, l = (k0 + i) % 16;
      float acc = 0.0f;
      for (int64_t j = 0; j < P; ++j) {
        const uint16_t* kk = kp + (b * P + j) * 32 + 2 * l;
        acc += bf2f(q[r * D + 2 * j]) * bf2f(kk[0]) + bf2f(q[r * D + 2 * j + 1]) * bf2f(kk[1]);
      }
      s[r][i] = acc;
    }
#endif
}

#if defined(MOE_AVX512BF16)
// accumulate() over N groups of 16 value dims starting at d0 (N a constant: the accumulators stay in registers)
template <int N>
inline void accumulate_dims(const uint16_t p[4][KB], const uint16_t* vp, int64_t k0, int64_t Dv, int64_t d0,
                            const float* corr, float* o) {
  __m512 a[4][N];
  for (int r = 0; r < 4; ++r) {
    const __m512 c = _mm512_set1_ps(corr[r]);
    for (int g = 0; g < N; ++g) a[r][g] = _mm512_mul_ps(_mm512_loadu_ps(o + r * Dv + d0 + g * 16), c);
  }
  for (int64_t j = 0; j < KB / 2; ++j) {
    const uint16_t* vb = vp + ((k0 / 2 + j) * Dv + d0) * 2;
    __m512bh vv[N];
    for (int g = 0; g < N; ++g) vv[g] = (__m512bh)_mm512_loadu_si512(vb + g * 32);
    for (int r = 0; r < 4; ++r) {
      int32_t pair;
      std::memcpy(&pair, p[r] + 2 * j, 4);
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(pair);
      for (int g = 0; g < N; ++g) a[r][g] = _mm512_dpbf16_ps(a[r][g], pb, vv[g]);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int g = 0; g < N; ++g) _mm512_storeu_ps(o + r * Dv + d0 + g * 16, a[r][g]);
}
#endif

// o_r = o_r * corr_r + sum_i p_r[i] v_(k0 + i) for 4 rows; p [4][KB] bf16, o [4][Dv] fp32
inline void accumulate(const uint16_t p[4][KB], const uint16_t* vp, int64_t k0, int64_t Dv, const float* corr, float* o) {
#if defined(MOE_AVX512BF16)
  int64_t d0 = 0;
  for (; d0 + 64 <= Dv; d0 += 64) accumulate_dims<4>(p, vp, k0, Dv, d0, corr, o);
  for (; d0 < Dv; d0 += 16) accumulate_dims<1>(p, vp, k0, Dv, d0, corr, o);
#else
  for (int r = 0; r < 4; ++r)
    for (int64_t d = 0; d < Dv; ++d) {
      float acc = o[r * Dv + d] * corr[r];
      for (int64_t j = 0; j < KB / 2; ++j) {
        const uint16_t* vv = vp + ((k0 / 2 + j) * Dv + d) * 2;
        acc += bf2f(p[r][2 * j]) * bf2f(vv[0]) + bf2f(p[r][2 * j + 1]) * bf2f(vv[1]);
      }
      o[r * Dv + d] = acc;
    }
#endif
}

// p = exp(s * scale - mx') over one row of a key block, mx updated to the row's running max (keys outside [a, b) are
// -inf in s, so their p is 0); returns the sum of the fp32 exponentials.
inline float exp_tile(const float* s, int64_t a, int64_t b, float scale, float& mx, uint16_t* p) {
  float sum = 0.0f;
#if defined(MOE_AVX512BF16)
  const __m512 vs = _mm512_set1_ps(scale);
  __m512 x[4], vmx = _mm512_set1_ps(mx);
  for (int g = 0; g < 4; ++g) {
    x[g] = _mm512_mul_ps(_mm512_loadu_ps(s + g * 16), vs);
    vmx = _mm512_max_ps(vmx, x[g]);
  }
  mx = _mm512_reduce_max_ps(vmx);
  const __m512 vm = _mm512_set1_ps(mx);
  __m512 acc = _mm512_setzero_ps();
  for (int g = 0; g < 4; ++g) {
    const __m512 e = exp16(_mm512_sub_ps(x[g], vm));  // exp(-inf) = 0: keys outside [a, b)
    _mm256_storeu_si256((__m256i*)(p + g * 16), (__m256i)_mm512_cvtneps_pbh(e));  // round to nearest even
    acc = _mm512_add_ps(acc, e);
  }
  sum = _mm512_reduce_add_ps(acc);
  (void)a, (void)b;  // s holds -inf outside [a, b): the vector loop needs no bounds
#else
  for (int64_t i = a; i < b; ++i) mx = std::max(mx, s[i] * scale);
  for (int64_t i = 0; i < KB; ++i) {
    const float e = i >= a && i < b ? std::exp(s[i] * scale - mx) : 0.0f;
    p[i] = f2bf(e);
    sum += e;
  }
#endif
  return sum;
}

}  // namespace attn
}  // namespace moe_cpu
