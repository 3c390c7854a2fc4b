// GGML block formats: llama.cpp's quant types byte for byte as a GGUF file stores them, decoded in registers.
// Used by quant.h (one row . one prepared token) and moe_quant.cpp (dequant_blocks, the prefill/fp32 path).
//
//   w bits8 [R, nb, S] (nb blocks of S bytes per row, each block B weights) --dot(row, int8 x)--> fp32
//
// The type follows from S (unique among these): ggml type id, B weights, S bytes, value of weight e
//   q8_0   8   32   34  fp16 d, int8 q[32]                          d * q
//   q4_0   2   32   18  fp16 d, q[16] nibbles (e<16 low, else high)  d * (q - 8)              (--expert-dtype int4)
//   q4_1   3   32   20  fp16 d, fp16 m, q[16] nibbles as q4_0        d * q + m
//   q5_0   6   32   22  fp16 d, qh[4] (bit e: q's fifth bit), q[16] as q4_0   d * (q - 16)
//   q5_1   7   32   24  fp16 d, fp16 m, qh[4], q[16] as q5_0         d * q + m
//                       (llama-quantize writes q5_0 / q5_1 for q4_k / q5_k tensors whose rows are not whole 256s)
//   q4_z 200   32   19  fp16 d, uint8 z, q[16] nibbles as q4_0       d * (q - z)   (not a GGUF type: this engine's
//                       block for 4-bit releases with a zero point per group, AWQ; the weights exact in fp32)
//   mxfp4 39   32   17  E8M0 e, q[16] nibbles as q4_0               2^(e-128) * {0,1,2,3,4,6,8,12,0,-1,..,-12}[q]
//   nvfp4 201  64   36  e4m3 s[4] (one per 16), q[32]: two halves of 16 bytes, nibbles as q4_0 within each 32
//                       e4m3(s[e/16]) / 2 * {0,1,2,..,12,..}[q] (not a GGUF type: this engine's block for ModelOpt NVFP4
//                       releases, their bytes regrouped per 64; the per-tensor fp32 scale is a row scale beside it)
//   q4_k  12  256  144  fp16 d, dmin, 12 B 6-bit scales/mins, qs[128]   d*sc[j] * q - dmin*m[j], j = e / 32
//   q5_k  13  256  176  as q4_k + qh[32] (fifth bit)                    same, q in 0..31
//   q6_k  14  256  210  ql[128], qh[64], int8 sc[16], fp16 d            d*sc[e/16] * (q - 32)
//   q2_k  10  256   84  sc[16] (scale nibble | min nibble << 4), qs[64], fp16 d, dmin   d*sc[s] * q - dmin*m[s],
//                       s = e / 16, q = bits 2j, 2j+1 of qs[32n + l] for e = 128n + 32j + l (2 bits)
//   q3_k  11  256  110  hmask[32], qs[64] (as q2_k), 12 B of 6-bit scales, fp16 d   d*(sc[s] - 32) * (q - 4 * !h),
//                       h = bit 4n + j of hmask[l]; sc[s] = nibble s of bytes 0..7 (s < 8 low, else high of s - 8) |
//                       bits 2 (s / 4), +1 of byte 8 + s % 4 << 4
//   iq4_xs 23 256  136  fp16 d, u16 sh, sl[4], qs[128] (per 32 as q4_0)  d*(s[j] - 32) * KV_IQ4[q], j = e / 32,
//                       s[j] = nibble j%2 of sl[j/2] | bits 2j, 2j+1 of sh << 4 (the non-linear table of IQ4_NL)
// (ggml-quants.c's dequantize_row_*; the gguf package's quants.py is the reference the tests compare with; for q4_z,
// loading/ggml.py's reference_dequantize.)
//
// Activations are quantized to 8 bits where llama.cpp's vec_dot quantizes them for these types (its q8_0 / q8_K; here
// amax / 127 and round half to even, as the int8 experts do): 8-bit with an fp32 scale per block of 32
// (q8_0, q4_0, q4_1, q5_0, q5_1, q4_z, mxfp4) or per 256 (the k-quants and iq4_xs, so a super-block's scales apply in
// integers: Layout::act; quant.h's Tokens), y = sum over blocks of s_w * s_x * sum(q_w * q_x) - min terms, integer
// inner sums. The min terms read the sums of x per 16 (bs16): q4_1 / q5_1's m * s_x * (sum of x's 32), as llama.cpp's
// q8_1 activations carry it.
// decode() gives the exact fp32 weights (value = scale * v - min in two roundings, as the reference computes them).
#pragma once

#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec.h"

namespace moe_blocks {

enum Type : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
                  IQ4_XS = 23, MXFP4 = 39, Q4_Z = 200, NVFP4 = 201 };

struct Layout {
  int type = 0;
  int64_t block = 0, bytes = 0;  // weights and bytes per block
  int64_t act = 32;              // x's quantization block: 32, or 256 for the k-quants and iq4_xs (llama.cpp's q8_K)
};

// The layout stored in blocks of ``bytes``; false for a size no supported type has.
inline bool layout_of(int64_t bytes, Layout& L) {
  switch (bytes) {
    case 34: L = {Q8_0, 32, 34}; return true;
    case 18: L = {Q4_0, 32, 18}; return true;
    case 19: L = {Q4_Z, 32, 19}; return true;
    case 17: L = {MXFP4, 32, 17}; return true;
    case 20: L = {Q4_1, 32, 20}; return true;
    case 22: L = {Q5_0, 32, 22}; return true;
    case 24: L = {Q5_1, 32, 24}; return true;
    case 144: L = {Q4_K, 256, 144, 256}; return true;
    case 176: L = {Q5_K, 256, 176, 256}; return true;
    case 210: L = {Q6_K, 256, 210, 256}; return true;
    case 136: L = {IQ4_XS, 256, 136, 256}; return true;
    case 84: L = {Q2_K, 256, 84, 256}; return true;
    case 110: L = {Q3_K, 256, 110, 256}; return true;
    case 36: L = {NVFP4, 64, 36}; return true;
    default: return false;
  }
}

inline float h2f(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}
// ggml_e8m0_to_fp32_half: 2^(e-128), subnormal for e < 2
inline float e8m0_half(uint8_t e) {
  uint32_t bits = e < 2 ? (0x00200000u << e) : (uint32_t(e - 1) << 23);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
// nvfp4's block scales: a float8 e4m3fn byte -> its value / 2 (KV_MXFP4 holds twice the e2m1 values), from a table
struct E4m3Half {
  float v[256];
  E4m3Half() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 0xF, m = b & 7;
      const float f = e ? std::ldexp(1.0f + m / 8.0f, e - 8) : std::ldexp(m / 8.0f, -7);
      v[b] = (b & 0x80) ? -f : f;
    }
  }
};
inline const E4m3Half E4M3_HALF;
inline float e4m3_half(uint8_t b) { return E4M3_HALF.v[b]; }
alignas(16) inline const int8_t KV_MXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
alignas(16) inline const int8_t KV_IQ4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// iq4_xs: sub-block j's scale s[j] - 32 (-32..31)
inline int iq4_scale(const uint8_t* b, int j) {
  return (((b[4 + j / 2] >> (4 * (j % 2))) & 0xF) | ((((b[2] | (b[3] << 8)) >> (2 * j)) & 3) << 4)) - 32;
}

// q4_k / q5_k: the 6-bit scales and mins of the 8 sub-blocks from the 12 packed bytes, by whole-word masks (sub-block
// j < 4: low 6 bits of bytes j and j + 4; j >= 4: a nibble of byte j + 4 and the top 2 bits of bytes j - 4 and j):
// out[0..7] sc, out[8..15] m
inline void unpack_k4(const uint8_t* q, uint8_t* out) {
  uint32_t u[3];
  std::memcpy(u, q, 12);
  const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, top2 = 0x03030303;
  const uint32_t r[4] = {u[0] & low6,                                       // sc 0..3: bytes 0..3, low 6 bits
                         (u[2] & low4) | (((u[0] >> 6) & top2) << 4),       // sc 4..7: low nibble of 8..11 | top of 0..3
                         u[1] & low6,                                       // m 0..3: bytes 4..7, low 6 bits
                         ((u[2] >> 4) & low4) | (((u[1] >> 6) & top2) << 4)};  // m 4..7: high nibble of 8..11 | top of 4..7
  std::memcpy(out, r, 16);
}

// q3_k: the 16 signed 6-bit scales (sc - 32) from the 12 packed bytes, by whole-word masks (scales 4w .. 4w + 3: the
// low or high nibbles of bytes 0..3 or 4..7, and bits 2w, 2w + 1 of bytes 8..11 as the top two)
inline void unpack_q3(const uint8_t* p, int8_t* out) {
  uint32_t u[3];
  std::memcpy(u, p, 12);
  const uint32_t low4 = 0x0f0f0f0f, top2 = 0x03030303;
  const uint32_t r[4] = {(u[0] & low4) | ((u[2] & top2) << 4), (u[1] & low4) | (((u[2] >> 2) & top2) << 4),
                         ((u[0] >> 4) & low4) | (((u[2] >> 4) & top2) << 4),
                         ((u[1] >> 4) & low4) | (((u[2] >> 6) & top2) << 4)};
  uint8_t b[16];
  std::memcpy(b, r, 16);
  for (int s = 0; s < 16; ++s) out[s] = int8_t(b[s] - 32);  // 0..63 -> -32..31
}
// q2_k / q3_k: the 2 low bits of value e = 128n + 32j + l (bits 2j, 2j+1 of qs[32n + l])
inline int k2_bits(const uint8_t* qs, int e) { return (qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3; }

// One block -> int8 values v[B] and per-16 (scale, min): weight e = sc16[e/16] * v[e] - mn16[e/16].
inline void decode(int type, const uint8_t* b, int8_t* v, float* sc16, float* mn16) {
  switch (type) {
    case Q8_0: {
      const float d = h2f(b);
      std::memcpy(v, b + 2, 32);
      sc16[0] = sc16[1] = d; mn16[0] = mn16[1] = 0.0f;
      return;
    }
    case Q4_0:
    case Q4_Z:
    case MXFP4: {
      const uint8_t* q = b + (type == Q4_0 ? 2 : type == Q4_Z ? 3 : 1);
      const int z = type == Q4_Z ? b[2] : 8;
      for (int l = 0; l < 16; ++l) {
        if (type != MXFP4) { v[l] = int8_t((q[l] & 0xF) - z); v[l + 16] = int8_t((q[l] >> 4) - z); }
        else { v[l] = KV_MXFP4[q[l] & 0xF]; v[l + 16] = KV_MXFP4[q[l] >> 4]; }
      }
      sc16[0] = sc16[1] = type == MXFP4 ? e8m0_half(b[0]) : h2f(b);
      mn16[0] = mn16[1] = 0.0f;
      return;
    }
    case Q4_1:
    case Q5_0:
    case Q5_1: {  // nibbles as q4_0, the fifth bit of value e from bit e of qh (none for q4_1); min -m (value d*q + m)
      const uint8_t* q = b + (type == Q4_1 ? 4 : type == Q5_0 ? 6 : 8);
      uint32_t qh = 0;
      if (type != Q4_1) std::memcpy(&qh, b + (type == Q5_0 ? 2 : 4), 4);
      const int z = type == Q5_0 ? 16 : 0;
      for (int l = 0; l < 16; ++l) {
        v[l] = int8_t(((q[l] & 0xF) | (((qh >> l) & 1) << 4)) - z);
        v[l + 16] = int8_t(((q[l] >> 4) | (((qh >> (l + 16)) & 1) << 4)) - z);
      }
      sc16[0] = sc16[1] = h2f(b);
      mn16[0] = mn16[1] = type == Q5_0 ? 0.0f : -h2f(b + 2);
      return;
    }
    case NVFP4: {
      for (int h = 0; h < 2; ++h) {
        const uint8_t* q = b + 4 + 16 * h;
        for (int l = 0; l < 16; ++l) { v[32 * h + l] = KV_MXFP4[q[l] & 0xF]; v[32 * h + l + 16] = KV_MXFP4[q[l] >> 4]; }
      }
      for (int j = 0; j < 4; ++j) { sc16[j] = e4m3_half(b[j]); mn16[j] = 0.0f; }
      return;
    }
    case IQ4_XS: {
      const float d = h2f(b);
      for (int j = 0; j < 8; ++j) {
        sc16[2 * j] = sc16[2 * j + 1] = d * float(iq4_scale(b, j));
        mn16[2 * j] = mn16[2 * j + 1] = 0.0f;
        const uint8_t* q = b + 8 + 16 * j;
        for (int l = 0; l < 16; ++l) { v[32 * j + l] = KV_IQ4[q[l] & 0xF]; v[32 * j + l + 16] = KV_IQ4[q[l] >> 4]; }
      }
      return;
    }
    case Q4_K:
    case Q5_K: {
      const float d = h2f(b), dmin = h2f(b + 2);
      const uint8_t* scales = b + 4;
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (type == Q4_K ? 16 : 48);
      uint8_t sm[16];
      unpack_k4(scales, sm);
      for (int c = 0; c < 4; ++c) {
        for (int half = 0; half < 2; ++half) {
          const int j = 2 * c + half;
          sc16[2 * j] = sc16[2 * j + 1] = d * float(sm[j]);
          mn16[2 * j] = mn16[2 * j + 1] = dmin * float(sm[8 + j]);
          for (int l = 0; l < 32; ++l) {
            int q = half ? qs[32 * c + l] >> 4 : qs[32 * c + l] & 0xF;
            if (type == Q5_K) q |= ((qh[l] >> j) & 1) << 4;
            v[64 * c + 32 * half + l] = int8_t(q);
          }
        }
      }
      return;
    }
    case Q2_K: {
      const float d = h2f(b + 80), dmin = h2f(b + 82);
      for (int e = 0; e < 256; ++e) v[e] = int8_t(k2_bits(b + 16, e));
      for (int s = 0; s < 16; ++s) { sc16[s] = d * float(b[s] & 0xF); mn16[s] = dmin * float(b[s] >> 4); }
      return;
    }
    case Q3_K: {
      const float d = h2f(b + 108);
      int8_t sc[16];
      unpack_q3(b + 96, sc);
      for (int e = 0; e < 256; ++e) v[e] = int8_t(k2_bits(b + 32, e) - (((b[e % 32] >> (e / 32)) & 1) ? 0 : 4));
      for (int s = 0; s < 16; ++s) { sc16[s] = d * float(sc[s]); mn16[s] = 0.0f; }
      return;
    }
    case Q6_K: {
      const float d = h2f(b + 208);
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      for (int n = 0; n < 2; ++n) {
        const uint8_t* ql = b + 64 * n;
        const uint8_t* qh = b + 128 + 32 * n;
        int8_t* y = v + 128 * n;
        for (int l = 0; l < 32; ++l) {
          y[l] = int8_t(((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32);
          y[l + 32] = int8_t(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
          y[l + 64] = int8_t(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
          y[l + 96] = int8_t(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
        }
      }
      for (int j = 0; j < 16; ++j) { sc16[j] = d * float(sc[j]); mn16[j] = 0.0f; }
      return;
    }
  }
}

// The exact fp32 weights of one block: scale * v, minus min as a second rounding (no FMA contraction: the reference
// rounds the product first; q4_1 / q5_1's + m is the same as - (-m), bit for bit).
__attribute__((optimize("fp-contract=off"))) inline void dequant_block(int type, int64_t B, const uint8_t* b, float* y) {
  int8_t v[256];
  float sc16[16], mn16[16];
  decode(type, b, v, sc16, mn16);
  for (int64_t e = 0; e < B; ++e) {
    volatile float p = sc16[e / 16] * float(v[e]);  // volatile: rounded before the subtraction on every compiler
    y[e] = p - mn16[e / 16];
  }
}

// ---- rows (nb blocks each) . one token's int8 activations --------------------------------------------------------
#if defined(MOE_AVX512BF16) || defined(MOE_AVX2)
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}
// sum over 4-byte groups of (signed w) * (signed x): 8 int32 lanes, lane i covering bytes 4i..4i+3. |w| is maddubs'
// unsigned operand and x takes w's sign: exact for every code w in -128..127 (x is within +-127; pairs stay in int16)
inline __m256i dot_s8(__m256i w, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), _mm256_set1_epi16(1));
}
// same with w unsigned (0..63)
inline __m256i dot_u8(__m256i w, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}
inline __m256i nibbles32(const uint8_t* q) {  // 16 bytes -> 32 values: low nibbles, then high nibbles
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)), m4 = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
}
inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
// 4 bytes -> 32 bytes: byte e 0xFF where bit e is set, else 0 (q5_0 / q5_1's fifth bits): byte e/8 spread to 8 bytes,
// each ORed with every bit but its own
inline __m256i bits32(const uint8_t* p) {
  uint32_t u;
  std::memcpy(&u, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(int(u)), _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                                                           0x0101010101010101, 0));
  return _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi64x(-1));
}
#endif

#if defined(MOE_AVX512BF16) || defined(MOE_AVX2)
// NR rows' 8-lane sums -> out[0..NR): for 4 rows one hadd tree, which adds each row's lanes in hsum8's order
// ((v0+v4) + (v1+v5)) + ((v2+v6) + (v3+v7)), so a row's result does not depend on how many rows share the call
template <int NR>
__attribute__((always_inline)) inline void hsum_rows(const __m256* v, float* out) {
  if constexpr (NR == 4) {
    __m128 s[4];
    for (int r = 0; r < 4; ++r) s[r] = _mm_add_ps(_mm256_castps256_ps128(v[r]), _mm256_extractf128_ps(v[r], 1));
    _mm_storeu_ps(out, _mm_hadd_ps(_mm_hadd_ps(s[0], s[1]), _mm_hadd_ps(s[2], s[3])));
  } else {
    for (int r = 0; r < NR; ++r) out[r] = hsum8(v[r]);
  }
}

// ---- one block's values in registers, shared by the row and token dots below ----
// q8_0 / q4_0 / q4_z / q5_0 / mxfp4: the 32 signed values and the block's scale
template <int T>
__attribute__((always_inline)) inline __m256i small_block(const uint8_t* b, float& d) {
  if constexpr (T == Q8_0) { d = h2f(b); return load32(b + 2); }
  else if constexpr (T == Q4_0) { d = h2f(b); return _mm256_sub_epi8(nibbles32(b + 2), _mm256_set1_epi8(8)); }
  else if constexpr (T == Q4_Z) { d = h2f(b); return _mm256_sub_epi8(nibbles32(b + 3), _mm256_set1_epi8(char(b[2]))); }
  else if constexpr (T == Q5_0) {  // q - 16: the nibble where the fifth bit is set, else the nibble | 0xF0 (nibble - 16)
    d = h2f(b);
    return _mm256_or_si256(nibbles32(b + 6), _mm256_andnot_si256(bits32(b + 2), _mm256_set1_epi8(char(0xF0))));
  }
  else {
    d = e8m0_half(b[0]);
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(KV_MXFP4)));
    return _mm256_shuffle_epi8(lut, nibbles32(b + 1));
  }
}
// nvfp4 half h of a block (values 32h ..): the 32 signed values (2 x e2m1) and x's scale times the half's two block
// scales, lanes 0-3 (values 0-15 in dot_s8's lanes) and 4-7 (16-31)
__attribute__((always_inline)) inline __m256i nv_half(const uint8_t* b, int h, float xs, __m256& s) {
  const float s0 = e4m3_half(b[2 * h]) * xs, s1 = e4m3_half(b[2 * h + 1]) * xs;
  s = _mm256_setr_ps(s0, s0, s0, s0, s1, s1, s1, s1);
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(KV_MXFP4)));
  return _mm256_shuffle_epi8(lut, nibbles32(b + 4 + 16 * h));
}
// q4_1 / q5_1: the 32 unsigned values (0..15, 0..31), the scale d and the min m
template <int T>
__attribute__((always_inline)) inline __m256i min_block(const uint8_t* b, float& d, float& m) {
  d = h2f(b);
  m = h2f(b + 2);
  if constexpr (T == Q4_1) return nibbles32(b + 4);
  else return _mm256_or_si256(nibbles32(b + 8), _mm256_and_si256(bits32(b + 4), _mm256_set1_epi8(0x10)));
}
// iq4_xs sub-block j: the 32 table values (int8, -127..113)
__attribute__((always_inline)) inline __m256i iq4_values(const uint8_t* b, int j) {
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(KV_IQ4)));
  return _mm256_shuffle_epi8(lut, nibbles32(b + 8 + 16 * j));
}
// q4_k / q5_k chunk c (64 values: lo = sub-block 2c, hi = 2c+1, unsigned 0..15 or 0..31) and their scales as madd's
// int16 operand; hb: q5_k's 32 bytes of fifth bits
template <int T>
__attribute__((always_inline)) inline void k4_chunk(const uint8_t* qs, __m256i hb, __m256i sc16, int c, __m256i& lo, __m256i& hi,
                                                    __m256i& s_lo, __m256i& s_hi) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i v = load32(qs + 32 * c);
  lo = _mm256_and_si256(v, m4);
  hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
  if constexpr (T == Q5_K) {
    const __m256i one = _mm256_set1_epi8(1);
    lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(2 * c)), one), 4));
    hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(2 * c + 1)), one), 4));
  }
  s_lo = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16(short(0x0100 * (4 * c + 1) + 4 * c)));
  s_hi = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16(short(0x0100 * (4 * c + 3) + 4 * c + 2)));
}
// q4_k / q5_k: the 8 scales as int16 in both lanes (sc16) and the 8 mins, each twice (m16: one per 16 values)
__attribute__((always_inline)) inline void k4_scales(const uint8_t* b, __m256i& sc16, __m256i& m16) {
  alignas(16) uint8_t sm[16];  // sc[0..7], m[0..7]
  unpack_k4(b + 4, sm);
  const __m128i smv = _mm_load_si128(reinterpret_cast<const __m128i*>(sm));
  const __m128i dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(smv));
  m16 = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(_mm_srli_si128(smv, 8), dup));
}
// q6_k half n (128 values) as four vectors of unsigned 0..63, and the scale operand of its group k
__attribute__((always_inline)) inline void q6k_half(const uint8_t* b, int n, __m256i* q) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
  const __m256i l0 = load32(b + 64 * n), l1 = load32(b + 64 * n + 32), h = load32(b + 128 + 32 * n);
  q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(h, m3), 4));
  q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m3), 4));
  q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m3), 4));
  q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m3), 4));
}
// this half's 8 scales in both lanes; group k takes scale 2k in the low lane, 2k+1 in the high lane
__attribute__((always_inline)) inline __m256i q6k_scale(__m256i sc16, int n, int k) {
  const __m256i half = _mm256_broadcastsi128_si256(n ? _mm256_extracti128_si256(sc16, 1) : _mm256_castsi256_si128(sc16));
  const __m256i pick = _mm256_set_m128i(_mm_set1_epi16(short(0x0100 * (4 * k + 3) + 4 * k + 2)),
                                        _mm_set1_epi16(short(0x0100 * (4 * k + 1) + 4 * k)));
  return _mm256_shuffle_epi8(half, pick);
}

// q2_k / q3_k half n, group j (32 values 128n + 32j ..: sub-blocks 8n + 2j in the low lane, + 1 in the high lane) as
// unsigned bytes: the 2 low bits from qs (32 bytes of half n), and for q3_k bit 4n + j of hmask (hm) as the third
// (value + 4, 0..7)
template <int T>
__attribute__((always_inline)) inline __m256i k2_group(__m256i qs, __m256i hm, int n, int j) {
  const __m256i v = _mm256_and_si256(_mm256_srl_epi16(qs, _mm_cvtsi32_si128(2 * j)), _mm256_set1_epi8(3));
  if constexpr (T == Q2_K) return v;
  const __m256i h = _mm256_and_si256(_mm256_srl_epi16(hm, _mm_cvtsi32_si128(4 * n + j)), _mm256_set1_epi8(1));
  return _mm256_or_si256(v, _mm256_slli_epi16(h, 2));
}
// their 16 scales as int16 (q2_k: the low nibbles; q3_k: sc - 32) and q2_k's 16 mins
template <int T>
__attribute__((always_inline)) inline void k2_scales(const uint8_t* b, __m256i& sc16, __m256i& m16) {
  if constexpr (T == Q2_K) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), m4 = _mm_set1_epi8(0x0F);
    sc16 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, m4));
    m16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), m4));
  } else {  // unpack_q3 in registers: nibbles of bytes 0..7 (low: scales 0..7, high: 8..15), the top two bits of
            // scale 4w + i from byte 8 + i shifted by 2w
    const uint8_t* p = b + 96;
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i a = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i nib = _mm_unpacklo_epi64(_mm_and_si128(a, m4), _mm_and_si128(_mm_srli_epi16(a, 4), m4));
    uint32_t u2;
    std::memcpy(&u2, p + 8, 4);
    const __m128i top = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(int(u2)), _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(3));
    const __m128i sc = _mm_sub_epi8(_mm_or_si128(nib, _mm_slli_epi16(top, 4)), _mm_set1_epi8(32));
    sc16 = _mm256_cvtepi8_epi16(sc);
    m16 = _mm256_setzero_si256();
  }
}

// the cache lines of one block of `bytes` at p (software prefetch: the dots are too slow for the hardware
// prefetcher alone to keep DRAM busy)
template <int64_t bytes>
__attribute__((always_inline)) inline void prefetch_block(const uint8_t* p) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + o, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(p) + bytes - 1, _MM_HINT_T0);
}

// NR (1..4) rows of type T, ld bytes apart, . one token's int8 activations -> out[0..NR). Each block's x is loaded
// once for the NR rows, and their independent sums keep the core busy on short rows; each row's sum is formed
// exactly as for NR = 1 (same accumulators, same order, same reduction). Each block prefetches the same block PF rows
// on (default NR: the next call's rows when the caller walks a matrix in groups of NR).
template <int T, int NR, int PF = NR>
__attribute__((always_inline)) inline void dot_rows_t(const uint8_t* w, int64_t ld, int64_t nb, const int8_t* xq, const float* xs,
                                                      const int16_t* bs16, float* out) {
  __m256 acc[NR], sub[NR];  // sub: the min terms (q4_k, q5_k) and q6_k's offset of 32, subtracted at the end
  float mins[NR] = {};      // q4_1 / q5_1: sum over blocks of m * s_x * (sum of x's 32), added at the end
  for (int r = 0; r < NR; ++r) acc[r] = sub[r] = _mm256_setzero_ps();
  if constexpr (T == Q8_0 || T == Q4_0 || T == Q4_Z || T == Q5_0 || T == MXFP4) {
    constexpr int64_t bytes = T == Q8_0 ? 34 : T == Q4_0 ? 18 : T == Q4_Z ? 19 : T == Q5_0 ? 22 : 17;
    for (int64_t i = 0; i < nb; ++i) {
      const __m256i x = load32(xq + 32 * i);
      for (int r = 0; r < NR; ++r) {
        const uint8_t* b = w + r * ld + i * bytes;
        prefetch_block<bytes>(b + PF * ld);
        float d;
        const __m256i q = small_block<T>(b, d);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_s8(q, x)), _mm256_set1_ps(d * xs[i]), acc[r]);
      }
    }
  } else if constexpr (T == NVFP4) {  // two halves of 32 per block, each with x's scale per 32
    for (int64_t i = 0; i < nb; ++i)
      for (int h = 0; h < 2; ++h) {
        const __m256i x = load32(xq + 64 * i + 32 * h);
        for (int r = 0; r < NR; ++r) {
          const uint8_t* b = w + r * ld + i * 36;
          if (h == 0) prefetch_block<36>(b + PF * ld);
          __m256 s;
          const __m256i q = nv_half(b, h, xs[2 * i + h], s);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_s8(q, x)), s, acc[r]);
        }
      }
  } else if constexpr (T == Q4_1 || T == Q5_1) {  // q unsigned: maddubs' unsigned operand as it is
    constexpr int64_t bytes = T == Q4_1 ? 20 : 24;
    for (int64_t i = 0; i < nb; ++i) {
      const __m256i x = load32(xq + 32 * i);
      const float xsum = xs[i] * float(bs16[2 * i] + bs16[2 * i + 1]);
      for (int r = 0; r < NR; ++r) {
        const uint8_t* b = w + r * ld + i * bytes;
        prefetch_block<bytes>(b + PF * ld);
        float d, m;
        const __m256i q = min_block<T>(b, d, m);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8(q, x)), _mm256_set1_ps(d * xs[i]), acc[r]);
        mins[r] = std::fma(m, xsum, mins[r]);
      }
    }
  } else if constexpr (T == IQ4_XS) {
    // per sub-block of 32: the table's values . x as dot_s8's int16 pairs, times the sub-block's scale in madd; one
    // float step with x's scale per 256
    for (int64_t i = 0; i < nb; ++i) {
      const int8_t* x = xq + 256 * i;
      for (int r = 0; r < NR; ++r) {
        const uint8_t* b = w + r * ld + i * 136;
        prefetch_block<136>(b + PF * ld);
        __m256i sumi = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {
          const __m256i q = iq4_values(b, j);
          const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(load32(x + 32 * j), q));
          sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, _mm256_set1_epi16(short(iq4_scale(b, j)))));
        }
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(h2f(b) * xs[i]), _mm256_cvtepi32_ps(sumi), acc[r]);
      }
    }
  } else if constexpr (T == Q4_K || T == Q5_K) {
    // per super-block: the 6-bit scales applied in integers (madd), one float step with x's scale for the 256;
    // the mins likewise, against the sums of x per 16 (each min twice)
    constexpr int64_t bytes = T == Q4_K ? 144 : 176;
    for (int64_t i = 0; i < nb; ++i) {
      const int8_t* x = xq + 256 * i;
      const __m256i xsum = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs16 + 16 * i));
      for (int r = 0; r < NR; ++r) {
        const uint8_t* b = w + r * ld + i * bytes;
        const __m256i hb = T == Q5_K ? load32(b + 16) : _mm256_setzero_si256();
        prefetch_block<bytes>(b + PF * ld);
        __m256i sc16, m16, lo, hi, s_lo, s_hi, sumi = _mm256_setzero_si256();
        k4_scales(b, sc16, m16);
        for (int c = 0; c < 4; ++c) {
          k4_chunk<T>(b + (T == Q4_K ? 16 : 48), hb, sc16, c, lo, hi, s_lo, s_hi);
          sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load32(x + 64 * c)), s_lo));
          sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load32(x + 64 * c + 32)), s_hi));
        }
        const __m256i mprod = _mm256_madd_epi16(m16, xsum);
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(h2f(b) * xs[i]), _mm256_cvtepi32_ps(sumi), acc[r]);
        sub[r] = _mm256_fmadd_ps(_mm256_set1_ps(h2f(b + 2) * xs[i]), _mm256_cvtepi32_ps(mprod), sub[r]);
      }
    }
  } else if constexpr (T == Q2_K || T == Q3_K) {
    // per 16 values one scale, applied in integers (madd) as q6_k's; q2_k's mins against the sums of x per 16, q3_k's
    // offset of 4 likewise (its values read as value + 4, 0..7)
    constexpr int64_t bytes = T == Q2_K ? 84 : 110;
    for (int64_t i = 0; i < nb; ++i) {
      const int8_t* x = xq + 256 * i;
      const __m256i xsum = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs16 + 16 * i));
      for (int r = 0; r < NR; ++r) {
        const uint8_t* b = w + r * ld + i * bytes;
        prefetch_block<bytes>(b + PF * ld);
        const __m256i hm = T == Q3_K ? load32(b) : _mm256_setzero_si256();
        __m256i sc16, m16, sumi = _mm256_setzero_si256();
        k2_scales<T>(b, sc16, m16);
        for (int n = 0; n < 2; ++n) {
          const __m256i qs = load32(b + (T == Q2_K ? 16 : 32) + 32 * n);
          for (int j = 0; j < 4; ++j)
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(k2_group<T>(qs, hm, n, j),
                                                                                 load32(x + 128 * n + 32 * j)),
                                                            q6k_scale(sc16, n, j)));
        }
        if constexpr (T == Q2_K) {
          acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(h2f(b + 80) * xs[i]), _mm256_cvtepi32_ps(sumi), acc[r]);
          sub[r] = _mm256_fmadd_ps(_mm256_set1_ps(h2f(b + 82) * xs[i]), _mm256_cvtepi32_ps(_mm256_madd_epi16(m16, xsum)),
                                   sub[r]);
        } else {
          const __m256 d = _mm256_set1_ps(h2f(b + 108) * xs[i]);
          acc[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi), acc[r]);
          sub[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_slli_epi32(_mm256_madd_epi16(sc16, xsum), 2)), sub[r]);
        }
      }
    }
  } else {  // Q6_K: q as unsigned 0..63 (the offset of 32 comes back through the sums of x), int8 scales per 16 by madd
    for (int64_t i = 0; i < nb; ++i) {
      const int8_t* x = xq + 256 * i;
      const __m256i xsum = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs16 + 16 * i));
      for (int r = 0; r < NR; ++r) {
        const uint8_t* b = w + r * ld + i * 210;
        prefetch_block<210>(b + PF * ld);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));  // 16 scales
        __m256i sumi = _mm256_setzero_si256(), q[4];
        for (int n = 0; n < 2; ++n) {
          q6k_half(b, n, q);
          for (int k = 0; k < 4; ++k)
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(q[k], load32(x + 32 * (4 * n + k))),
                                                            q6k_scale(sc16, n, k)));
        }
        // 32 * sum_j sc_j * (sum of x over the 16 values j)
        const __m256i o = _mm256_madd_epi16(sc16, xsum);
        const __m256 d = _mm256_set1_ps(h2f(b + 208) * xs[i]);
        acc[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi), acc[r]);
        sub[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_slli_epi32(o, 5)), sub[r]);
      }
    }
  }
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_sub_ps(acc[r], sub[r]);
  hsum_rows<NR>(acc, out);
  if constexpr (T == Q4_1 || T == Q5_1)
    for (int r = 0; r < NR; ++r) out[r] += mins[r];
}

// One row of type T . NT (1..4) tokens -> out[0..NT) (a batched decode step: several tokens share an expert): each
// block is decoded once for the tokens, and each token's sum is formed exactly as dot_rows_t forms it (same integer
// sums in the same order, same accumulators, hsum8), so a token's result does not depend on the others.
template <int T, int NT>
__attribute__((always_inline)) inline void dot_tokens_t(const uint8_t* w, int64_t nb, const int8_t* const* xq,
                                                        const float* const* xs, const int16_t* const* bs16, float* out) {
  __m256 acc[NT], sub[NT];
  float mins[NT] = {};
  for (int t = 0; t < NT; ++t) acc[t] = sub[t] = _mm256_setzero_ps();
  if constexpr (T == Q8_0 || T == Q4_0 || T == Q4_Z || T == Q5_0 || T == MXFP4) {
    constexpr int64_t bytes = T == Q8_0 ? 34 : T == Q4_0 ? 18 : T == Q4_Z ? 19 : T == Q5_0 ? 22 : 17;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t i = 0; i < nb; ++i) {
      float d;
      const __m256i q = small_block<T>(w + i * bytes, d);
      const __m256i aq = _mm256_sign_epi8(q, q);  // dot_s8's unsigned operand, once for the tokens
      for (int t = 0; t < NT; ++t) {
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aq, _mm256_sign_epi8(load32(xq[t] + 32 * i), q)), ones);
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * xs[t][i]), acc[t]);
      }
    }
  } else if constexpr (T == NVFP4) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t i = 0; i < nb; ++i)
      for (int h = 0; h < 2; ++h) {
        __m256 s;
        const __m256i q = nv_half(w + i * 36, h, 1.0f, s);
        const __m256i aq = _mm256_sign_epi8(q, q);
        for (int t = 0; t < NT; ++t) {
          const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aq, _mm256_sign_epi8(load32(xq[t] + 64 * i + 32 * h), q)), ones);
          acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(s, _mm256_set1_ps(xs[t][2 * i + h])), acc[t]);
        }
      }
  } else if constexpr (T == Q4_1 || T == Q5_1) {
    constexpr int64_t bytes = T == Q4_1 ? 20 : 24;
    for (int64_t i = 0; i < nb; ++i) {
      float d, m;
      const __m256i q = min_block<T>(w + i * bytes, d, m);
      for (int t = 0; t < NT; ++t) {
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8(q, load32(xq[t] + 32 * i))), _mm256_set1_ps(d * xs[t][i]), acc[t]);
        mins[t] = std::fma(m, xs[t][i] * float(bs16[t][2 * i] + bs16[t][2 * i + 1]), mins[t]);
      }
    }
  } else if constexpr (T == IQ4_XS) {
    for (int64_t i = 0; i < nb; ++i) {
      const uint8_t* b = w + i * 136;
      __m256i sumi[NT];
      for (int t = 0; t < NT; ++t) sumi[t] = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        const __m256i q = iq4_values(b, j), aq = _mm256_sign_epi8(q, q), sj = _mm256_set1_epi16(short(iq4_scale(b, j)));
        for (int t = 0; t < NT; ++t)
          sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(_mm256_maddubs_epi16(aq, _mm256_sign_epi8(load32(xq[t] + 256 * i + 32 * j), q)), sj));
      }
      const float d = h2f(b);
      for (int t = 0; t < NT; ++t) acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * xs[t][i]), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
    }
  } else if constexpr (T == Q4_K || T == Q5_K) {
    constexpr int64_t bytes = T == Q4_K ? 144 : 176;
    for (int64_t i = 0; i < nb; ++i) {
      const uint8_t* b = w + i * bytes;
      const __m256i hb = T == Q5_K ? load32(b + 16) : _mm256_setzero_si256();
      __m256i sc16, m16, lo, hi, s_lo, s_hi, sumi[NT];
      k4_scales(b, sc16, m16);
      for (int t = 0; t < NT; ++t) sumi[t] = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        k4_chunk<T>(b + (T == Q4_K ? 16 : 48), hb, sc16, c, lo, hi, s_lo, s_hi);
        for (int t = 0; t < NT; ++t) {
          const int8_t* x = xq[t] + 256 * i;
          sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load32(x + 64 * c)), s_lo));
          sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load32(x + 64 * c + 32)), s_hi));
        }
      }
      const float d = h2f(b), dmin = h2f(b + 2);
      for (int t = 0; t < NT; ++t) {
        const __m256i mprod = _mm256_madd_epi16(m16, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs16[t] + 16 * i)));
        acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * xs[t][i]), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
        sub[t] = _mm256_fmadd_ps(_mm256_set1_ps(dmin * xs[t][i]), _mm256_cvtepi32_ps(mprod), sub[t]);
      }
    }
  } else if constexpr (T == Q2_K || T == Q3_K) {
    constexpr int64_t bytes = T == Q2_K ? 84 : 110;
    for (int64_t i = 0; i < nb; ++i) {
      const uint8_t* b = w + i * bytes;
      const __m256i hm = T == Q3_K ? load32(b) : _mm256_setzero_si256();
      __m256i sc16, m16, sumi[NT];
      k2_scales<T>(b, sc16, m16);
      for (int t = 0; t < NT; ++t) sumi[t] = _mm256_setzero_si256();
      for (int n = 0; n < 2; ++n) {
        const __m256i qs = load32(b + (T == Q2_K ? 16 : 32) + 32 * n);
        for (int j = 0; j < 4; ++j) {
          const __m256i g = k2_group<T>(qs, hm, n, j), sj = q6k_scale(sc16, n, j);
          for (int t = 0; t < NT; ++t)
            sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(_mm256_maddubs_epi16(g, load32(xq[t] + 256 * i + 128 * n + 32 * j)), sj));
        }
      }
      for (int t = 0; t < NT; ++t) {
        const __m256i xsum = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs16[t] + 16 * i));
        if constexpr (T == Q2_K) {
          acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(h2f(b + 80) * xs[t][i]), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
          sub[t] = _mm256_fmadd_ps(_mm256_set1_ps(h2f(b + 82) * xs[t][i]), _mm256_cvtepi32_ps(_mm256_madd_epi16(m16, xsum)),
                                   sub[t]);
        } else {
          const __m256 d = _mm256_set1_ps(h2f(b + 108) * xs[t][i]);
          acc[t] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi[t]), acc[t]);
          sub[t] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_slli_epi32(_mm256_madd_epi16(sc16, xsum), 2)), sub[t]);
        }
      }
    }
  } else {  // Q6_K
    for (int64_t i = 0; i < nb; ++i) {
      const uint8_t* b = w + i * 210;
      const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
      __m256i sumi[NT], q[4];
      for (int t = 0; t < NT; ++t) sumi[t] = _mm256_setzero_si256();
      for (int n = 0; n < 2; ++n) {
        q6k_half(b, n, q);
        for (int k = 0; k < 4; ++k) {
          const __m256i sk = q6k_scale(sc16, n, k);
          for (int t = 0; t < NT; ++t)
            sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(_mm256_maddubs_epi16(q[k], load32(xq[t] + 256 * i + 32 * (4 * n + k))), sk));
        }
      }
      const float dw = h2f(b + 208);
      for (int t = 0; t < NT; ++t) {
        const __m256i o = _mm256_madd_epi16(sc16, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs16[t] + 16 * i)));
        const __m256 d = _mm256_set1_ps(dw * xs[t][i]);
        acc[t] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi[t]), acc[t]);
        sub[t] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_slli_epi32(o, 5)), sub[t]);
      }
    }
  }
  for (int t = 0; t < NT; ++t) out[t] = hsum8(_mm256_sub_ps(acc[t], sub[t])) + mins[t];
}

template <int T>
inline void dot_tokens_n(const uint8_t* w, int64_t nb, const int8_t* const* xq, const float* const* xs,
                         const int16_t* const* bs16, int n, float* out) {
  switch (n) {
    case 4: dot_tokens_t<T, 4>(w, nb, xq, xs, bs16, out); return;
    case 3: dot_tokens_t<T, 3>(w, nb, xq, xs, bs16, out); return;
    case 2: dot_tokens_t<T, 2>(w, nb, xq, xs, bs16, out); return;
    default: dot_tokens_t<T, 1>(w, nb, xq, xs, bs16, out); return;
  }
}

// One row after the other, each prefetching the row two ahead: a single sequential stream, which DRAM serves faster
// than NR rows in lockstep (bench/bench_kernels.py --ggml on a 2-core AVX2 host: q8_0 and q6_k 1.27x; in cache the
// two are equal). Each row's sum is dot_rows_t<T, 1>'s whichever way it is called.
template <int T>
inline void dot_rows_n(const uint8_t* w, int64_t ld, int64_t nb, const int8_t* xq, const float* xs, const int16_t* bs16,
                       int n, float* out) {
  for (int r = 0; r < n; ++r) dot_rows_t<T, 1, 2>(w + r * ld, ld, nb, xq, xs, bs16, out + r);
}
#endif

// One row (nb blocks) . n (1..4) tokens' int8 activations -> out[0..n); the portable build takes them one at a time.
inline void dot_tokens(const Layout& L, const uint8_t* w, int64_t nb, const int8_t* const* xq, const float* const* xs,
                       const int16_t* const* bs16, int n, float* out);

// n (1..4) rows (nb blocks each, ld bytes apart) . one token's int8 activations -> out[0..n).
// xq: the token's int8 values from the row's first weight; xs: fp32 scale per L.act values; bs16: sum of xq per 16.
inline void dot_rows(const Layout& L, const uint8_t* w, int64_t ld, int64_t nb, const int8_t* xq, const float* xs,
                     const int16_t* bs16, int n, float* out) {
#if defined(MOE_AVX512BF16) || defined(MOE_AVX2)
  switch (L.type) {
    case Q8_0: dot_rows_n<Q8_0>(w, ld, nb, xq, xs, bs16, n, out); return;
    case Q4_0: dot_rows_n<Q4_0>(w, ld, nb, xq, xs, bs16, n, out); return;
    case Q4_Z: dot_rows_n<Q4_Z>(w, ld, nb, xq, xs, bs16, n, out); return;
    case Q4_1: dot_rows_n<Q4_1>(w, ld, nb, xq, xs, bs16, n, out); return;
    case Q5_0: dot_rows_n<Q5_0>(w, ld, nb, xq, xs, bs16, n, out); return;
    case Q5_1: dot_rows_n<Q5_1>(w, ld, nb, xq, xs, bs16, n, out); return;
    case IQ4_XS: dot_rows_n<IQ4_XS>(w, ld, nb, xq, xs, bs16, n, out); return;
    case MXFP4: dot_rows_n<MXFP4>(w, ld, nb, xq, xs, bs16, n, out); return;
    case NVFP4: dot_rows_n<NVFP4>(w, ld, nb, xq, xs, bs16, n, out); return;
    case Q4_K: dot_rows_n<Q4_K>(w, ld, nb, xq, xs, bs16, n, out); return;
    case Q5_K: dot_rows_n<Q5_K>(w, ld, nb, xq, xs, bs16, n, out); return;
    case Q6_K: dot_rows_n<Q6_K>(w, ld, nb, xq, xs, bs16, n, out); return;
    case Q2_K: dot_rows_n<Q2_K>(w, ld, nb, xq, xs, bs16, n, out); return;
    case Q3_K: dot_rows_n<Q3_K>(w, ld, nb, xq, xs, bs16, n, out); return;
  }
#else
  int8_t v[256];
  float sc16[16], mn16[16];
  const int64_t B = L.block;
  for (int r = 0; r < n; ++r) {
    const uint8_t* b = w + r * ld;
    float total = 0.0f;
    for (int64_t i = 0; i < nb; ++i, b += L.bytes) {
      decode(L.type, b, v, sc16, mn16);
      for (int64_t s = 0; s < B / 16; ++s) {
        const int64_t e0 = i * B + 16 * s;
        int32_t acc = 0;
        for (int l = 0; l < 16; ++l) acc += int32_t(v[16 * s + l]) * int32_t(xq[e0 + l]);
        total += xs[e0 / L.act] * (sc16[s] * float(acc) - mn16[s] * float(bs16[e0 / 16]));
      }
    }
    out[r] = total;
  }
#endif
}

inline void dot_tokens(const Layout& L, const uint8_t* w, int64_t nb, const int8_t* const* xq, const float* const* xs,
                       const int16_t* const* bs16, int n, float* out) {
#if defined(MOE_AVX512BF16) || defined(MOE_AVX2)
  switch (L.type) {
    case Q8_0: dot_tokens_n<Q8_0>(w, nb, xq, xs, bs16, n, out); return;
    case Q4_0: dot_tokens_n<Q4_0>(w, nb, xq, xs, bs16, n, out); return;
    case Q4_Z: dot_tokens_n<Q4_Z>(w, nb, xq, xs, bs16, n, out); return;
    case Q4_1: dot_tokens_n<Q4_1>(w, nb, xq, xs, bs16, n, out); return;
    case Q5_0: dot_tokens_n<Q5_0>(w, nb, xq, xs, bs16, n, out); return;
    case Q5_1: dot_tokens_n<Q5_1>(w, nb, xq, xs, bs16, n, out); return;
    case IQ4_XS: dot_tokens_n<IQ4_XS>(w, nb, xq, xs, bs16, n, out); return;
    case MXFP4: dot_tokens_n<MXFP4>(w, nb, xq, xs, bs16, n, out); return;
    case NVFP4: dot_tokens_n<NVFP4>(w, nb, xq, xs, bs16, n, out); return;
    case Q4_K: dot_tokens_n<Q4_K>(w, nb, xq, xs, bs16, n, out); return;
    case Q5_K: dot_tokens_n<Q5_K>(w, nb, xq, xs, bs16, n, out); return;
    case Q6_K: dot_tokens_n<Q6_K>(w, nb, xq, xs, bs16, n, out); return;
    case Q2_K: dot_tokens_n<Q2_K>(w, nb, xq, xs, bs16, n, out); return;
    case Q3_K: dot_tokens_n<Q3_K>(w, nb, xq, xs, bs16, n, out); return;
  }
#else
  for (int t = 0; t < n; ++t) dot_rows(L, w, 0, nb, xq[t], xs[t], bs16[t], 1, out + t);
#endif
}

}  // namespace moe_blocks
