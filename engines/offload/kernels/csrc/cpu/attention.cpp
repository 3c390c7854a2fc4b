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
// AVX512-BF16 run the same blocks as scalar loops (attention_tiles.h; correct, not fast: kv.py calls the kernel only
// where it is fast).
// Legend: T query rows, L context positions, Hq/Hk query/KV heads, D/Dv key/value head dims, QB/KB block sizes.
#include "attention_tiles.h"
#include "common.h"

namespace moe_cpu {

namespace {

using namespace attn;

constexpr int64_t QB = 32;  // query rows per task (8 groups of 4)

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
    float mx = m[r];
    const float sum = exp_tile(s[r], a, b, scale, mx, p[r]);
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
