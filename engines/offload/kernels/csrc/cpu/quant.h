// Quantized weights, dequantized in registers: the prepared tokens, the stored weight of one projection and its row
// dot products per format and ISA (the only ISA #ifs besides vec.h). Used by moe_quant.cpp (gemv_q, the expert
// MLPs) and decode.cpp (int8 attention projections, --dense-dtype int8).
//
//   x [N, K] bf16|fp32 --prepare--> Tokens (once per call) --rows_dot(W, r, n, t, i)--> fp32 y[i, r .. r+n)
//
// Formats (what the host store and the slots hold, byte for byte):
//   int8   w int8 [R, K] + w_scale fp32 [R] (per output row, symmetric, |q| <= 127): w ~ q * s.
//          x is quantized per token in blocks of 32 (fp32 scale per block, like llama.cpp's q8_0 activations) and
//          the dot product runs in int8 x int8 -> int32: AVX-512 VNNI vpdpbusd (x as |x|, w with the sign of x),
//          AVX2 vpmaddubsw; y = s_w * sum_b s_x[b] * sum_{j in b} qx_j * qw_j. Error: weight and activation rounding.
//   fp8    w float8_e4m3fn [R, K] + scale fp32 [RB, ceil(K/128)] (DeepSeek-V3 weight_scale_inv, 128x128 blocks).
//          Row r reads scale row r/128; with split S < R (a concatenated gate|up whose halves were quantized apart)
//          rows r >= S read ceil(S/128) + (r-S)/128. e4m3 -> fp16 bits by shifts -> fp32 (F16C), times the block
//          scale: the same fp32 weight q.float() * s a dequantizing reference builds, then fp32 FMA with x.
//   mxfp4  blocks uint8 [R, K/2] (two e2m1 values per byte, low nibble first) + scales uint8 [R, K/32] (E8M0:
//          2^(s-127) per block of 32), the gpt-oss *_blocks / *_scales. A 16-entry table (vpermps) times the block's
//          power of two gives the exact weight; x is split into even/odd elements once per call.
//   ggml   bits8 [R, nb, S]: llama.cpp's block types (q8_0, q4_0, q4_1, q5_0, q5_1, mxfp4, q4_k, q5_k, q6_k, iq4_xs;
//          blocks.h) and the engine's q4_z and nvfp4, the type from the block's S bytes; no separate scale but an
//          nvfp4 release's fp32 scale per row (its per-tensor scale, gate and up rows each their own). x is quantized as for int8 (llama.cpp's
//          vec_dot pairs these types with 8-bit activations too; per 256 values for the k-quants and iq4_xs), plus the
//          sum of each 16 values (the mins of q4_1 / q5_1 and the k-quants, and q6_k's offset, read them).
// Legend: N tokens, K input features, R output rows, RB row blocks.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "blocks.h"
#include "vec.h"

namespace moe_quant {

using moe_cpu::bf2f;
using moe_cpu::f2bf;

constexpr int64_t QB = 32;    // int8 activation block
constexpr int64_t FB = 128;   // fp8 weight block (both dimensions)
constexpr int64_t MB = 32;    // mxfp4 block
constexpr int64_t MAX_N = 16; // tokens per call (decode batches); ops.MAX_TOKENS in Python
#ifndef PF_DIST
#define PF_DIST 4096          // int8 rows: software prefetch this many bytes ahead (the dots are too slow for the
#endif                        // hardware prefetcher alone to keep DRAM busy: 31.5 -> 38.2 GB/s from DRAM on 8 int8 experts)

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
// inline variables: one table for every file that includes this header
inline const Tables TABLES;
inline float fp8_to_float(uint8_t b) { return TABLES.fp8[b]; }
inline float e8m0(uint8_t s) { return TABLES.e8m0[s]; }
inline const float FP4[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

// ---- x, prepared once per call and shared by every row ----------------------------------------------------------
struct Tokens {
  int64_t n = 0, k = 0, kp = 0;  // tokens, features, features padded to 64
  int64_t qb = QB;               // int8 x: values per scale (256 for the ggml k-quants)
  std::vector<float> f;          // [n, kp] fp32 copy, zero padded (fp8)
  std::vector<float> even, odd;  // [n, kp/2] deinterleaved x (mxfp4: low nibble = even element)
  std::vector<int8_t> q;         // [n, kp] int8 x (int8 weights)
  std::vector<uint8_t> qabs;     // [n, kp] |q|
  std::vector<uint64_t> qneg;    // [n, kp/64] sign bits of q (AVX-512 masks)
  std::vector<float> qs;         // [n, kp/qb] per-block scales
  std::vector<float> qs16;       // [n, kp/64, 16] scales as lanes of a vpdpbusd result (lanes 0-7 block 2b, 8-15 block 2b+1)
  std::vector<int16_t> bs16;     // [n, kp/16] sum of q per 16 values (ggml blocks; |sum| <= 16 * 127)
};

// x as the format's dots read it (fmt 'q' int8, 'f' fp8, 'm' mxfp4, 'g' ggml blocks; qb: int8 x's block); moe_quant.cpp
void prepare(const at::Tensor& x, int64_t n, int64_t k, char fmt, Tokens& t, int64_t qb = QB);
// the same in two steps: the arrays for n tokens, then token i from its k fp32 values (rows may be filled in parallel)
void prepare_init(int64_t n, int64_t k, char fmt, Tokens& t, int64_t qb);
void prepare_row(const float* v, int64_t i, char fmt, Tokens& t);

// ---- one row . one token, per format and ISA ----------------------------------------------------------------------
#if defined(MOE_AVX2) && !defined(MOE_AVX512BF16)
// int8 (AVX2): NR (1..4) rows ld bytes apart . token i, each without its weight scale: x's |q|, its sign and the
// block scales loaded once for the rows, each row's sum in its own accumulators (in 64s, then a 32, then the tail
// block as a plain integer sum), one hsum tree that adds each row's lanes as hsum8 does, and the same column of the
// next group of NR rows prefetched. rows_dot calls it one row at a time (NR = 1: the row two ahead prefetched), a
// single sequential stream, which DRAM serves faster than rows in lockstep (a token's 8 int8 experts 1.31x,
// bench/bench_kernels.py --ggml on a 2-core AVX2 host); dot_q8 is the same one-row case.
template <int NR>
__attribute__((always_inline)) inline void dot_q8_rows(const int8_t* w, int64_t ld, const Tokens& t, int64_t i, float* out) {
  const int64_t k = t.k;
  const int8_t* xq = t.q.data() + i * t.kp;
  const float* qs = t.qs.data() + i * (t.kp / QB);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 a0[NR], a1[NR];
  for (int r = 0; r < NR; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 64 <= k; j += 64) {
    const __m256i x0 = _mm256_loadu_si256((const __m256i*)(xq + j)), x1 = _mm256_loadu_si256((const __m256i*)(xq + j + 32));
    const __m256i ax0 = _mm256_sign_epi8(x0, x0), ax1 = _mm256_sign_epi8(x1, x1);
    const __m256 s0 = _mm256_set1_ps(qs[j / QB]), s1 = _mm256_set1_ps(qs[j / QB + 1]);
    for (int r = 0; r < NR; ++r) {
      const int8_t* wr = w + r * ld + j;
      _mm_prefetch(reinterpret_cast<const char*>(wr + 2 * NR * ld), _MM_HINT_T0);
      const __m256i w0 = _mm256_loadu_si256((const __m256i*)wr), w1 = _mm256_loadu_si256((const __m256i*)(wr + 32));
      const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(ax0, _mm256_sign_epi8(w0, x0)), ones);
      const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(ax1, _mm256_sign_epi8(w1, x1)), ones);
      a0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), s0, a0[r]);
      a1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), s1, a1[r]);
    }
  }
  for (; j + 32 <= k; j += 32) {
    const __m256i x0 = _mm256_loadu_si256((const __m256i*)(xq + j)), ax0 = _mm256_sign_epi8(x0, x0);
    const __m256 s0 = _mm256_set1_ps(qs[j / QB]);
    for (int r = 0; r < NR; ++r) {
      const __m256i w0 = _mm256_loadu_si256((const __m256i*)(w + r * ld + j));
      a0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(ax0, _mm256_sign_epi8(w0, x0)), ones)),
                              s0, a0[r]);
    }
  }
  for (int r = 0; r < NR; ++r) a0[r] = _mm256_add_ps(a0[r], a1[r]);
  moe_blocks::hsum_rows<NR>(a0, out);
  if (j < k)  // tail block: plain integer sum
    for (int r = 0; r < NR; ++r) {
      int32_t acc = 0;
      for (int64_t l = j; l < k; ++l) acc += int32_t(xq[l]) * int32_t(w[r * ld + l]);
      out[r] += float(acc) * qs[j / QB];
    }
}
#endif

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
  float v;
  dot_q8_rows<1>(w, 0, t, i, &v);
  return v;
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
  char fmt;             // 'q' int8, 'f' fp8, 'm' mxfp4, 'g' ggml blocks
  const uint8_t* w;     // row r starts at w + r * ld (bytes)
  int64_t ld, rows, k;  // k: input features (mxfp4: 2 per byte)
  const float* s;       // int8: [R]; fp8: [RB, CB] row-major
  int64_t s_ld;         // fp8: CB; mxfp4: scale-row stride in bytes
  const uint8_t* ms;    // mxfp4 scales
  int64_t split;        // fp8 gate|up split (R when none)
  moe_blocks::Layout gl;  // ggml: the block type (nb = k / gl.block blocks per row)
  const int32_t* perm = nullptr;  // ggml, act-order 4-bit releases: input j of every row is x[perm[j]] (else x[j])
  const float* rs = nullptr;      // ggml, NVFP4 releases: row r's result times rs[r] (the per-tensor fp32 scale)
};

// rows r .. r+n-1 (n <= ROWS) . prepared token i -> out[0..n): ggml blocks and (AVX2) int8 n rows per call (x loaded
// once for them, each row's sum as alone), the other formats row by row
constexpr int ROWS = 4;
__attribute__((always_inline)) inline void rows_dot(const Weight& W, int64_t r, int n, const Tokens& t, int64_t i, float* out) {
  const uint8_t* row = W.w + r * W.ld;
  if (W.fmt == 'g') {
    moe_blocks::dot_rows(W.gl, row, W.ld, W.k / W.gl.block, t.q.data() + i * t.kp, t.qs.data() + i * (t.kp / t.qb),
                         t.bs16.data() + i * (t.kp / 16), n, out);
    if (W.rs)
      for (int m = 0; m < n; ++m) out[m] *= W.rs[r + m];
    return;
  }
#if defined(MOE_AVX2) && !defined(MOE_AVX512BF16)
  if (W.fmt == 'q') {
    const int8_t* q = reinterpret_cast<const int8_t*>(row);
    for (int m = 0; m < n; ++m) dot_q8_rows<1>(q + m * W.ld, W.ld, t, i, out + m);
    for (int m = 0; m < n; ++m) out[m] *= W.s[r + m];
    return;
  }
#endif
  for (int m = 0; m < n; ++m, ++r, row += W.ld) {
    if (W.fmt == 'q') out[m] = W.s[r] * dot_q8(reinterpret_cast<const int8_t*>(row), t, i);
    else if (W.fmt == 'f') {
      int64_t rb = r < W.split ? r / FB : (W.split + FB - 1) / FB + (r - W.split) / FB;
      out[m] = dot_fp8(row, W.s + rb * W.s_ld, t, i);
    } else out[m] = dot_mxfp4(row, W.ms + r * W.s_ld, t, i);
  }
}

// rows [begin, end) . the tokens xi[0..np) of t, in groups of ROWS rows, each group read from memory once for all the
// tokens: emit(p, r, value) for every (token p, row r)
template <typename Emit>
inline void rows_tokens(const Weight& W, int64_t begin, int64_t end, const Tokens& t, const int64_t* xi, int64_t np, Emit emit) {
  float v[ROWS];
  if (W.fmt == 'g' && np > 1) {  // ggml blocks, several tokens: a row's blocks decoded once for up to 4 of them
    const int8_t* xq[4];
    const float* xs[4];
    const int16_t* bs[4];
    for (int64_t r = begin; r < end; ++r)
      for (int64_t p = 0; p < np; p += 4) {
        const int n = int(std::min<int64_t>(4, np - p));
        for (int m = 0; m < n; ++m) {
          const int64_t i = xi ? xi[p + m] : p + m;
          xq[m] = t.q.data() + i * t.kp; xs[m] = t.qs.data() + i * (t.kp / t.qb); bs[m] = t.bs16.data() + i * (t.kp / 16);
        }
        moe_blocks::dot_tokens(W.gl, W.w + r * W.ld, W.k / W.gl.block, xq, xs, bs, n, v);
        for (int m = 0; m < n; ++m) emit(p + m, r, W.rs ? v[m] * W.rs[r] : v[m]);
      }
    return;
  }
  for (int64_t r = begin; r < end; r += ROWS) {
    const int n = int(std::min<int64_t>(ROWS, end - r));
    for (int64_t p = 0; p < np; ++p) {
      rows_dot(W, r, n, t, xi ? xi[p] : p, v);
      for (int m = 0; m < n; ++m) emit(p, r + m, v[m]);
    }
  }
}

inline int64_t grain(int64_t row_bytes) { return std::max<int64_t>(4, (int64_t(1) << 16) / std::max<int64_t>(1, row_bytes)); }

// the stored weight w and its scales s, checked; moe_quant.cpp
Weight weight_of(const at::Tensor& w, const at::Tensor& s, int64_t split, const char* what);

// token i of x [n, k] (bf16 or fp32) in fp32 into row, gathered as W reads it (row[j] = x[i, perm[j]] for an
// act-order weight); false if a permutation entry is out of range (row then undefined); moe_quant.cpp
bool gather_row(const at::Tensor& x, int64_t i, int64_t k, const int32_t* perm, float* row);

// x prepared for the dots of weight W (the k-quants read x in blocks of 256; an act-order weight's permutation applied)
void prepare(const at::Tensor& x, int64_t n, int64_t k, const Weight& W, Tokens& t);

}  // namespace moe_quant
