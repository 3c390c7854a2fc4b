// A gated-DeltaNet layer's decode step between its two input projections and its output projection (Qwen3-Next's
// linear attention and the families that copy it), one token per sequence:
//
//   qkvz [B, Hk * (2 Dk + 2 r Dv)], ba [B, Hk * 2r]    the in_proj_qkvz / in_proj_ba outputs, per key head g:
//                                                      q_g k_g v_g z_g and b_g a_g (r = Hv / Hk value heads each)
//     or (plain: Qwen3.5's separate projections) qkvz = [q | k | v | z], ba = [b | a], each part whole
//   -> causal conv over [conv_state | q k v] (C = 2 Hk Dk + Hv Dv channels, K taps, fp32 weights), silu, bf16;
//      conv_state shifted by one (mutated)
//   -> per value head h (key head h / r): q, k l2-normalised (q also / sqrt(Dk)), beta = sigmoid(b), decay =
//      exp(-exp(A_log) * softplus(a + dt_bias));  S *= decay;  delta = (v - S^T k) * beta;  S += k delta^T;
//      o = S^T q  (S [Dk, Dv] fp32, the recurrent state, mutated)
//   -> gated RMSNorm: bf16(w * bf16(o / rms(o))) * silu(z), bf16
//   -> out [B, Hv * Dv] bf16, the out_proj's input
//   slots [B] (optional): conv_state / state are pools of seats [S, ...] and row b's live in seat slots[b] (the paged
//   engine's per-sequence states, kv.KVPool.states_of); without, [B, ...] in row order
//
// Why: the module runs this as ~70 torch ops per layer and token (the split and re-layout of the projections, the
// convolution update, the fp32 casts, l2 norms, the recurrent rule's broadcasts, the gated norm); on a 2-core host
// that was a quarter of a Qwen3-Next decode step. Here it is one call over (sequence, value head).
//
// Numbers: the module's dtypes at each step (bf16 where it rounds to bf16, fp32 inside the convolution, the rule and
// the norm), its operation order within an element (products rounded before they are added, no FMA contraction);
// its sums over Dk and over Dv are vectorized reductions whose order differs, so results agree to fp32 rounding in
// the state and bf16 rounding in the output, not bit for bit (tests/engines/offload/kernels/test_deltanet.py).
// Legend: B sequences, Hk / Hv key / value heads, r = Hv / Hk, Dk / Dv key / value head dims, C conv channels,
// K conv taps.
#include "layer.h"

namespace moe_cpu {

namespace {

float silu(float x) { return x / (1.0f + std::exp(-x)); }

float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }  // torch's threshold 20, beta 1

void check(const at::Tensor& t, at::ScalarType dtype, int64_t dim, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.dim() == dim && t.is_contiguous(),
              "gated_delta_decode_bf16 ", what, ": expected a contiguous ", dim, "-d ", dtype, " CPU tensor, got ",
              t.scalar_type(), " ", t.sizes());
}

}  // namespace

__attribute__((optimize("fp-contract=off"))) at::Tensor gated_delta_decode_bf16(
    const at::Tensor& qkvz, const at::Tensor& ba, const at::Tensor& conv_state, const at::Tensor& conv_w,
    const std::optional<at::Tensor>& conv_b, const at::Tensor& state, const at::Tensor& a_log, const at::Tensor& dt_bias,
    const at::Tensor& norm_w, double eps, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv,
    const std::optional<at::Tensor>& slots, bool plain) {
  TORCH_CHECK(Hk >= 1 && Hv >= 1 && Hv % Hk == 0 && Dk >= 1 && Dv >= 1,
              "gated_delta_decode_bf16: expected value heads a multiple of key heads, got Hk=", Hk, " Hv=", Hv);
  const int64_t r = Hv / Hk, W = 2 * Dk + 2 * r * Dv, key_dim = Hk * Dk, C = 2 * key_dim + Hv * Dv;
  check(qkvz, at::kBFloat16, 2, "qkvz");
  const int64_t B = qkvz.size(0);
  TORCH_CHECK(qkvz.size(1) == Hk * W, "gated_delta_decode_bf16 qkvz: expected [", B, ", ", Hk * W, "], got ", qkvz.sizes());
  check(ba, at::kBFloat16, 2, "ba");
  TORCH_CHECK(ba.size(0) == B && ba.size(1) == 2 * Hv, "gated_delta_decode_bf16 ba: expected [", B, ", ", 2 * Hv, "]");
  check(conv_state, at::kBFloat16, 3, "conv_state");
  check(conv_w, at::kFloat, 2, "conv_w");
  const int64_t K = conv_w.size(1);
  const int64_t seats = conv_state.size(0);
  std::vector<int64_t> seat(B);
  if (slots.has_value()) {
    check(*slots, at::kLong, 1, "slots");
    TORCH_CHECK(slots->size(0) == B, "gated_delta_decode_bf16 slots: expected [", B, "], got ", slots->sizes());
    for (int64_t b = 0; b < B; ++b) {
      seat[b] = slots->data_ptr<int64_t>()[b];
      TORCH_CHECK(seat[b] >= 0 && seat[b] < seats && state.size(0) == seats, "gated_delta_decode_bf16 slots: seat ",
                  seat[b], " outside the pools' ", seats);
      for (int64_t a = 0; a < b; ++a) TORCH_CHECK(seat[a] != seat[b], "gated_delta_decode_bf16 slots: seat ", seat[b], " twice");
    }
  } else {
    TORCH_CHECK(seats == B, "gated_delta_decode_bf16 conv_state: expected ", B, " rows, got ", seats);
    for (int64_t b = 0; b < B; ++b) seat[b] = b;
  }
  TORCH_CHECK(conv_w.size(0) == C && K >= 1 && conv_state.size(1) == C && conv_state.size(2) == K,
              "gated_delta_decode_bf16: expected conv_w [", C, ", K] and conv_state [S, ", C, ", K], got ",
              conv_w.sizes(), " and ", conv_state.sizes());
  if (conv_b.has_value()) {
    check(*conv_b, at::kFloat, 1, "conv_b");
    TORCH_CHECK(conv_b->size(0) == C, "gated_delta_decode_bf16 conv_b: expected [", C, "]");
  }
  check(state, at::kFloat, 4, "state");
  TORCH_CHECK(state.size(0) == seats && state.size(1) == Hv && state.size(2) == Dk && state.size(3) == Dv,
              "gated_delta_decode_bf16 state: expected [", seats, ", ", Hv, ", ", Dk, ", ", Dv, "], got ", state.sizes());
  check(a_log, at::kFloat, 1, "A_log");  // the module's A_log.float(); dt_bias promoted to fp32 beside a.float()
  check(dt_bias, at::kFloat, 1, "dt_bias");
  check(norm_w, at::kBFloat16, 1, "norm weight");
  TORCH_CHECK(a_log.size(0) == Hv && dt_bias.size(0) == Hv && norm_w.size(0) == Dv,
              "gated_delta_decode_bf16: expected A_log and dt_bias [", Hv, "] and the norm weight [", Dv, "]");

  const uint16_t* xp = ptr(qkvz);
  const uint16_t* bap = ptr(ba);
  uint16_t* cs = reinterpret_cast<uint16_t*>(conv_state.data_ptr());
  const float* cw = conv_w.data_ptr<float>();
  const float* cb = conv_b.has_value() ? conv_b->data_ptr<float>() : nullptr;
  float* S = state.data_ptr<float>();
  const float* al = a_log.data_ptr<float>();
  const float* dtb = dt_bias.data_ptr<float>();
  const uint16_t* nw = ptr(norm_w);
  at::Tensor out = at::empty({B, Hv * Dv}, qkvz.options());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  std::vector<uint16_t> mixed(B * C);  // the convolution's output, bf16 as the module rounds it

  // channel c of q | k | v in qkvz's per-key-head layout (plain: in place)
  auto source = [&](int64_t c) -> int64_t {
    if (plain) return c;
    if (c < 2 * key_dim) {
      const int64_t part = c / key_dim, i = c % key_dim;  // 0: q, 1: k
      return (i / Dk) * W + part * Dk + i % Dk;
    }
    const int64_t i = c - 2 * key_dim;
    return (i / (r * Dv)) * W + 2 * Dk + i % (r * Dv);
  };
  at::parallel_for(0, B * C, 256, [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n) {
      const int64_t b = n / C, c = n % C;
      uint16_t* st = cs + (seat[b] * C + c) * K;
      const float x = bf2f(xp[b * Hk * W + source(c)]);
      // F.conv1d over [state | x] (K + 1 columns), the last output: taps j over columns 1 + j
      float acc = cb ? cb[c] : 0.0f;
      for (int64_t j = 0; j < K; ++j) {
        const float v = j + 1 < K ? bf2f(st[j + 1]) : x;
        const float p = cw[c * K + j] * v;
        acc += p;
      }
      for (int64_t j = 0; j + 1 < K; ++j) st[j] = st[j + 1];
      st[K - 1] = f2bf(x);
      mixed[n] = f2bf(silu(acc));
    }
  });

  const float qscale = std::sqrt(float(Dk));
  at::parallel_for(0, B * Hv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> q(Dk), k(Dk), o(Dv), kv(Dv);
    for (int64_t n = lo; n < hi; ++n) {
      const int64_t b = n / Hv, h = n % Hv, g = h / r, hh = h % r;
      const uint16_t* m = mixed.data() + b * C;
      // l2norm (fp32, as the rule's use_qk_l2norm_in_kernel) of the key head's q and k; q also / sqrt(Dk)
      float sq = 0.0f, sk = 0.0f;
      for (int64_t i = 0; i < Dk; ++i) {
        q[i] = bf2f(m[g * Dk + i]);
        k[i] = bf2f(m[key_dim + g * Dk + i]);
        sq += q[i] * q[i];
        sk += k[i] * k[i];
      }
      const float iq = 1.0f / std::sqrt(sq + 1e-6f), ik = 1.0f / std::sqrt(sk + 1e-6f);
      for (int64_t i = 0; i < Dk; ++i) {
        q[i] = (q[i] * iq) / qscale;
        k[i] = k[i] * ik;
      }
      const uint16_t* bag = plain ? bap + b * 2 * Hv + h : bap + b * 2 * Hv + g * 2 * r + hh;  // b; a r (plain: Hv) on
      const float beta = bf2f(f2bf(1.0f / (1.0f + std::exp(-bf2f(bag[0])))));  // sigmoid of bf16 b, rounded
      const float gl = -std::exp(al[h]) * softplus(bf2f(bag[plain ? Hv : r]) + dtb[h]);
      const float decay = std::exp(gl);
      float* s = S + (seat[b] * Hv + h) * Dk * Dv;  // [Dk, Dv]
      const uint16_t* v = m + 2 * key_dim + h * Dv;
      std::fill(kv.begin(), kv.end(), 0.0f);
      for (int64_t i = 0; i < Dk; ++i) {
        float* row = s + i * Dv;
        for (int64_t j = 0; j < Dv; ++j) {
          row[j] = row[j] * decay;
          const float p = row[j] * k[i];
          kv[j] += p;
        }
      }
      for (int64_t j = 0; j < Dv; ++j) kv[j] = (bf2f(v[j]) - kv[j]) * beta;  // delta
      std::fill(o.begin(), o.end(), 0.0f);
      for (int64_t i = 0; i < Dk; ++i) {
        float* row = s + i * Dv;
        for (int64_t j = 0; j < Dv; ++j) {
          const float p = k[i] * kv[j];
          row[j] = row[j] + p;
          const float pq = row[j] * q[i];
          o[j] += pq;
        }
      }
      // gated RMSNorm over the head's Dv values (the output rounded to bf16 first, as the rule returns it)
      float ss = 0.0f;
      for (int64_t j = 0; j < Dv; ++j) {
        o[j] = bf2f(f2bf(o[j]));
        ss += o[j] * o[j];
      }
      const float inv = 1.0f / std::sqrt(ss / float(Dv) + float(eps));
      const uint16_t* z = plain ? xp + b * Hk * W + C + h * Dv : xp + b * Hk * W + g * W + 2 * Dk + r * Dv + hh * Dv;
      uint16_t* dst = op + b * Hv * Dv + h * Dv;
      for (int64_t j = 0; j < Dv; ++j) {
        const float y = bf2f(f2bf(bf2f(nw[j]) * bf2f(f2bf(o[j] * inv))));
        dst[j] = f2bf(y * silu(bf2f(z[j])));
      }
    }
  });
  return out;
}

// A gated-DeltaNet decoder layer's decode step in one call (Qwen3-Next's linear-attention layers in the fused decode
// path, model/fastpath.py), as Layer.decode is a softmax-attention layer's:
//   h (+ add) -> residual, norm -> the input projections w_in stacked (Qwen3-Next: in_proj_qkvz, in_proj_ba; plain:
//   in_proj_qkv, in_proj_z, in_proj_b, in_proj_a; their first n_qkvz columns are qkvz, the rest ba) -> the step above
//   -> out_proj -> residual, norm, the fused router -> {h2, x2, ids, weights}
// s_in: the projections' scales (int8 rows / ggml blocks), by position, or empty (bf16).
std::vector<at::Tensor> Layer::decode_linear(const T& h, const OT& add, const T& conv_state, const T& state,
                                             const OT& slots) {
  TORCH_CHECK(delta.has_value() && ln1.defined() && wo.defined(), "Layer.decode_linear: expected .norms, .linear and "
              ".output first");
  TORCH_CHECK(h.dim() == 2, "Layer.decode_linear h: expected [M, H], got ", h.sizes());
  const Delta& d = *delta;
  const int64_t M = h.size(0), H = h.size(1), top_k = wr.has_value() ? this->top_k : 0;
  const int64_t Hv = d.dims[1], Dv = d.dims[3];
  TORCH_CHECK(!d.w_in.empty() && (d.s_in.empty() || d.s_in.size() == d.w_in.size()),
              "Layer.linear: expected the input projections and, for int8 / ggml blocks, their scales by position");
  TORCH_CHECK(ln2.numel() == H, "Layer.decode_linear ln2: expected ", H, " elements");
  check_router(wr, H, top_k);
  std::vector<Proj> ps;
  std::vector<int64_t> cut;
  for (size_t m = 0; m < d.w_in.size(); ++m) {
    const int64_t rows = d.w_in[m].size(0);  // ggml blocks: [rows, blocks, bytes]
    ps.push_back(proj_of(d.w_in[m], d.s_in.empty() ? std::nullopt : std::optional<at::Tensor>(d.s_in[m]), rows, H, "w_in"));
    cut.push_back((cut.empty() ? 0 : cut.back()) + rows);
  }
  const int64_t N = cut.back(), n_qkvz = d.n_qkvz;
  TORCH_CHECK(n_qkvz > 0 && n_qkvz < N, "Layer.linear n_qkvz: expected in (0, ", N, "), got ", n_qkvz);
  Proj po = proj_of(wo, so, H, Hv * Dv, "wo");

  std::vector<uint16_t> x;
  at::Tensor h_in = residual_norm(h, add, ln1, eps, norm_mode, x, res);
  std::vector<uint16_t> all(M * N);
  project_all(ps, cut, x.data(), M, H, all.data());
  at::Tensor qkvz = at::empty({M, n_qkvz}, h.options()), ba = at::empty({M, N - n_qkvz}, h.options());
  for (int64_t t = 0; t < M; ++t) {
    std::memcpy(reinterpret_cast<uint16_t*>(qkvz.data_ptr()) + t * n_qkvz, all.data() + t * N, n_qkvz * sizeof(uint16_t));
    std::memcpy(reinterpret_cast<uint16_t*>(ba.data_ptr()) + t * (N - n_qkvz), all.data() + t * N + n_qkvz,
                (N - n_qkvz) * sizeof(uint16_t));
  }
  at::Tensor core = gated_delta_decode_bf16(qkvz, ba, conv_state, d.conv_w, d.conv_b, state, d.a_log, d.dt_bias,
                                            d.norm_w, d.norm_eps, d.dims[0], Hv, d.dims[2], Dv, slots, d.plain);
  std::vector<uint16_t> o(M * H);
  project_all({po}, {H}, ptr(core), M, Hv * Dv, o.data());
  return layer_tail(h_in, o.data(), ln2, eps, norm_mode, wr, std::nullopt, top_k, norm_topk, w_bf16, 0, res);
}

}  // namespace moe_cpu
