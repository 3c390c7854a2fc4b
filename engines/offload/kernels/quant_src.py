"""Quantized-expert GEMV kernels for decode on the CPU: int8, FP8 e4m3 and MXFP4 weights, dequantized in registers.

    x [N, K] bf16|fp32 --(one pass over the stored rows W [R, ...], fp32 accumulation, rows split over threads)--> y [N, R]
    (x dtype). A row is read once from DRAM for all N tokens (decode batches: N = 1..16); larger N take the
    dequantize + GEMM path in kernels.py.

Formats (what the host store and the slots hold, byte for byte):
  int8   w int8 [R, K] + w_scale fp32 [R] (per output row, symmetric, |q| <= 127): w ~ q * s.
         x is quantized per token in blocks of 32 (fp32 scale per block, like llama.cpp's q8_0 activations) and the
         dot product runs in int8 x int8 -> int32: AVX-512 VNNI ``vpdpbusd`` (x as |x|, w with the sign of x), AVX2
         ``vpmaddubsw``; y = s_w * sum_b s_x[b] * sum_{j in b} qx_j * qw_j. Error: weight and activation rounding.
  fp8    w float8_e4m3fn [R, K] + scale fp32 [RB, ceil(K/128)] (DeepSeek-V3 ``weight_scale_inv``, 128x128 blocks).
         Row r reads scale row r/128; with ``split`` S < R (a concatenated gate|up whose halves were quantized apart)
         rows r >= S read ceil(S/128) + (r-S)/128. e4m3 -> fp16 bits by shifts -> fp32 (F16C), times the block scale:
         the same fp32 weight ``q.float() * s`` a dequantizing reference builds, then fp32 FMA with x.
  mxfp4  blocks uint8 [R, K/2] (two e2m1 values per byte, low nibble first) + scales uint8 [R, K/32] (E8M0:
         2^(s-127) per block of 32), the gpt-oss ``*_blocks`` / ``*_scales``. A 16-entry table (vpermps) times the
         block's power of two gives the exact weight; x is split into even/odd elements once per call.

Ops (namespace ``moe_offload``, fake kernels in ``register_fakes``):
  gemv_q(x [N, K], w, w_scale, bias [R]?, split=0) -> [N, R]            format from w.dtype: int8 | float8_e4m3fn | uint8
  expert_mlp_q(x [1, H], gate_up, gate_up_scale, down, down_scale) -> [1, H]   int8|fp8, silu(gate) * up, one token;
      intermediates rounded to x's dtype where the unfused path (gemv_q, torch silu, gemv_q) rounds
  experts_mlp_q(x [1, H], gate_ups K x, gate_up_scales K x, downs K x, down_scales K x) -> [K, H]
      K experts of one token in two parallel passes; row k is bit-identical to expert_mlp_q of expert k
Legend: N tokens, K input features, R output rows, H hidden, I expert intermediate (2I gate|up rows), B = 128.
Compiled together with cpu_kernels.SOURCE (one library, one build); the ISA macros come from cpu_kernels.VARIANTS.
"""

from __future__ import annotations

QUANT_SOURCE = r"""
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(MOE_AVX512BF16) || defined(MOE_AVX2)
#include <immintrin.h>
#endif

namespace moe_quant {

constexpr int64_t QB = 32;    // int8 activation block
constexpr int64_t FB = 128;   // fp8 weight block (both dimensions)
constexpr int64_t MB = 32;    // mxfp4 block
constexpr int64_t MAX_N = 16; // tokens per call (decode batches)
#ifndef PF_DIST
#define PF_DIST 4096          // int8 rows: software prefetch this many bytes ahead (the dots are too slow for the
#endif                        // hardware prefetcher alone to keep DRAM busy: 31.5 -> 38.2 GB/s from DRAM on 8 int8 experts)

inline float bf2f(uint16_t v) { uint32_t u = uint32_t(v) << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline uint16_t f2bf(float f) { return c10::BFloat16(f).x; }

// Tables built once: e4m3fn byte -> float, E8M0 byte -> 2^(s-127) (a libm call per block would cost more than the block).
struct Tables {
  float fp8[256], e8m0[256];
  Tables() {
    for (int b = 0; b < 256; ++b) {
      int e = (b >> 3) & 0xF, m = b & 7;
      float v = e ? std::ldexp(1.0f + m / 8.0f, e - 7) : std::ldexp(m / 8.0f, -6);
      fp8[b] = (b & 0x80) ? -v : v;
      e8m0[b] = std::ldexp(1.0f, b - 127);
    }
  }
};
const Tables TABLES;
inline float fp8_to_float(uint8_t b) { return TABLES.fp8[b]; }
inline float e8m0(uint8_t s) { return TABLES.e8m0[s]; }
const float FP4[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

// ---- x, prepared once per call and shared by every row ----------------------------------------------------------
struct Tokens {
  int64_t n = 0, k = 0, kp = 0;  // tokens, features, features padded to 64
  std::vector<float> f;          // [n, kp] fp32 copy, zero padded (fp8)
  std::vector<float> even, odd;  // [n, kp/2] deinterleaved x (mxfp4: low nibble = even element)
  std::vector<int8_t> q;         // [n, kp] int8 x (int8 weights)
  std::vector<uint8_t> qabs;     // [n, kp] |q|
  std::vector<uint64_t> qneg;    // [n, kp/64] sign bits of q (AVX-512 masks)
  std::vector<float> qs;         // [n, kp/32] per-block scales
  std::vector<float> qs16;       // [n, kp/64, 16] scales as lanes of a vpdpbusd result (lanes 0-7 block 2b, 8-15 block 2b+1)
};

void prepare(const at::Tensor& x, int64_t n, int64_t k, char fmt, Tokens& t) {
  t.n = n; t.k = k; t.kp = (k + 63) / 64 * 64;
  std::vector<float> xf(n * t.kp, 0.0f);
  if (x.scalar_type() == at::kBFloat16) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(x.data_ptr());
    for (int64_t i = 0; i < n; ++i) for (int64_t j = 0; j < k; ++j) xf[i * t.kp + j] = bf2f(p[i * k + j]);
  } else {
    const float* p = x.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) std::memcpy(xf.data() + i * t.kp, p + i * k, k * sizeof(float));
  }
  if (fmt == 'f') { t.f.swap(xf); return; }
  if (fmt == 'm') {
    t.even.assign(n * t.kp / 2, 0.0f); t.odd.assign(n * t.kp / 2, 0.0f);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < t.kp / 2; ++j) { t.even[i * t.kp / 2 + j] = xf[i * t.kp + 2 * j]; t.odd[i * t.kp / 2 + j] = xf[i * t.kp + 2 * j + 1]; }
    return;
  }
  // int8: per 32-block symmetric; x / s rounded half to even (torch.round), as the test's reference does
  const int64_t nb = t.kp / QB;
  t.q.assign(n * t.kp, 0); t.qabs.assign(n * t.kp, 0); t.qneg.assign(n * t.kp / 64, 0);
  t.qs.assign(n * nb, 0.0f); t.qs16.assign(n * nb / 2 * 16, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = xf.data() + i * t.kp + b * QB;
      float amax = 0.0f;
      for (int64_t j = 0; j < QB; ++j) amax = std::max(amax, std::fabs(v[j]));
      float s = amax / 127.0f;
      t.qs[i * nb + b] = s;
      for (int64_t j = 0; j < QB; ++j) {
        int q = s > 0.0f ? (int)std::nearbyint(v[j] / s) : 0;
        q = std::max(-127, std::min(127, q));
        int64_t at = i * t.kp + b * QB + j;
        t.q[at] = (int8_t)q; t.qabs[at] = (uint8_t)std::abs(q);
        if (q < 0) t.qneg[at / 64] |= uint64_t(1) << (at % 64);
      }
      for (int64_t l = 0; l < 8; ++l) t.qs16[(i * nb / 2 + b / 2) * 16 + (b % 2) * 8 + l] = s;
    }
  }
}

// ---- one row . one token, per format and ISA ----------------------------------------------------------------------
// int8: sum_b qs[b] * sum_{j in b} qx_j * w_j (without the row's weight scale)
inline float dot_q8(const int8_t* w, const Tokens& t, int64_t i) {
  const int64_t k = t.k;
  const int8_t* xq = t.q.data() + i * t.kp;
  const float* qs = t.qs.data() + i * (t.kp / QB);
#if defined(MOE_AVX512BF16)
  const uint8_t* xa = t.qabs.data() + i * t.kp;
  const uint64_t* neg = t.qneg.data() + i * (t.kp / 64);
  const float* s16 = t.qs16.data() + i * (t.kp / 64) * 16;
  const __m512i zero = _mm512_setzero_si512();
  __m512 a0 = _mm512_setzero_ps(), a1 = a0;
  int64_t j = 0;
  for (; j + 128 <= k; j += 128) {
    _mm_prefetch(reinterpret_cast<const char*>(w + j) + PF_DIST, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + j) + PF_DIST + 64, _MM_HINT_T0);
    __m512i w0 = _mm512_loadu_si512(w + j), w1 = _mm512_loadu_si512(w + j + 64);
    w0 = _mm512_mask_sub_epi8(w0, (__mmask64)neg[j / 64], zero, w0);  // w * sign(x): |x| is the unsigned operand
    w1 = _mm512_mask_sub_epi8(w1, (__mmask64)neg[j / 64 + 1], zero, w1);
    __m512i d0 = _mm512_dpbusd_epi32(zero, _mm512_loadu_si512(xa + j), w0);
    __m512i d1 = _mm512_dpbusd_epi32(zero, _mm512_loadu_si512(xa + j + 64), w1);
    a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_loadu_ps(s16 + (j / 64) * 16), a0);
    a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), _mm512_loadu_ps(s16 + (j / 64 + 1) * 16), a1);
  }
  for (; j < k; j += 64) {  // last whole 64s, then the tail: a masked load reads zeros past the row end (masked loads
    // stream from DRAM several times slower: only the tail takes one)
    __m512i w0 = (k - j >= 64) ? _mm512_loadu_si512(w + j) : _mm512_maskz_loadu_epi8(((__mmask64)1 << (k - j)) - 1, w + j);
    w0 = _mm512_mask_sub_epi8(w0, (__mmask64)neg[j / 64], zero, w0);
    __m512i d0 = _mm512_dpbusd_epi32(zero, _mm512_loadu_si512(xa + j), w0);
    a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_loadu_ps(s16 + (j / 64) * 16), a0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#elif defined(MOE_AVX2)
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0;
  int64_t j = 0;
  for (; j + 64 <= k; j += 64) {
    __m256i x0 = _mm256_loadu_si256((const __m256i*)(xq + j)), x1 = _mm256_loadu_si256((const __m256i*)(xq + j + 32));
    __m256i w0 = _mm256_loadu_si256((const __m256i*)(w + j)), w1 = _mm256_loadu_si256((const __m256i*)(w + j + 32));
    __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(x0, x0), _mm256_sign_epi8(w0, x0)), ones);
    __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(x1, x1), _mm256_sign_epi8(w1, x1)), ones);
    a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(qs[j / QB]), a0);
    a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(qs[j / QB + 1]), a1);
  }
  for (; j + 32 <= k; j += 32) {
    __m256i x0 = _mm256_loadu_si256((const __m256i*)(xq + j)), w0 = _mm256_loadu_si256((const __m256i*)(w + j));
    __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(x0, x0), _mm256_sign_epi8(w0, x0)), ones);
    a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(qs[j / QB]), a0);
  }
  __m256 v = _mm256_add_ps(a0, a1);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  float total = _mm_cvtss_f32(s);
  if (j < k) {  // tail block: plain integer sum
    int32_t acc = 0;
    for (int64_t l = j; l < k; ++l) acc += int32_t(xq[l]) * int32_t(w[l]);
    total += float(acc) * qs[j / QB];
  }
  return total;
#else
  float total = 0.0f;
  for (int64_t b = 0; b * QB < k; ++b) {
    int32_t acc = 0;
    for (int64_t l = b * QB; l < std::min(k, (b + 1) * QB); ++l) acc += int32_t(xq[l]) * int32_t(w[l]);
    total += float(acc) * qs[b];
  }
  return total;
#endif
}

// fp8: sum over 128-column blocks of scale[block] * sum_j x_j * fp8(w_j); srow = the row's scale row (ceil(K/128)).
// e4m3 -> fp16 bits: the byte sign-extended to 16 bits and shifted left by 7 puts the sign in bit 15 and exponent +
// mantissa in bits 7..13 (bit 14, a copy of the sign, is cleared): the fp16 value is the e4m3 value * 2^-8, exactly
// (subnormals included); F16C widens it to fp32 and the block scale carries the 2^8.
inline float dot_fp8(const uint8_t* w, const float* srow, const Tokens& t, int64_t i) {
  const int64_t k = t.k;
  const float* x = t.f.data() + i * t.kp;
#if defined(MOE_AVX512BF16)
  const __m512i keep = _mm512_set1_epi16((short)0xBF80);
  __m512 total = _mm512_setzero_ps();
  for (int64_t c = 0; c * FB < k; ++c) {
    const int64_t end = std::min(k, (c + 1) * FB);
    __m512 a0 = _mm512_setzero_ps(), a1 = a0;
    for (int64_t j = c * FB; j < end; j += 32) {
      // plain loads where the row goes on (masked loads measured 4x slower streaming from DRAM); the tail masked
      __m256i b = (end - j >= 32) ? _mm256_loadu_si256((const __m256i*)(w + j))
                                  : _mm256_maskz_loadu_epi8((__mmask32)((1u << (end - j)) - 1), w + j);
      __m512i f16 = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(b), 7), keep);
      a0 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(f16)), _mm512_loadu_ps(x + j), a0);
      a1 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(f16, 1)), _mm512_loadu_ps(x + j + 16), a1);
    }
    total = _mm512_fmadd_ps(_mm512_add_ps(a0, a1), _mm512_set1_ps(srow[c] * 256.0f), total);
  }
  return _mm512_reduce_add_ps(total);
#elif defined(MOE_AVX2)
  const __m128i keep = _mm_set1_epi16((short)0xBF80);
  __m256 total = _mm256_setzero_ps();
  float tail = 0.0f;
  for (int64_t c = 0; c * FB < k; ++c) {
    const int64_t end = std::min(k, (c + 1) * FB);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    int64_t j = c * FB;
    for (; j + 16 <= end; j += 16) {
      __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + j)));
      __m256i f16 = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16((short)0xBF80));
      a0 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(f16)), _mm256_loadu_ps(x + j), a0);
      a1 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(f16, 1)), _mm256_loadu_ps(x + j + 8), a1);
    }
    for (; j + 8 <= end; j += 8) {
      __m128i f16 = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i*)(w + j))), 7), keep);
      a0 = _mm256_fmadd_ps(_mm256_cvtph_ps(f16), _mm256_loadu_ps(x + j), a0);
    }
    float part = 0.0f;
    for (; j < end; ++j) part += x[j] * fp8_to_float(w[j]);
    tail += part * srow[c];
    total = _mm256_fmadd_ps(_mm256_add_ps(a0, a1), _mm256_set1_ps(srow[c] * 256.0f), total);
  }
  __m128 v = _mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps(total, 1));
  v = _mm_hadd_ps(v, v);
  v = _mm_hadd_ps(v, v);
  return _mm_cvtss_f32(v) + tail;
#else
  float total = 0.0f;
  for (int64_t c = 0; c * FB < k; ++c) {
    float part = 0.0f;
    for (int64_t j = c * FB; j < std::min(k, (c + 1) * FB); ++j) part += x[j] * fp8_to_float(w[j]);
    total += part * srow[c];
  }
  return total;
#endif
}

// mxfp4: sum over 32-blocks of sum_l x_l * FP4[nibble_l] * 2^(s-127); w = the row's K/2 bytes, sc = its K/32 scales
inline float dot_mxfp4(const uint8_t* w, const uint8_t* sc, const Tokens& t, int64_t i) {
  const int64_t nb = t.k / MB;
  const float* xe = t.even.data() + i * t.kp / 2;
  const float* xo = t.odd.data() + i * t.kp / 2;
#if defined(MOE_AVX512BF16)
  const __m512 lut = _mm512_loadu_ps(FP4);
  const __m128i low = _mm_set1_epi8(0x0F);
  __m512 a0 = _mm512_setzero_ps(), a1 = a0;
  for (int64_t b = 0; b < nb; ++b) {
    const __m512 ls = _mm512_mul_ps(lut, _mm512_set1_ps(e8m0(sc[b])));  // exact: a power of two
    __m128i by = _mm_loadu_si128((const __m128i*)(w + b * 16));
    __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(by, low));
    __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(by, 4), low));
    a0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(lo, ls), _mm512_loadu_ps(xe + b * 16), a0);
    a1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(hi, ls), _mm512_loadu_ps(xo + b * 16), a1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#elif defined(MOE_AVX2)
  const __m256 mag = _mm256_loadu_ps(FP4);  // entries 0..7: the magnitudes; bit 3 of a nibble is the sign
  const __m128i low = _mm_set1_epi8(0x0F);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0;
  for (int64_t b = 0; b < nb; ++b) {
    const __m256 ms = _mm256_mul_ps(mag, _mm256_set1_ps(e8m0(sc[b])));
    for (int half = 0; half < 2; ++half) {
      __m128i by = _mm_loadl_epi64((const __m128i*)(w + b * 16 + half * 8));
      __m256i lo = _mm256_cvtepu8_epi32(_mm_and_si128(by, low));
      __m256i hi = _mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(by, 4), low));
      __m256 wl = _mm256_xor_ps(_mm256_permutevar8x32_ps(ms, lo), _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(lo, 3), 31)));
      __m256 wh = _mm256_xor_ps(_mm256_permutevar8x32_ps(ms, hi), _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(hi, 3), 31)));
      a0 = _mm256_fmadd_ps(wl, _mm256_loadu_ps(xe + b * 16 + half * 8), a0);
      a1 = _mm256_fmadd_ps(wh, _mm256_loadu_ps(xo + b * 16 + half * 8), a1);
    }
  }
  __m256 v8 = _mm256_add_ps(a0, a1);
  __m128 v = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps(v8, 1));
  v = _mm_hadd_ps(v, v);
  v = _mm_hadd_ps(v, v);
  return _mm_cvtss_f32(v);
#else
  float total = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const float s = e8m0(sc[b]);
    float acc = 0.0f;
    for (int64_t l = 0; l < 16; ++l) {
      uint8_t by = w[b * 16 + l];
      acc += xe[b * 16 + l] * (FP4[by & 0xF] * s) + xo[b * 16 + l] * (FP4[by >> 4] * s);
    }
    total += acc;
  }
  return total;
#endif
}

// ---- the weight of one projection, as stored -------------------------------------------------------------------
struct Weight {
  char fmt;             // 'q' int8, 'f' fp8, 'm' mxfp4
  const uint8_t* w;     // row r starts at w + r * ld (bytes)
  int64_t ld, rows, k;  // k: input features (mxfp4: 2 per byte)
  const float* s;       // int8: [R]; fp8: [RB, CB] row-major
  int64_t s_ld;         // fp8: CB; mxfp4: scale-row stride in bytes
  const uint8_t* ms;    // mxfp4 scales
  int64_t split;        // fp8 gate|up split (R when none)
};

inline float row_dot(const Weight& W, int64_t r, const Tokens& t, int64_t i) {
  const uint8_t* row = W.w + r * W.ld;
  if (W.fmt == 'q') return W.s[r] * dot_q8(reinterpret_cast<const int8_t*>(row), t, i);
  if (W.fmt == 'f') {
    int64_t rb = r < W.split ? r / FB : (W.split + FB - 1) / FB + (r - W.split) / FB;
    return dot_fp8(row, W.s + rb * W.s_ld, t, i);
  }
  return dot_mxfp4(row, W.ms + r * W.s_ld, t, i);
}

inline int64_t grain(int64_t row_bytes) { return std::max<int64_t>(4, (int64_t(1) << 16) / std::max<int64_t>(1, row_bytes)); }

// out[i, r] for rows [begin, end): fp32 results (+bias), written as the output dtype
template <typename Out>
void rows_range(const Weight& W, const Tokens& t, const float* bias, int64_t begin, int64_t end, Out* out, int64_t out_ld) {
  for (int64_t r = begin; r < end; ++r)
    for (int64_t i = 0; i < t.n; ++i) {
      float v = row_dot(W, r, t, i) + (bias ? bias[r] : 0.0f);
      if constexpr (std::is_same<Out, float>::value) out[i * out_ld + r] = v; else out[i * out_ld + r] = f2bf(v);
    }
}

Weight weight_of(const at::Tensor& w, const at::Tensor& s, int64_t split, const char* what) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.stride(1) == 1, what,
              ": expected a 2-D CPU tensor with contiguous rows, got ", w.sizes(), " strides ", w.strides(), " on ", w.device());
  Weight W{};
  W.w = reinterpret_cast<const uint8_t*>(w.data_ptr());
  W.ld = w.stride(0) * w.element_size();
  W.rows = w.size(0);
  W.split = split > 0 ? split : W.rows;
  auto st = w.scalar_type();
  if (st == at::kChar) {
    W.fmt = 'q'; W.k = w.size(1);
    TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.numel() == W.rows, what,
                " int8: expected an fp32 scale per row (", W.rows, "), got ", s.scalar_type(), " ", s.sizes());
    W.s = s.data_ptr<float>();
  } else if (st == at::kFloat8_e4m3fn) {
    W.fmt = 'f'; W.k = w.size(1);
    int64_t cb = (W.k + FB - 1) / FB, rb = (W.split + FB - 1) / FB + (W.rows - W.split + FB - 1) / FB;
    TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.dim() == 2 && s.size(0) == rb && s.size(1) == cb, what,
                " fp8: expected fp32 block scales [", rb, ", ", cb, "] (128x128 blocks, split at row ", W.split, "), got ",
                s.scalar_type(), " ", s.sizes());
    W.s = s.data_ptr<float>(); W.s_ld = cb;
  } else if (st == at::kByte) {
    W.fmt = 'm'; W.k = w.size(1) * 2;
    TORCH_CHECK(W.k % MB == 0 && s.scalar_type() == at::kByte && s.dim() == 2 && s.size(0) == W.rows && s.size(1) == W.k / MB
                && s.stride(1) == 1, what, " mxfp4: expected uint8 E8M0 scales [", W.rows, ", ", W.k / MB,
                "] (blocks of 32 over ", W.k, " features), got ", s.scalar_type(), " ", s.sizes());
    W.ms = s.data_ptr<uint8_t>(); W.s_ld = s.stride(0);
  } else {
    TORCH_CHECK(false, what, ": expected int8, float8_e4m3fn or uint8 (mxfp4 blocks) weights, got ", st);
  }
  return W;
}

std::vector<float> bias_of(const std::optional<at::Tensor>& b, int64_t n, const char* what) {
  if (!b.has_value()) return {};
  TORCH_CHECK(b->device().is_cpu() && b->numel() == n && (b->scalar_type() == at::kBFloat16 || b->scalar_type() == at::kFloat),
              what, ": expected a bf16 or fp32 CPU tensor of ", n, " elements, got ", b->scalar_type(), " ", b->sizes());
  at::Tensor f = b->to(at::kFloat).contiguous();
  return std::vector<float>(f.data_ptr<float>(), f.data_ptr<float>() + n);
}

at::Tensor tokens_of(const at::Tensor& x, int64_t k, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) && x.dim() >= 1
              && x.size(-1) == k && x.numel() / k <= MAX_N && x.numel() > 0,
              what, ": expected 1..", MAX_N, " bf16 or fp32 CPU tokens of ", k, " features, got ", x.scalar_type(), " ", x.sizes());
  return x.contiguous();
}

void run_rows(const Weight& W, const Tokens& t, const std::vector<float>& bias, at::Tensor& out) {
  const float* b = bias.empty() ? nullptr : bias.data();
  const int64_t g = grain(W.ld);
  if (out.scalar_type() == at::kFloat) {
    float* o = out.data_ptr<float>();
    at::parallel_for(0, W.rows, g, [&](int64_t s, int64_t e) { rows_range<float>(W, t, b, s, e, o, W.rows); });
  } else {
    uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr());
    at::parallel_for(0, W.rows, g, [&](int64_t s, int64_t e) { rows_range<uint16_t>(W, t, b, s, e, o, W.rows); });
  }
}

at::Tensor gemv_q(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale, const std::optional<at::Tensor>& bias, int64_t split) {
  Weight W = weight_of(w, w_scale, split, "gemv_q w");
  at::Tensor xc = tokens_of(x, W.k, "gemv_q x");
  Tokens t;
  prepare(xc, xc.numel() / W.k, W.k, W.fmt, t);
  std::vector<float> b = bias_of(bias, W.rows, "gemv_q bias");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = W.rows;
  at::Tensor out = at::empty(shape, x.options());
  run_rows(W, t, b, out);
  return out;
}

at::Tensor expert_mlp_q(const at::Tensor& x, const at::Tensor& up, const at::Tensor& up_s, const at::Tensor& dn, const at::Tensor& dn_s) {
  TORCH_CHECK(up.dim() == 2 && dn.dim() == 2, "expert_mlp_q: expected 2-D gate_up and down, got ", up.sizes(), " and ", dn.sizes());
  TORCH_CHECK(up.scalar_type() == dn.scalar_type() && up.scalar_type() != at::kByte, "expert_mlp_q: expected int8 or fp8 gate_up and down "
              "of one format, got ", up.scalar_type(), " and ", dn.scalar_type());
  const int64_t H = dn.size(0), I = dn.size(1);
  TORCH_CHECK(up.size(0) == 2 * I && up.size(1) == H, "expert_mlp_q: expected gate_up [2I, H] and down [H, I] with H=", H, " I=", I,
              ", got ", up.sizes(), " and ", dn.sizes());
  Weight U = weight_of(up, up_s, I, "gate_up"), D = weight_of(dn, dn_s, 0, "down");
  at::Tensor xc = tokens_of(x, H, "expert_mlp_q x");
  TORCH_CHECK(xc.numel() == H, "expert_mlp_q x: expected one token, got ", x.sizes());
  const bool bf = x.scalar_type() == at::kBFloat16;
  Tokens t;
  prepare(xc, 1, H, U.fmt, t);
  at::Tensor gu = at::empty({1, 2 * I}, x.options());
  run_rows(U, t, {}, gu);
  at::Tensor h = at::empty({1, I}, x.options());
  // silu(gate) * up, rounded where torch's ops on x's dtype round: after silu, after the product
  for (int64_t i = 0; i < I; ++i) {
    float g, u;
    if (bf) { g = bf2f(reinterpret_cast<uint16_t*>(gu.data_ptr())[i]); u = bf2f(reinterpret_cast<uint16_t*>(gu.data_ptr())[I + i]); }
    else { g = gu.data_ptr<float>()[i]; u = gu.data_ptr<float>()[I + i]; }
    float s = g / (1.0f + std::exp(-g));
    if (bf) reinterpret_cast<uint16_t*>(h.data_ptr())[i] = f2bf(bf2f(f2bf(s)) * u);
    else h.data_ptr<float>()[i] = s * u;
  }
  Tokens th;
  prepare(h, 1, I, D.fmt, th);
  at::Tensor out = at::empty(x.sizes(), x.options());
  run_rows(D, th, {}, out);
  return out;
}

// K experts of one token (int8 or fp8, silu gate on a concatenated gate|up, no biases) in two parallel passes, one
// over every expert's gate|up rows and one over every expert's down rows: row k is bit-identical to expert_mlp_q of
// expert k (the same prepared x, row dots, roundings and per-expert prepared h). out [K, H] in x's dtype.
at::Tensor experts_mlp_q(const at::Tensor& x, at::TensorList ups, at::TensorList up_s, at::TensorList dns, at::TensorList dn_s) {
  const int64_t K = (int64_t)ups.size();
  TORCH_CHECK(K >= 1 && up_s.size() == ups.size() && dns.size() == ups.size() && dn_s.size() == ups.size(),
              "experts_mlp_q: expected as many gate_ups, gate_up scales, downs and down scales (>= 1), got ", ups.size(), ", ",
              up_s.size(), ", ", dns.size(), ", ", dn_s.size());
  TORCH_CHECK(dns[0].dim() == 2, "experts_mlp_q: expected 2-D downs, got ", dns[0].sizes());
  const int64_t H = dns[0].size(0), I = dns[0].size(1), I2 = 2 * I;
  std::vector<Weight> U(K), D(K);
  for (int64_t k = 0; k < K; ++k) {
    TORCH_CHECK(ups[k].dim() == 2 && dns[k].dim() == 2 && ups[k].size(0) == I2 && ups[k].size(1) == H && dns[k].size(0) == H
                && dns[k].size(1) == I, "experts_mlp_q: expected gate_up [2I, H] and down [H, I] with H=", H, " I=", I, ", got ",
                ups[k].sizes(), " and ", dns[k].sizes());
    TORCH_CHECK(ups[k].scalar_type() == ups[0].scalar_type() && dns[k].scalar_type() == ups[0].scalar_type()
                && ups[0].scalar_type() != at::kByte, "experts_mlp_q: expected int8 or fp8 weights, all of one format");
    U[k] = weight_of(ups[k], up_s[k], I, "gate_up");
    D[k] = weight_of(dns[k], dn_s[k], 0, "down");
  }
  at::Tensor xc = tokens_of(x, H, "experts_mlp_q x");
  TORCH_CHECK(xc.numel() == H, "experts_mlp_q x: expected one token, got ", x.sizes());
  const bool bf = x.scalar_type() == at::kBFloat16;
  Tokens t;
  prepare(xc, 1, H, U[0].fmt, t);
  std::vector<float> gu(K * I2);  // fp32 results, rounded below exactly as rows_range's output dtype would be
  at::parallel_for(0, K * I2, grain(U[0].ld), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) gu[r] = row_dot(U[r / I2], r % I2, t, 0);
  });
  std::vector<Tokens> th(K);
  at::Tensor h = at::empty({1, I}, x.options());
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t i = 0; i < I; ++i) {
      float g = gu[k * I2 + i], u = gu[k * I2 + I + i];
      if (bf) { g = bf2f(f2bf(g)); u = bf2f(f2bf(u)); }
      float s = g / (1.0f + std::exp(-g));
      if (bf) reinterpret_cast<uint16_t*>(h.data_ptr())[i] = f2bf(bf2f(f2bf(s)) * u);
      else h.data_ptr<float>()[i] = s * u;
    }
    prepare(h, 1, I, D[k].fmt, th[k]);
  }
  at::Tensor out = at::empty({K, H}, x.options());
  at::parallel_for(0, K * H, grain(D[0].ld), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float v = row_dot(D[r / H], r % H, th[r / H], 0);
      if (bf) reinterpret_cast<uint16_t*>(out.data_ptr())[r] = f2bf(v); else out.data_ptr<float>()[r] = v;
    }
  });
  return out;
}

}  // namespace moe_quant

TORCH_LIBRARY_FRAGMENT(moe_offload, m) {
  m.def("gemv_q(Tensor x, Tensor w, Tensor w_scale, Tensor? bias=None, int split=0) -> Tensor");
  m.def("expert_mlp_q(Tensor x, Tensor gate_up, Tensor gate_up_scale, Tensor down, Tensor down_scale) -> Tensor");
  m.def("experts_mlp_q(Tensor x, Tensor[] gate_ups, Tensor[] gate_up_scales, Tensor[] downs, Tensor[] down_scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(moe_offload, CPU, m) {
  m.impl("gemv_q", &moe_quant::gemv_q);
  m.impl("expert_mlp_q", &moe_quant::expert_mlp_q);
  m.impl("experts_mlp_q", &moe_quant::experts_mlp_q);
}
"""

MAX_TOKENS = 16  # tokens one gemv_q call takes (the C++ MAX_N); more go through dequantize + GEMM


def register_fakes(register_fake) -> None:
    """Shape functions of the quantized ops (called by cpu_kernels after a build)."""

    def gemv(x, w, w_scale, bias=None, split=0):
        rows = w.shape[0]
        return x.new_empty((*x.shape[:-1], rows))

    def expert(x, gate_up, gate_up_scale, down, down_scale):
        return x.new_empty(x.shape)

    def experts(x, gate_ups, gate_up_scales, downs, down_scales):
        return x.new_empty((len(gate_ups), downs[0].shape[0]))

    for op, fn in (("gemv_q", gemv), ("expert_mlp_q", expert), ("experts_mlp_q", experts)):
        try:
            register_fake(f"moe_offload::{op}", fn)
        except RuntimeError:  # already registered in this process
            pass
