// Causal attention of a prefill chunk over its sequence's context, bf16, tiled (flash attention's online softmax).
//
//   q [T, Hq, D], k [L, Hk, D], v [L, Hk, Dv] (last dim contiguous; query row t sits at position L - T + t)
//   per query head h (kv head h / (Hq / Hk)) and block of QB query rows, in parallel:
//     for each block of KB keys the block's rows can see (causal, and inside `window` when > 0):
//       s = (q . k) * scale            fp32, 4 rows x 64 keys per step of the inner kernel
//       m' = max(m, max s); p = exp(s - m'); l = l * exp(m - m') + sum p; o = o * exp(m - m') + p . v
//     out[t, h] = o / l                -> bf16
//
// Why: a long prompt's attention is quadratic; at 3,600 tokens torch's SDPA over the gathered context was ~39 % of
// the benchmark model's prefill (docs/benchmarks/prefill.md), at ~120 GFLOP/s in bf16 on two cores. Here both
// products run on vdpbf16ps from keys and values packed once per kv head in the pair-interleaved layout it reads
// (keys: 16 keys x one pair of dims per 64-byte load; values: 16 dims x one pair of keys), so no product needs a
// horizontal sum, and only the key blocks a query block can see are computed (about half of a causal square).
//
// Numbers: the scores, the running max and sum (of the fp32 p) and the output accumulate in fp32; p is rounded to
// bf16 before the product with v, as torch's own CPU flash attention does for bf16; one rounding of the output. Results agree with
// SDPA to bf16 rounding, not bit for bit (tests/engines/offload/kernels/test_attention.py). Builds without
// AVX512-BF16 run the same blocks as scalar loops (correct, not fast: kv.py calls the kernel only where it is fast).
// Legend: T query rows, L context positions, Hq/Hk query/KV heads, D/Dv key/value head dims, QB/KB block sizes.
#include "common.h"

namespace moe_cpu {

namespace {

constexpr int64_t QB = 32;  // query rows per task (8 groups of 4)
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

// keys of one kv head packed for the score kernel: kp[(b * D/2 + j) * 32 + 2 * i + c] = k[b * 16 + i, 2 * j + c]
// (b a group of 16 keys, j a pair of dims); values for the output kernel: vp[(j * Dv + d) * 2 + c] = v[2 * j + c, d]
// (j a pair of keys). Positions >= L are zeros.
void pack(const uint16_t* k, int64_t ks, const uint16_t* v, int64_t vs, int64_t L, int64_t Lp, int64_t D, int64_t Dv,
          uint16_t* kp, uint16_t* vp) {
  const int64_t P = D / 2;
  for (int64_t b = 0; b < Lp / 16; ++b)
    for (int64_t j = 0; j < P; ++j)
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t t = b * 16 + i;
        uint16_t* dst = kp + (b * P + j) * 32 + 2 * i;
        dst[0] = t < L ? k[t * ks + 2 * j] : 0;
        dst[1] = t < L ? k[t * ks + 2 * j + 1] : 0;
      }
  for (int64_t j = 0; j < Lp / 2; ++j)
    for (int64_t d = 0; d < Dv; ++d)
      for (int64_t c = 0; c < 2; ++c) {
        const int64_t t = 2 * j + c;
        vp[(j * Dv + d) * 2 + c] = t < L ? v[t * vs + d] : 0;
      }
}

// s[r][0..KB) = q_r . k_(k0 + i) for 4 rows; q rows are D bf16 each (a local copy, zero rows past the chunk)
void scores(const uint16_t* q, int64_t D, const uint16_t* kp, int64_t k0, float s[4][KB]) {
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
void accumulate(const uint16_t p[4][KB], const uint16_t* vp, int64_t k0, int64_t Dv, const float* corr, float* o) {
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

// p = exp(s * scale - m') (bf16) for keys inside [lo, hi] of each row, with the running max m and sum l updated;
// corr = exp(m - m'). A row that sees no key of the block keeps its state (corr 1, p 0).
void online_softmax(float s[4][KB], int64_t k0, const int64_t* lo, const int64_t* hi, float scale, float* m, float* l,
                    float* corr, uint16_t p[4][KB]) {
  constexpr float NEG = -std::numeric_limits<float>::infinity();
  for (int r = 0; r < 4; ++r) {
    const int64_t a = std::max<int64_t>(lo[r] - k0, 0), b = std::min<int64_t>(hi[r] - k0 + 1, KB);  // [a, b) seen
    if (a >= b) {
      corr[r] = 1.0f;
      std::memset(p[r], 0, sizeof(p[r]));
      continue;
    }
    for (int64_t i = 0; i < a; ++i) s[r][i] = NEG;
    for (int64_t i = b; i < KB; ++i) s[r][i] = NEG;
    float mx = m[r], sum = 0.0f;
#if defined(MOE_AVX512BF16)
    const __m512 vs = _mm512_set1_ps(scale);
    __m512 x[4], vmx = _mm512_set1_ps(mx);
    for (int g = 0; g < 4; ++g) {
      x[g] = _mm512_mul_ps(_mm512_loadu_ps(s[r] + g * 16), vs);
      vmx = _mm512_max_ps(vmx, x[g]);
    }
    mx = _mm512_reduce_max_ps(vmx);
    const __m512 vm = _mm512_set1_ps(mx);
    __m512 acc = _mm512_setzero_ps();
    for (int g = 0; g < 4; ++g) {
      const __m512 e = exp16(_mm512_sub_ps(x[g], vm));  // exp(-inf) = 0: keys outside [a, b)
      _mm256_storeu_si256((__m256i*)(p[r] + g * 16), (__m256i)_mm512_cvtneps_pbh(e));  // round to nearest even
      acc = _mm512_add_ps(acc, e);
    }
    sum = _mm512_reduce_add_ps(acc);
#else
    for (int64_t i = a; i < b; ++i) mx = std::max(mx, s[r][i] * scale);
    for (int64_t i = 0; i < KB; ++i) {
      const float e = i >= a && i < b ? std::exp(s[r][i] * scale - mx) : 0.0f;
      p[r][i] = f2bf(e);
      sum += e;
    }
#endif
    corr[r] = m[r] == NEG ? 0.0f : std::exp(m[r] - mx);
    l[r] = l[r] * corr[r] + sum;
    m[r] = mx;
  }
}

}  // namespace

at::Tensor prefill_attention_bf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                  int64_t window) {
  for (const auto* t : {&q, &k, &v})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kBFloat16 && t->dim() == 3 && t->stride(2) == 1 &&
                    (t->stride(1) == t->size(2) || t->size(1) == 1),
                "prefill_attention_bf16: expected bf16 CPU tensors [rows, heads, dim] with rows of whole heads, got ",
                t->scalar_type(), " ", t->sizes(), " strides ", t->strides());
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), L = k.size(0), Hk = k.size(1), Dv = v.size(2);
  TORCH_CHECK(k.size(2) == D && v.size(0) == L && v.size(1) == Hk && Hk > 0 && Hq % Hk == 0,
              "prefill_attention_bf16: q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), " do not fit together");
  TORCH_CHECK(D % 2 == 0 && Dv % 16 == 0 && T >= 1 && T <= L, "prefill_attention_bf16: expected an even D, Dv % 16 == 0 and ",
              "1 <= T <= L, got D ", D, ", Dv ", Dv, ", T ", T, ", L ", L);
  const int64_t Lp = (L + KB - 1) / KB * KB, off = L - T, groups = Hq / Hk, nb = (T + QB - 1) / QB;
  std::vector<uint16_t> kp(Hk * Lp * D), vp(Hk * Lp * Dv);
  const uint16_t *qd = ptr(q), *kd = ptr(k), *vd = ptr(v);
  at::parallel_for(0, Hk, 1, [&](int64_t b, int64_t e) {
    for (int64_t g = b; g < e; ++g)
      pack(kd + g * D, k.stride(0), vd + g * Dv, v.stride(0), L, Lp, D, Dv, kp.data() + g * Lp * D, vp.data() + g * Lp * Dv);
  });
  at::Tensor out = at::empty({T, Hq, Dv}, q.options());
  uint16_t* od = reinterpret_cast<uint16_t*>(out.data_ptr());
  // task i: head i % Hq, query block from both ends alternately (a causal block's cost grows with its position, and
  // parallel_for hands each thread a contiguous range of tasks)
  at::parallel_for(0, Hq * nb, 1, [&](int64_t b, int64_t e) {
    std::vector<uint16_t> qbuf(QB * D);
    std::vector<float> o(QB * Dv), m(QB), l(QB);
    std::vector<int64_t> lo(QB), hi(QB);
    float s[4][KB], corr[4];
    alignas(64) uint16_t p[4][KB];
    for (int64_t task = b; task < e; ++task) {
      const int64_t h = task % Hq, j = task / Hq, blk = j % 2 == 0 ? j / 2 : nb - 1 - j / 2;
      const int64_t g = h / groups, r0 = blk * QB, rows = std::min(T, r0 + QB) - r0;
      const uint16_t *kpg = kp.data() + g * Lp * D, *vpg = vp.data() + g * Lp * Dv;
      std::fill(qbuf.begin(), qbuf.end(), 0);
      std::fill(o.begin(), o.end(), 0.0f);
      for (int64_t r = 0; r < QB; ++r) {
        m[r] = -std::numeric_limits<float>::infinity();
        l[r] = 0.0f;
        hi[r] = r < rows ? off + r0 + r : -1;  // keys [lo, hi] seen; a padding row sees none
        lo[r] = r < rows && window > 0 ? std::max<int64_t>(0, hi[r] - window + 1) : 0;
        if (r < rows) std::memcpy(qbuf.data() + r * D, qd + (r0 + r) * q.stride(0) + h * D, D * 2);
      }
      // each key block once for every row group of the task (it stays in L1 across them)
      for (int64_t k0 = lo[0] / KB * KB; k0 <= hi[rows - 1]; k0 += KB) {
        for (int64_t r = 0; r < rows; r += 4) {
          if (hi[r + std::min<int64_t>(3, rows - 1 - r)] < k0 || lo[r] >= k0 + KB) continue;  // sees none of it
          scores(qbuf.data() + r * D, D, kpg, k0, s);
          online_softmax(s, k0, lo.data() + r, hi.data() + r, float(scale), m.data() + r, l.data() + r, corr, p);
          accumulate(p, vpg, k0, Dv, corr, o.data() + r * Dv);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        uint16_t* dst = od + ((r0 + r) * Hq + h) * Dv;
        const float inv = 1.0f / l[r];
        for (int64_t d = 0; d < Dv; ++d) dst[d] = f2bf(o[r * Dv + d] * inv);
      }
    }
  });
  return out;
}

}  // namespace moe_cpu
