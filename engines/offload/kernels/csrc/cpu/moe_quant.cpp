// Quantized-expert GEMV kernels for decode on the CPU: int8, FP8 e4m3 and MXFP4 weights, dequantized in registers
// (the formats and their dot products: quant.h).
//
//   x [N, K] bf16|fp32 --(one pass over the stored rows W [R, ...], fp32 accumulation, rows split over threads)-->
//   y [N, R] (x dtype). A row is read once from DRAM for all N tokens (decode batches: N = 1..MAX_N); more tokens
//   take the dequantize + GEMM path (dispatch.py).
//
//   gemv_q:        x [N, K], w, w_scale, bias [R]?, split -> [N, R]      the format from w.dtype
//   dequant_blocks: ggml blocks [.., nb, S] -> fp32 [.., K]
//   moe_experts_q: the one fused-experts entry for these formats: pairs through their experts, each weight row read
//                  once for its expert's pairs; intermediates rounded to x's dtype where the unfused path (gemv_q,
//                  torch silu, gemv_q) rounds, so a pair's row is the same in every call
//   ggml blocks take an empty scale, or an int32 input permutation [K] (an act-order GPTQ release kept as shipped,
//   loading/int4.py): row r . x[perm] (x gathered per token, or per pair with each expert's own permutation)
// Legend: N tokens, K input features, R output rows, H hidden, I expert intermediate (2I gate|up rows).
#include <atomic>
#include <type_traits>

#include "common.h"
#include "quant.h"

namespace moe_quant {

void prepare_init(int64_t n, int64_t k, char fmt, Tokens& t, int64_t qb) {
  t.n = n; t.k = k; t.kp = (k + 63) / 64 * 64; t.qb = qb;
  TORCH_CHECK(t.kp % qb == 0, "prepare: ", k, " features do not fill blocks of ", qb);
  if (fmt == 'f') { t.f.assign(n * t.kp, 0.0f); return; }
  if (fmt == 'm') { t.even.assign(n * t.kp / 2, 0.0f); t.odd.assign(n * t.kp / 2, 0.0f); return; }
  const bool vnni = fmt == 'q';  // |q| and its signs: only the int8 weights' AVX-512 dot reads them
  t.q.assign(n * t.kp, 0);
  if (vnni) { t.qabs.assign(n * t.kp, 0); t.qneg.assign(n * t.kp / 64, 0); }
  t.qs.assign(n * (t.kp / qb), 0.0f);
  if (vnni) t.qs16.assign(n * (t.kp / qb) / 2 * 16, 0.0f);
  if (fmt == 'g') t.bs16.assign(n * t.kp / 16, 0);
}

void prepare_row(const float* v, int64_t i, char fmt, Tokens& t) {
  const int64_t k = t.k, kp = t.kp, qb = t.qb;
  if (fmt == 'f') { std::memcpy(t.f.data() + i * kp, v, k * sizeof(float)); return; }
  if (fmt == 'm') {
    for (int64_t j = 0; j < k / 2; ++j) { t.even[i * kp / 2 + j] = v[2 * j]; t.odd[i * kp / 2 + j] = v[2 * j + 1]; }
    return;
  }
  // int8: per qb-block symmetric; x / s rounded half to even (torch.round), as the test's reference does; the padding
  // past k stays zero
  const int64_t nb = kp / qb;
  const bool vnni = fmt == 'q';
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * qb, hi = std::min(k, lo + qb);
    float amax = 0.0f;
    for (int64_t j = lo; j < hi; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float s = amax / 127.0f;
    t.qs[i * nb + b] = s;
    for (int64_t j = lo; j < hi; ++j) {
      int q = s > 0.0f ? (int)std::nearbyint(v[j] / s) : 0;
      q = std::max(-127, std::min(127, q));
      const int64_t at = i * kp + j;
      t.q[at] = (int8_t)q;
      if (vnni) {
        t.qabs[at] = (uint8_t)std::abs(q);
        if (q < 0) t.qneg[at / 64] |= uint64_t(1) << (at % 64);
      }
    }
    if (vnni)
      for (int64_t l = 0; l < 8; ++l) t.qs16[(i * nb / 2 + b / 2) * 16 + (b % 2) * 8 + l] = s;
  }
  if (fmt == 'g')
    for (int64_t j = 0; j < kp; ++j) t.bs16[(i * kp + j) / 16] = int16_t(t.bs16[(i * kp + j) / 16] + t.q[i * kp + j]);
}

// row[j] = f(src[perm[j]]) for j < k; false if an entry is outside 0..k-1 (that row then partly zero)
template <typename S, typename F>
bool permuted(const S* src, const int32_t* perm, int64_t k, float* row, F f) {
  bool ok = true;
  for (int64_t j = 0; j < k; ++j) {
    const uint32_t at = uint32_t(perm[j]);
    ok &= at < uint64_t(k);
    row[j] = at < uint64_t(k) ? f(src[at]) : 0.0f;
  }
  return ok;
}

bool gather_row(const at::Tensor& x, int64_t i, int64_t k, const int32_t* perm, float* row) {
  if (x.scalar_type() == at::kBFloat16) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(x.data_ptr()) + i * k;
    if (!perm) { for (int64_t j = 0; j < k; ++j) row[j] = bf2f(p[j]); return true; }
    return permuted(p, perm, k, row, [](uint16_t v) { return bf2f(v); });
  }
  const float* p = x.data_ptr<float>() + i * k;
  if (!perm) { std::memcpy(row, p, k * sizeof(float)); return true; }
  return permuted(p, perm, k, row, [](float v) { return v; });
}

void prepare(const at::Tensor& x, int64_t n, int64_t k, char fmt, Tokens& t, int64_t qb) {
  prepare_init(n, k, fmt, t, qb);
  std::vector<float> row(k);
  for (int64_t i = 0; i < n; ++i) {
    gather_row(x, i, k, nullptr, row.data());
    prepare_row(row.data(), i, fmt, t);
  }
}

void prepare(const at::Tensor& x, int64_t n, int64_t k, const Weight& W, Tokens& t) {
  prepare_init(n, k, W.fmt, t, W.fmt == 'g' ? W.gl.act : QB);
  std::vector<float> row(k);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(gather_row(x, i, k, W.perm, row.data()), "act-order permutation: an entry outside 0..", k - 1);
    prepare_row(row.data(), i, W.fmt, t);
  }
}

// out[i, r] for rows [begin, end): fp32 results (+bias), written as the output dtype
template <typename Out>
void rows_range(const Weight& W, const Tokens& t, const float* bias, int64_t begin, int64_t end, Out* out, int64_t out_ld) {
  rows_tokens(W, begin, end, t, nullptr, t.n, [&](int64_t i, int64_t r, float v) {
    v += bias ? bias[r] : 0.0f;
    if constexpr (std::is_same<Out, float>::value) out[i * out_ld + r] = v; else out[i * out_ld + r] = f2bf(v);
  });
}

Weight weight_of(const at::Tensor& w, const at::Tensor& s, int64_t split, const char* what) {
  TORCH_CHECK(w.device().is_cpu() && (w.dim() == 2 || w.scalar_type() == at::kBits8) && w.stride(-1) == 1, what,
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
  } else if (st == at::kBits8) {
    TORCH_CHECK(w.dim() == 3 && moe_blocks::layout_of(w.size(2), W.gl) && w.stride(2) == 1 && w.stride(1) == w.size(2), what,
                ": expected ggml blocks [R, nb, S] with S the bytes of a q8_0, q4_0, q4_1, q5_0, q5_1, q4_z, mxfp4, nvfp4, "
                "q4_k, q5_k, q6_k, iq4_xs, q2_k or q3_k block (34, 18, 20, 22, 24, 19, 17, 36, 144, 176, 210, 136, 84, 110), rows of "
                "contiguous blocks, got ",
                w.sizes(), " strides ", w.strides());
    W.fmt = 'g'; W.k = w.size(1) * W.gl.block;
    if (s.numel() > 0 && s.scalar_type() == at::kFloat) {  // an NVFP4 release's scale per row (loading/nvfp4.py)
      TORCH_CHECK(s.device().is_cpu() && s.dim() == 1 && s.numel() == W.rows && s.is_contiguous(), what,
                  ": ggml blocks take an fp32 scale per row [", W.rows, "] (NVFP4), got ", s.sizes());
      W.rs = s.data_ptr<float>();
    } else if (s.numel() > 0) {  // an act-order 4-bit release's input permutation (loading/int4.py)
      TORCH_CHECK(s.device().is_cpu() && s.scalar_type() == at::kInt && s.dim() == 1 && s.numel() == W.k && s.is_contiguous(),
                  what, ": ggml blocks take no scale, an int32 input permutation [", W.k, "] (act-order) or an fp32 scale "
                  "per row [", W.rows, "] (NVFP4), got ", s.scalar_type(), " ", s.sizes());
      W.perm = s.data_ptr<int32_t>();
    }
  } else {
    TORCH_CHECK(false, what, ": expected int8, float8_e4m3fn, uint8 (mxfp4 blocks) or bits8 (ggml blocks) weights, got ", st);
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
  prepare(xc, xc.numel() / W.k, W.k, W, t);
  std::vector<float> b = bias_of(bias, W.rows, "gemv_q bias");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = W.rows;
  at::Tensor out = at::empty(shape, x.options());
  run_rows(W, t, b, out);
  return out;
}

// gate_up [2I, H] and down [H, I] as stored, checked against each other; int8, fp8, mxfp4 (as gpt-oss ships it) or
// ggml blocks
void expert_pair(const at::Tensor& up, const at::Tensor& up_s, const at::Tensor& dn, const at::Tensor& dn_s, const char* what,
                 Weight& U, Weight& D) {
  TORCH_CHECK(up.scalar_type() == dn.scalar_type(), what, ": expected int8, fp8, mxfp4 or ggml block "
              "gate_up and down of one dtype, got ", up.scalar_type(), " and ", dn.scalar_type());
  D = weight_of(dn, dn_s, 0, "down");
  U = weight_of(up, up_s, D.k, "gate_up");
  TORCH_CHECK(U.rows == 2 * D.k && U.k == D.rows, what, ": expected gate_up [2I, H] and down [H, I] with H=", D.rows, " I=",
              D.k, ", got ", up.sizes(), " and ", dn.sizes());
}

// Experts' gate|up and down as stored, checked: one dtype, shape and block type per projection across the experts
void expert_set(at::TensorList ups, at::TensorList up_s, at::TensorList dns, at::TensorList dn_s, const char* what,
                std::vector<Weight>& U, std::vector<Weight>& D) {
  const int64_t K = (int64_t)ups.size();
  TORCH_CHECK(K >= 1 && up_s.size() == ups.size() && dns.size() == ups.size() && dn_s.size() == ups.size(), what,
              ": expected as many gate_ups, gate_up scales, downs and down scales (>= 1), got ", ups.size(), ", ",
              up_s.size(), ", ", dns.size(), ", ", dn_s.size());
  U.resize(K); D.resize(K);
  for (int64_t k = 0; k < K; ++k) {
    expert_pair(ups[k], up_s[k], dns[k], dn_s[k], what, U[k], D[k]);
    TORCH_CHECK(ups[k].scalar_type() == ups[0].scalar_type() && D[k].rows == D[0].rows && D[k].k == D[0].k
                && U[k].gl.type == U[0].gl.type && D[k].gl.type == D[0].gl.type && !U[k].perm == !U[0].perm
                && !D[k].perm == !D[0].perm && !U[k].rs == !U[0].rs && !D[k].rs == !D[0].rs, what,
                ": expected experts of one dtype, shape and block type (act-order permutations on all or none, row "
                "scales on all or none), got ", ups[k].scalar_type(), " ", ups[k].sizes(),
                " after ", ups[0].scalar_type(), " ", ups[0].sizes());
  }
}

// Per-expert biases and the gate of a layer's experts (Gate{} : silu on a concatenated gate|up, no biases; gate 1:
// gpt-oss's clamped SwiGLU over interleaved gate|up rows, bf16 tokens only, as clamped_swiglu_bf16 rounds it)
struct Gate {
  std::vector<std::vector<float>> ub, db;  // by expert of the call, or empty
  int64_t gate = 0;
  float alpha = 0.0f, limit = 0.0f;
};

Gate gate_of(const std::optional<at::TensorList>& ub, const std::optional<at::TensorList>& db, int64_t gate, double alpha,
             double limit, int64_t J, int64_t I2, int64_t H, bool bf, const char* what) {
  TORCH_CHECK(gate == 0 || (gate == 1 && bf), what, ": gate: expected 0 (silu) or, with bf16 tokens, 1 (gpt-oss), got ", gate);
  TORCH_CHECK((!ub.has_value() || (int64_t)ub->size() == J) && (!db.has_value() || (int64_t)db->size() == J), what,
              ": expected one bias per expert");
  Gate g;
  g.gate = gate; g.alpha = float(alpha); g.limit = float(limit);
  for (int64_t j = 0; ub.has_value() && j < J; ++j) g.ub.push_back(bias_of((*ub)[j], I2, "gate_up bias"));
  for (int64_t j = 0; db.has_value() && j < J; ++j) g.db.push_back(bias_of((*db)[j], H, "down bias"));
  return g;
}

// P routed pairs through their experts (``gate``: silu on a concatenated gate|up or gpt-oss's, biases or none) in two
// parallel passes, one over every expert's gate|up rows and one over every expert's down rows; expert j takes pairs
// [first[j], first[j+1]), pair p reads prepared token xi[p] of t and writes out row oi[p] (x's dtype, H wide). Each
// weight row is read from memory once for all of its expert's pairs; each pair's numbers are those of the unfused
// chain (gemv_q, silu or (biased, gpt-oss) clamped_swiglu_bf16, gemv_q) for that token alone (the same prepared x,
// row dots, bias adds, roundings and prepared h: prepare quantizes each token on its own).
void pairs_mlp(const std::vector<Weight>& U, const std::vector<Weight>& D, const std::vector<int64_t>& first,
               const at::Tensor& x, const int64_t* xi, const int64_t* oi, bool bf, void* out, const Gate& gt = Gate{}) {
  const int64_t J = (int64_t)U.size(), H = D[0].rows, I = D[0].k, I2 = 2 * I, P = first[J];
  std::vector<int64_t> expert(P);  // pair -> its expert
  for (int64_t j = 0; j < J; ++j) std::fill(expert.begin() + first[j], expert.begin() + first[j + 1], j);
  // x prepared for the gate|up rows: each token once, or (act-order experts, whose inputs each expert permutes its
  // own way) each pair's token gathered by its expert's permutation; pair p then reads row xi[p], else row p
  Tokens t;
  std::vector<int64_t> pi(P);  // pair p reads row p (the permuted tokens, below the prepared h)
  for (int64_t p = 0; p < P; ++p) pi[p] = p;
  if (!U[0].perm) {
    prepare(x, x.numel() / H, H, U[0], t);
  } else {
    prepare_init(P, H, U[0].fmt, t, U[0].gl.act);
    std::atomic<bool> ok{true};
    at::parallel_for(0, P, 1, [&](int64_t b, int64_t e) {
      std::vector<float> row(H);
      for (int64_t p = b; p < e; ++p) {
        if (!gather_row(x, xi[p], H, U[expert[p]].perm, row.data())) ok = false;
        prepare_row(row.data(), p, U[0].fmt, t);
      }
    });
    TORCH_CHECK(ok, "act-order permutation of gate_up: an entry outside 0..", H - 1);
    xi = pi.data();
  }
  std::vector<float> gu(P * I2);  // fp32 results, rounded below exactly as rows_range's output dtype would be
  Tokens th;  // h per pair, prepared for the down rows
  prepare_init(P, I, D[0].fmt, th, D[0].fmt == 'g' ? D[0].gl.act : QB);
  std::atomic<bool> ok{true};
  // expert j's gate|up rows [r0, r1) for its pairs
  auto up_rows = [&](int64_t j, int64_t r0, int64_t r1) {
    const float* bias = gt.ub.empty() ? nullptr : gt.ub[j].data();  // added as rows_range adds it
    rows_tokens(U[j], r0, r1, t, xi + first[j], first[j + 1] - first[j],
                [&](int64_t q, int64_t r, float v) { gu[(first[j] + q) * I2 + r] = bias ? v + bias[r] : v; });
  };
  // h = silu(gate) * up of pair p, rounded where torch's ops on x's dtype round (after silu, after the product), and
  // prepared for the down rows (h, hp: the caller's scratch of I floats, hp for an act-order down's gather)
  auto gate_pair = [&](int64_t p, std::vector<float>& h, std::vector<float>& hp) {
    if (gt.gate == 1) {  // gpt-oss (bf16 only): gate = even rows, up = odd; op by op as torch rounds in bf16
      for (int64_t i = 0; i < I; ++i) {
        float g = bf2f(f2bf(gu[p * I2 + 2 * i])), u = bf2f(f2bf(gu[p * I2 + 2 * i + 1]));
        g = std::min(g, gt.limit);
        u = std::min(std::max(u, -gt.limit), gt.limit);
        const float tg = bf2f(f2bf(g * gt.alpha));
        const float sg = bf2f(f2bf(1.0f / (1.0f + std::exp(-tg))));
        const float glu = bf2f(f2bf(g * sg));
        h[i] = bf2f(f2bf(bf2f(f2bf(u + 1.0f)) * glu));
      }
    } else {
      for (int64_t i = 0; i < I; ++i) {
        float g = gu[p * I2 + i], u = gu[p * I2 + I + i];
        if (bf) { g = bf2f(f2bf(g)); u = bf2f(f2bf(u)); }
        const float s = g / (1.0f + std::exp(-g));
        h[i] = bf ? bf2f(f2bf(bf2f(f2bf(s)) * u)) : s * u;
      }
    }
    if (const int32_t* perm = D[expert[p]].perm) {  // act-order down: h gathered as its rows read it
      if (!permuted(h.data(), perm, I, hp.data(), [](float v) { return v; })) ok = false;
      prepare_row(hp.data(), p, D[0].fmt, th);
    } else {
      prepare_row(h.data(), p, D[0].fmt, th);
    }
  };
  // expert j's down rows [r0, r1) for its pairs, written to the output
  auto down_rows = [&](int64_t j, int64_t r0, int64_t r1) {
    const float* bias = gt.db.empty() ? nullptr : gt.db[j].data();
    rows_tokens(D[j], r0, r1, th, pi.data() + first[j], first[j + 1] - first[j], [&](int64_t q, int64_t r, float v) {
      const int64_t o = oi[first[j] + q] * H + r;
      if (bias) v += bias[r];
      if (bf) reinterpret_cast<uint16_t*>(out)[o] = f2bf(v); else reinterpret_cast<float*>(out)[o] = v;
    });
  };
  bool one_each = true;
  for (int64_t j = 0; j < J; ++j) one_each &= first[j + 1] - first[j] == 1;
  if (moe_cpu::whole_experts_ok(J, one_each)) {
    // a decode step's experts, one pair each, dividing evenly among the threads: whole experts per thread, no
    // barrier between the passes (moe.cpp's whole_experts; the same rows, gates and roundings: bit-identical)
    at::parallel_for(0, J, 1, [&](int64_t b, int64_t e) {
      std::vector<float> h(I), hp(D[0].perm ? I : 0);
      for (int64_t j = b; j < e; ++j) {
        up_rows(j, 0, I2);
        gate_pair(first[j], h, hp);
        down_rows(j, 0, H);
      }
    });
  } else {
    const int64_t avg = std::max<int64_t>(1, P / J);
    at::parallel_for(0, J * I2, std::max<int64_t>(1, grain(U[0].ld) / avg), [&](int64_t b, int64_t e) {
      while (b < e) {  // a task may span experts: split it at expert boundaries
        const int64_t j = b / I2, stop = std::min(e, (j + 1) * I2);
        up_rows(j, b - j * I2, stop - j * I2);
        b = stop;
      }
    });
    at::parallel_for(0, P, 1, [&](int64_t b, int64_t e) {  // the gates: pairs split over the threads
      std::vector<float> h(I), hp(D[0].perm ? I : 0);
      for (int64_t p = b; p < e; ++p) gate_pair(p, h, hp);
    });
    at::parallel_for(0, J * H, std::max<int64_t>(1, grain(D[0].ld) / avg), [&](int64_t b, int64_t e) {
      while (b < e) {
        const int64_t j = b / H, stop = std::min(e, (j + 1) * H);
        down_rows(j, b - j * H, stop - j * H);
        b = stop;
      }
    });
  }
  TORCH_CHECK(ok, "act-order permutation of down: an entry outside 0..", I - 1);
}

// A step's routed pairs through their experts, one call per layer and tier (moe_experts_bf16's contract for the
// quantized formats): expert j takes the pairs s in [starts[j], starts[j] + counts[j]) of the expert-sorted pair
// list, pair s reading token x[tok[s]] and writing out[perm[s]]; each pair's numbers are the same in every call,
// so a token's result does not depend on the others in the step.
void moe_experts_q(const at::Tensor& x, at::TensorList ups, at::TensorList up_s, at::TensorList dns, at::TensorList dn_s,
                   const at::Tensor& tok, const at::Tensor& perm, at::IntArrayRef starts, at::IntArrayRef counts,
                   const at::Tensor& out, std::optional<at::TensorList> up_biases, std::optional<at::TensorList> down_biases,
                   int64_t gate, double alpha, double limit) {
  const int64_t J = (int64_t)ups.size();
  TORCH_CHECK(J == (int64_t)starts.size() && J == (int64_t)counts.size(), "moe_experts_q: expected as many gate_ups, ",
              "starts and counts, got ", J, ", ", starts.size(), ", ", counts.size());
  if (J == 0) return;
  std::vector<Weight> U, D;
  expert_set(ups, up_s, dns, dn_s, "moe_experts_q", U, D);
  const int64_t H = D[0].rows;
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) && x.dim() == 2
              && x.size(1) == H && x.is_contiguous(), "moe_experts_q x: expected contiguous bf16 or fp32 CPU tokens [T, ",
              H, "], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == x.scalar_type() && out.dim() == 2 && out.size(1) == H
              && out.is_contiguous(), "moe_experts_q out: expected a contiguous CPU tensor [S, ", H, "] of x's dtype, got ",
              out.scalar_type(), " ", out.sizes());
  TORCH_CHECK(tok.scalar_type() == at::kLong && perm.scalar_type() == at::kLong && tok.is_contiguous() && perm.is_contiguous()
              && tok.numel() == perm.numel(), "moe_experts_q: expected int64 tok and perm of the same length");
  const int64_t* tp = tok.data_ptr<int64_t>();
  const int64_t* pp = perm.data_ptr<int64_t>();
  const int64_t S = tok.numel(), T = x.size(0), R = out.size(0);
  std::vector<int64_t> first(J + 1, 0);
  for (int64_t j = 0; j < J; ++j) {
    TORCH_CHECK(starts[j] >= 0 && counts[j] >= 0 && starts[j] + counts[j] <= S, "moe_experts_q: pair range ", j, " out of bounds");
    first[j + 1] = first[j] + counts[j];
  }
  std::vector<int64_t> xi(first[J]), oi(first[J]);
  for (int64_t j = 0; j < J; ++j)
    for (int64_t q = 0; q < counts[j]; ++q) {
      const int64_t s = starts[j] + q;
      TORCH_CHECK(tp[s] >= 0 && tp[s] < T && pp[s] >= 0 && pp[s] < R, "moe_experts_q: token or output row out of range");
      xi[first[j] + q] = tp[s];
      oi[first[j] + q] = pp[s];
    }
  const bool bf = x.scalar_type() == at::kBFloat16;
  pairs_mlp(U, D, first, x, xi.data(), oi.data(), bf, out.data_ptr(),
            gate_of(up_biases, down_biases, gate, alpha, limit, J, 2 * D[0].k, H, bf, "moe_experts_q"));
}

// ggml blocks [.., nb, S] -> the fp32 weights [.., nb * B] they mean (blocks.h's decode; the prefill / fp32 path)
at::Tensor dequant_blocks(const at::Tensor& w) {
  moe_blocks::Layout L;
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kBits8 && w.dim() >= 2 && moe_blocks::layout_of(w.size(-1), L),
              "dequant_blocks: expected ggml blocks [.., nb, S] (bits8, S = 34, 18, 20, 22, 24, 19, 17, 36, 144, 176, 210, 136, 84 or 110 "
              "bytes) on the CPU, got ", w.scalar_type(), " ", w.sizes(), " on ", w.device());
  at::Tensor wc = w.contiguous();
  std::vector<int64_t> shape(w.sizes().begin(), w.sizes().end() - 1);
  shape.back() *= L.block;
  at::Tensor out = at::empty(shape, at::TensorOptions().dtype(at::kFloat));
  const int64_t blocks = wc.numel() / L.bytes;
  const uint8_t* src = reinterpret_cast<const uint8_t*>(wc.data_ptr());
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, blocks, 256, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) moe_blocks::dequant_block(L.type, L.block, src + i * L.bytes, dst + i * L.block);
  });
  return out;
}

}  // namespace moe_quant
