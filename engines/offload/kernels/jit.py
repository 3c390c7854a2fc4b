"""bf16 GEMV kernels for one-token decode on the CPU, compiled at first use, registered as torch custom ops.

    x [H] bf16 --(one pass over W [N, H], fp32 accumulation, rows split over threads)--> y [N] bf16

Why: a decode step reads every selected weight once and does 2 flops per weight, so it is bound by
memory bandwidth; torch's bf16 ``F.linear`` for one row reaches about half of it on this CPU. These
kernels stream each weight row once (AVX512-BF16 ``vdpbf16ps``, AVX2 FMA, or a portable loop,
chosen from /proc/cpuinfo at build time) and keep x in L1.

Ops (namespace ``moe_offload``, opaque to torch.compile; fake kernels registered below):
  gemv_bf16(x [.., H], w [N, H], bias [N]?) -> [.., N]          x holds one token (numel == H)
  gemm_bf16(x [.., H], w [N, H], bias [N]?) -> [.., N]          any number of tokens M; each weight row is
      read once for all of them, and token t's row is bit-identical to gemv_bf16 of token t alone
  expert_mlp_bf16(x [.., H], gate_up [2I, H], down [H, I], gate_up_bias [2I]?, down_bias [H]?) -> [.., H]
      silu(gate) * up with gate = rows [0, I), up = rows [I, 2I) (transformers' concatenated layout)
  experts_mlp_bf16(x [H], gate_ups K x [2I, H], down K x [H, I]) -> [K, H]
      K experts of one token in two parallel passes; row k is bit-identical to expert_mlp_bf16 of expert k
  moe_experts_bf16(x [T, H], gate_ups J x [2I, H], downs J x [H, I], tok [S], perm [S], starts [J], counts [J], out [R, H])
      a layer's routed pairs (sorted by expert) through their experts in one call, written to out[perm[s]];
      every pair's row is bit-identical to expert_mlp_bf16 of its token alone
Intermediates are rounded to bf16 where the unfused bf16 path rounds (after each GEMV, after silu, after
the product), so results match ``F.linear`` chains up to the order of the fp32 sums.

The quantized-expert ops (``gemv_q``, ``expert_mlp_q``: int8, fp8, mxfp4) live in quant_kernels.py and are
compiled into the same library (one build, one ``load()``).

Legend: H hidden (input features), N output rows, I expert intermediate, K experts of the token.
``load()`` builds once per machine (cache: $TORCH_EXTENSIONS_DIR or ~/.cache/moe-offload/kernels) and returns
False, after one warning, when the kernels are disabled (MOE_OFFLOAD_KERNELS=0) or cannot be built.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import torch

from moe_offload.engines.offload.kernels.decode_src import DECODE_SOURCE
from moe_offload.engines.offload.kernels.decode_src import register_fakes as _register_decode_fakes
from moe_offload.engines.offload.kernels.quant_src import QUANT_SOURCE
from moe_offload.engines.offload.kernels.quant_src import register_fakes as _register_quant_fakes

try:
    import fcntl
except ImportError:  # not a POSIX system: torch's own lock file only
    fcntl = None

ENV = "MOE_OFFLOAD_KERNELS"

SOURCE = r"""
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(MOE_AVX512BF16) || defined(MOE_AVX2)
#include <immintrin.h>
#endif

namespace {

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
inline __m256 load8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline float dot_row(const uint16_t* w, const uint16_t* x, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    a0 = _mm256_fmadd_ps(load8(w + j), load8(x + j), a0);
    a1 = _mm256_fmadd_ps(load8(w + j + 8), load8(x + j + 8), a1);
    a2 = _mm256_fmadd_ps(load8(w + j + 16), load8(x + j + 16), a2);
    a3 = _mm256_fmadd_ps(load8(w + j + 24), load8(x + j + 24), a3);
  }
  for (; j + 8 <= n; j += 8) a0 = _mm256_fmadd_ps(load8(w + j), load8(x + j), a0);
  __m256 v = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  float t = _mm_cvtss_f32(s);
  for (; j < n; ++j) t += bf2f(w[j]) * bf2f(x[j]);
  return t;
}
#else
inline float dot_row(const uint16_t* w, const uint16_t* x, int64_t n) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // 8 partial sums: lets the compiler vectorise without -ffast-math
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int l = 0; l < 8; ++l) s[l] += bf2f(w[j + l]) * bf2f(x[j + l]);
  float t = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  for (; j < n; ++j) t += bf2f(w[j]) * bf2f(x[j]);
  return t;
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
#else
template <int T>
inline void dot_rows(const uint16_t* w, const uint16_t* const* x, int64_t n, float* out) {
  for (int t = 0; t < T; ++t) out[t] = dot_row(w, x[t], n);
}
#endif

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

// out[i] = bf16(dot(w[i], x) + bias[i]) for rows [begin, end).
inline void gemv_range(const uint16_t* w, int64_t ld, const uint16_t* x, int64_t n, const uint16_t* bias,
                       int64_t begin, int64_t end, uint16_t* out) {
  for (int64_t i = begin; i < end; ++i) {
    float acc = dot_row(w + i * ld, x, n);
    out[i] = f2bf(bias ? acc + bf2f(bias[i]) : acc);
  }
}

// h[r, i] = bf16(bf16(silu(g)) * up) for rows r of gu [rows, 2I] (gate = columns [0, I), up = [I, 2I)), rounded
// where torch's bf16 silu and product round. Split over threads only when a batched step brings enough rows
// (32k elements): one token's few experts are cheaper on the calling thread than a parallel region.
inline void silu_mul_rows(const uint16_t* gu, uint16_t* h, int64_t rows, int64_t I) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(1, I)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const uint16_t* g = gu + r * 2 * I;
      for (int64_t i = 0; i < I; ++i) {
        float gv = bf2f(g[i]);
        float sv = bf2f(f2bf(gv / (1.0f + std::exp(-gv))));  // silu, rounded as torch's bf16 silu
        h[r * I + i] = f2bf(sv * bf2f(g[I + i]));
      }
    }
  });
}

// Rows per task: at least ~64 KiB of weights, so a thread's start-up is paid for.
inline int64_t grain(int64_t n) { return std::max<int64_t>(4, (int64_t(1) << 16) / std::max<int64_t>(1, 2 * n)); }

inline const uint16_t* ptr(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }

void check_weight(const at::Tensor& w, const char* what) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kBFloat16 && w.dim() == 2,
              what, ": expected a 2-D bf16 CPU tensor, got ", w.scalar_type(), " ", w.sizes(), " on ", w.device());
  TORCH_CHECK(w.stride(1) == 1, what, ": expected contiguous rows (stride 1 along the input), got strides ", w.strides());
}

const uint16_t* opt_bias(const std::optional<at::Tensor>& b, int64_t n, const char* what) {
  if (!b.has_value()) return nullptr;
  TORCH_CHECK(b->device().is_cpu() && b->scalar_type() == at::kBFloat16 && b->numel() == n && b->is_contiguous(),
              what, ": expected a contiguous bf16 CPU tensor of ", n, " elements, got ", b->scalar_type(), " ", b->sizes());
  return ptr(*b);
}

at::Tensor one_token(const at::Tensor& x, int64_t h, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() >= 1 && x.size(-1) == h && x.numel() == h,
              what, ": expected one bf16 CPU token of ", h, " features, got ", x.scalar_type(), " ", x.sizes());
  return x.contiguous();
}

// K experts (silu-gated, concatenated gate|up) of one token: out [K, H].
void experts_impl(const uint16_t* x, const std::vector<const uint16_t*>& up, const std::vector<int64_t>& up_ld,
                  const std::vector<const uint16_t*>& dn, const std::vector<int64_t>& dn_ld,
                  const std::vector<const uint16_t*>& up_b, const std::vector<const uint16_t*>& dn_b,
                  int64_t H, int64_t I, uint16_t* out) {
  const int64_t K = (int64_t)up.size(), I2 = 2 * I;
  std::vector<uint16_t> gu(K * I2), h(K * I);
  at::parallel_for(0, K * I2, grain(H), [&](int64_t b, int64_t e) {
    while (b < e) {  // a task may span experts: split it at expert boundaries
      int64_t k = b / I2, stop = std::min(e, (k + 1) * I2);
      gemv_range(up[k], up_ld[k], x, H, up_b[k], b - k * I2, stop - k * I2, gu.data() + k * I2);
      b = stop;
    }
  });
  silu_mul_rows(gu.data(), h.data(), K, I);
  at::parallel_for(0, K * H, grain(I), [&](int64_t b, int64_t e) {
    while (b < e) {
      int64_t k = b / H, stop = std::min(e, (k + 1) * H);
      gemv_range(dn[k], dn_ld[k], h.data() + k * I, I, dn_b[k], b - k * H, stop - k * H, out + k * H);
      b = stop;
    }
  });
}

at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  check_weight(w, "gemv_bf16 w");
  const int64_t N = w.size(0), H = w.size(1);
  at::Tensor xc = one_token(x, H, "gemv_bf16 x");
  const uint16_t* b = opt_bias(bias, N, "gemv_bf16 bias");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty(shape, x.options());
  const uint16_t* wp = ptr(w);
  const uint16_t* xp = ptr(xc);
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t ld = w.stride(0);
  at::parallel_for(0, N, grain(H), [&](int64_t s, int64_t e) { gemv_range(wp, ld, xp, H, b, s, e, op); });
  return out;
}

// out[t, i] = bf16(dot(w[i], x[t]) + bias[i]) for every token t and rows [begin, end): each weight row is read from
// memory once and reused from L1 for every token; each (t, i) is summed exactly as gemv_range sums it, so a
// token's result does not depend on which other tokens share the call.
inline void gemm_range(const uint16_t* w, int64_t ld, const uint16_t* x, int64_t ldx, int64_t M, int64_t n,
                       const uint16_t* bias, int64_t begin, int64_t end, uint16_t* out, int64_t N) {
  std::vector<const uint16_t*> xs(M);
  std::vector<float> acc(M);
  for (int64_t t = 0; t < M; ++t) xs[t] = x + t * ldx;
  for (int64_t i = begin; i < end; ++i) {
    const float b = bias ? bf2f(bias[i]) : 0.0f;
    dot_many(w + i * ld, xs.data(), M, n, acc.data());
    for (int64_t t = 0; t < M; ++t) out[t * N + i] = f2bf(bias ? acc[t] + b : acc[t]);
  }
}

at::Tensor gemm_bf16(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  check_weight(w, "gemm_bf16 w");
  const int64_t N = w.size(0), H = w.size(1);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() >= 1 && x.size(-1) == H,
              "gemm_bf16 x: expected bf16 CPU tokens of ", H, " features, got ", x.scalar_type(), " ", x.sizes());
  at::Tensor xc = x.reshape({-1, H}).contiguous();
  const int64_t M = xc.size(0);
  const uint16_t* b = opt_bias(bias, N, "gemm_bf16 bias");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty(shape, x.options());
  if (M == 0) return out;
  const uint16_t* wp = ptr(w);
  const uint16_t* xp = ptr(xc);
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t ld = w.stride(0);
  at::parallel_for(0, N, std::max<int64_t>(1, grain(H) / M), [&](int64_t s, int64_t e) {
    gemm_range(wp, ld, xp, H, M, H, b, s, e, op, N);
  });
  return out;
}

void check_expert(const at::Tensor& up, const at::Tensor& dn, int64_t H, int64_t I) {
  check_weight(up, "gate_up");
  check_weight(dn, "down");
  TORCH_CHECK(up.size(0) == 2 * I && up.size(1) == H && dn.size(0) == H && dn.size(1) == I,
              "expected gate_up [2I, H] and down [H, I] with H=", H, " I=", I, ", got ", up.sizes(), " and ", dn.sizes());
}

at::Tensor expert_mlp_bf16(const at::Tensor& x, const at::Tensor& up, const at::Tensor& dn,
                           const std::optional<at::Tensor>& up_bias, const std::optional<at::Tensor>& dn_bias) {
  check_weight(dn, "down");  // before size(1): a 1-D down would raise a bare "Dimension out of range"
  const int64_t H = dn.size(0), I = dn.size(1);
  check_expert(up, dn, H, I);
  at::Tensor xc = one_token(x, H, "expert_mlp_bf16 x");
  at::Tensor out = at::empty(x.sizes(), x.options());
  experts_impl(ptr(xc), {ptr(up)}, {up.stride(0)}, {ptr(dn)}, {dn.stride(0)},
               {opt_bias(up_bias, 2 * I, "gate_up_bias")}, {opt_bias(dn_bias, H, "down_bias")}, H, I,
               reinterpret_cast<uint16_t*>(out.data_ptr()));
  return out;
}

// Routed pairs of a step through their experts, one call per layer and tier: expert j (gate_up ups[j], down
// downs[j]) takes the pairs s in [starts[j], starts[j] + counts[j]) of the expert-sorted pair list, pair s reading
// token row x[tok[s]] and writing out[perm[s]]. Each weight row is read once for all of its expert's pairs; each
// pair's numbers are exactly expert_mlp_bf16's for that token alone (same sums, same bf16 roundings).
void moe_experts_bf16(const at::Tensor& x, at::TensorList ups, at::TensorList downs, const at::Tensor& tok,
                      const at::Tensor& perm, at::IntArrayRef starts, at::IntArrayRef counts, const at::Tensor& out) {
  const int64_t J = (int64_t)ups.size();
  TORCH_CHECK(J == (int64_t)downs.size() && J == (int64_t)starts.size() && J == (int64_t)counts.size(),
              "moe_experts_bf16: expected as many gate_ups, downs, starts and counts, got ", J, ", ", downs.size(), ", ",
              starts.size(), ", ", counts.size());
  if (J == 0) return;
  check_weight(downs[0], "down");
  const int64_t H = downs[0].size(0), I = downs[0].size(1), I2 = 2 * I;
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) == H && x.is_contiguous(),
              "moe_experts_bf16 x: expected contiguous bf16 CPU tokens [T, ", H, "], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kBFloat16 && out.dim() == 2 && out.size(1) == H && out.is_contiguous(),
              "moe_experts_bf16 out: expected a contiguous bf16 CPU tensor [S, ", H, "], got ", out.scalar_type(), " ", out.sizes());
  TORCH_CHECK(tok.scalar_type() == at::kLong && perm.scalar_type() == at::kLong && tok.is_contiguous() && perm.is_contiguous()
              && tok.numel() == perm.numel(), "moe_experts_bf16: expected int64 tok and perm of the same length");
  const int64_t* tp = tok.data_ptr<int64_t>();
  const int64_t* pp = perm.data_ptr<int64_t>();
  const int64_t S = tok.numel(), T = x.size(0), R = out.size(0);
  std::vector<const uint16_t*> up(J), dn(J);
  std::vector<int64_t> up_ld(J), dn_ld(J), first(J + 1, 0);  // first[j]: this call's buffer row of expert j's first pair
  for (int64_t j = 0; j < J; ++j) {
    check_expert(ups[j], downs[j], H, I);
    TORCH_CHECK(starts[j] >= 0 && counts[j] >= 0 && starts[j] + counts[j] <= S, "moe_experts_bf16: pair range ", j, " out of bounds");
    up[j] = ptr(ups[j]); up_ld[j] = ups[j].stride(0);
    dn[j] = ptr(downs[j]); dn_ld[j] = downs[j].stride(0);
    first[j + 1] = first[j] + counts[j];
  }
  for (int64_t j = 0; j < J; ++j)
    for (int64_t s = starts[j]; s < starts[j] + counts[j]; ++s)
      TORCH_CHECK(tp[s] >= 0 && tp[s] < T && pp[s] >= 0 && pp[s] < R, "moe_experts_bf16: token or output row out of range");
  const int64_t P = first[J];
  std::vector<uint16_t> xs(P * H), gu(P * I2), h(P * I);
  for (int64_t j = 0; j < J; ++j)  // gather each pair's token row: an expert's pairs are then contiguous
    for (int64_t q = 0; q < counts[j]; ++q)
      std::memcpy(xs.data() + (first[j] + q) * H, ptr(x) + tp[starts[j] + q] * H, H * sizeof(uint16_t));
  at::parallel_for(0, J * I2, std::max<int64_t>(1, grain(H) / std::max<int64_t>(1, P / J)), [&](int64_t b, int64_t e) {
    while (b < e) {  // a task may span experts: split it at expert boundaries
      int64_t j = b / I2, stop = std::min(e, (j + 1) * I2);
      const int64_t c = first[j + 1] - first[j];
      std::vector<const uint16_t*> xp(c);
      std::vector<float> acc(c);
      for (int64_t q = 0; q < c; ++q) xp[q] = xs.data() + (first[j] + q) * H;
      for (int64_t r = b - j * I2; r < stop - j * I2; ++r) {
        dot_many(up[j] + r * up_ld[j], xp.data(), c, H, acc.data());
        for (int64_t q = 0; q < c; ++q) gu[(first[j] + q) * I2 + r] = f2bf(acc[q]);
      }
      b = stop;
    }
  });
  silu_mul_rows(gu.data(), h.data(), P, I);
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, J * H, std::max<int64_t>(1, grain(I) / std::max<int64_t>(1, P / J)), [&](int64_t b, int64_t e) {
    while (b < e) {
      int64_t j = b / H, stop = std::min(e, (j + 1) * H);
      const int64_t c = counts[j];
      std::vector<const uint16_t*> hp(c);
      std::vector<float> acc(c);
      for (int64_t q = 0; q < c; ++q) hp[q] = h.data() + (first[j] + q) * I;
      for (int64_t r = b - j * H; r < stop - j * H; ++r) {
        dot_many(dn[j] + r * dn_ld[j], hp.data(), c, I, acc.data());
        for (int64_t q = 0; q < c; ++q) op[pp[starts[j] + q] * H + r] = f2bf(acc[q]);
      }
      b = stop;
    }
  });
}

at::Tensor experts_mlp_bf16(const at::Tensor& x, at::TensorList ups, at::TensorList downs) {
  TORCH_CHECK(!ups.empty() && ups.size() == downs.size(), "experts_mlp_bf16: expected as many gate_up as down tensors (>= 1), got ",
              ups.size(), " and ", downs.size());
  check_weight(downs[0], "down");
  const int64_t K = (int64_t)ups.size(), H = downs[0].size(0), I = downs[0].size(1);
  at::Tensor xc = one_token(x, H, "experts_mlp_bf16 x");
  std::vector<const uint16_t*> up(K), dn(K), none(K, nullptr);
  std::vector<int64_t> up_ld(K), dn_ld(K);
  for (int64_t k = 0; k < K; ++k) {
    check_expert(ups[k], downs[k], H, I);
    up[k] = ptr(ups[k]); up_ld[k] = ups[k].stride(0);
    dn[k] = ptr(downs[k]); dn_ld[k] = downs[k].stride(0);
  }
  at::Tensor out = at::empty({K, H}, x.options());
  experts_impl(ptr(xc), up, up_ld, dn, dn_ld, none, none, H, I, reinterpret_cast<uint16_t*>(out.data_ptr()));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_offload, m) {
  m.def("gemv_bf16(Tensor x, Tensor w, Tensor? bias=None) -> Tensor");
  m.def("gemm_bf16(Tensor x, Tensor w, Tensor? bias=None) -> Tensor");
  m.def("expert_mlp_bf16(Tensor x, Tensor gate_up, Tensor down, Tensor? gate_up_bias=None, Tensor? down_bias=None) -> Tensor");
  m.def("experts_mlp_bf16(Tensor x, Tensor[] gate_ups, Tensor[] downs) -> Tensor");
  m.def("moe_experts_bf16(Tensor x, Tensor[] gate_ups, Tensor[] downs, Tensor tok, Tensor perm, int[] starts, int[] counts, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(moe_offload, CPU, m) {
  m.impl("gemv_bf16", &gemv_bf16);
  m.impl("gemm_bf16", &gemm_bf16);
  m.impl("expert_mlp_bf16", &expert_mlp_bf16);
  m.impl("experts_mlp_bf16", &experts_mlp_bf16);
  m.impl("moe_experts_bf16", &moe_experts_bf16);
}
"""

# The bf16 kernels above, the quantized-expert kernels (quant_kernels.py) and the fused decode layer
# (decode_kernels.py, which uses the dot products above): one library, one build.
SOURCES = (SOURCE, QUANT_SOURCE, DECODE_SOURCE)

# ISA variants, best first: (name, /proc/cpuinfo flags it needs, compiler flags)
VARIANTS = (
    # every CPU with AVX512-BF16 (Cooper Lake, Sapphire Rapids, Zen 4) also has VNNI, which the int8 kernels use
    ("avx512bf16", ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"),
     ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mfma", "-DMOE_AVX512BF16")),
    ("avx2", ("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c", "-DMOE_AVX2")),
    ("portable", (), ()),
)

_lock = threading.Lock()
_state: dict = {}  # "ok": usable now, "built": library loaded, "variant": ISA, "error": why not


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none: then the portable build)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def pick_variant(flags: set[str]) -> tuple[str, tuple[str, ...]]:
    """(variant name, compiler flags) for the best ISA these CPU flags allow; MOE_OFFLOAD_KERNELS=<name> picks a lesser one."""
    forced = os.environ.get(ENV, "")
    usable = [(name, cflags) for name, needs, cflags in VARIANTS if set(needs) <= flags]  # never one the CPU lacks
    return next(((n, c) for n, c in usable if n == forced), usable[0])


def enabled_by_env() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def build_dir(name: str) -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "moe-offload" / "kernels"
    return base / name


def load() -> bool:
    """Build (first use on this machine, ~10-30 s) or load the kernels; True when ``torch.ops.moe_offload`` has them
    and they are on. Cheap after the first call (the hot path calls it per expert).

    Never raises: a missing compiler, a failed build or MOE_OFFLOAD_KERNELS=0 (read once, at the first call) give
    False (one warning for a failure), and callers keep the ``F.linear`` path.
    """
    ok = _state.get("ok")
    if ok is None:
        with _lock:
            if "ok" not in _state:
                _state.update(_build() if enabled_by_env() else {"ok": False, "built": False, "variant": "",
                                                                  "error": f"disabled by {ENV}"})
            ok = _state["ok"]
    return ok


def set_enabled(on: bool) -> bool:
    """Turn the kernels on (building them if needed) or off for this process, e.g. for an A/B in one process.
    Returns whether they are on."""
    with _lock:
        if on and not _state.get("built"):
            _state.update(_build())
        _state["ok"] = bool(on and _state.get("built"))
        return _state["ok"]


def info() -> dict:
    """{"ok": bool, "built": bool, "variant": str, "error": str} once ``load()`` ran; {} before."""
    return dict(_state)


def build_spec() -> tuple[str, list[str], str]:
    """(variant, compiler flags, library name) of this CPU's build. The name carries the variant and a hash of
    source, flags and torch version, so a cache shared by machines never hands one a library for another ISA."""
    variant, isa = pick_variant(cpu_flags())
    # -fopenmp: at::parallel_for is an inline OpenMP region; without it the kernel would run on one thread.
    # The library then needs libgomp.so.1, which resolves to the copy torch already loaded (one thread pool).
    cflags = ["-O3", "-fopenmp", *isa]
    key = hashlib.sha256("\0".join((*SOURCES, *cflags, torch.__version__)).encode()).hexdigest()[:12]
    return variant, cflags, f"moe_offload_cpu_{variant}_{key}"


@contextlib.contextmanager
def _build_lock(directory: Path):
    """One builder per build directory, across processes, and no hang on a dead builder's lock.

    torch's builder guards the directory with a ``lock`` file it deletes when done; a builder killed mid-build
    (SIGKILL, OOM, a CI timeout) leaves it behind and every later process waits on it forever. An flock is
    dropped by the kernel when its holder dies: holding it, no live process of ours is building here, so a
    leftover ``lock`` is stale and removed."""
    if fcntl is None:
        yield
        return
    with open(directory / "build.flock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            (directory / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build() -> dict:
    variant, cflags, name = build_spec()
    try:
        from torch.utils.cpp_extension import load_inline

        _find_ninja()
        directory = build_dir(name)
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError:  # read-only home (some CI runners, containers): build in the temp dir instead
            directory = Path(tempfile.gettempdir()) / f"moe-offload-kernels-{os.getuid()}" / name
            directory.mkdir(parents=True, exist_ok=True)
        with _build_lock(directory):
            load_inline(
                name=name,
                cpp_sources=list(SOURCES),
                extra_cflags=cflags,
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                is_python_module=False,
                no_implicit_headers=True,
                verbose=False,
            )
        _register_fakes()
        return {"ok": True, "built": True, "variant": variant, "error": ""}
    except Exception as e:  # noqa: BLE001 - any build or load failure means: keep the F.linear path
        msg = " ".join(str(e).split())[-400:]
        from moe_offload.log import get_logger

        get_logger("moe_offload.kernels").warning(
            "cpu_kernels_unavailable", variant=variant, error=f"{type(e).__name__}: {msg}",
            fallback="F.linear", hint=f"set {ENV}=0 to skip the build",
        )
        return {"ok": False, "built": False, "variant": variant, "error": f"{type(e).__name__}: {msg}"}


def _find_ninja() -> None:
    """torch's extension builder runs ``ninja`` from PATH; the ``ninja`` wheel (a dependency) puts it next to the
    interpreter, which is not on PATH when the venv's python is run without activating the venv."""
    if shutil.which("ninja"):
        return
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja

        dirs.insert(0, ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    for d in dirs:
        if shutil.which("ninja", path=d):
            os.environ["PATH"] = d + os.pathsep + os.environ.get("PATH", "")
            return


def _register_fakes() -> None:
    """Shape functions so torch.compile / meta tensors see the ops as opaque calls with known outputs."""
    from torch.library import register_fake

    def gemv(x, w, bias=None):
        return x.new_empty((*x.shape[:-1], w.shape[0]))

    def expert(x, gate_up, down, gate_up_bias=None, down_bias=None):
        return x.new_empty(x.shape)

    def experts(x, gate_ups, downs):
        return x.new_empty((len(gate_ups), downs[0].shape[0]))

    def moe_experts(x, gate_ups, downs, tok, perm, starts, counts, out):
        return None

    for op, fn in (("gemv_bf16", gemv), ("gemm_bf16", gemv), ("expert_mlp_bf16", expert), ("experts_mlp_bf16", experts),
                   ("moe_experts_bf16", moe_experts)):
        qualname = f"moe_offload::{op}"
        try:
            register_fake(qualname, fn)
        except RuntimeError:  # already registered in this process (a second build variant)
            pass
    _register_quant_fakes(register_fake)
    _register_decode_fakes(register_fake)
