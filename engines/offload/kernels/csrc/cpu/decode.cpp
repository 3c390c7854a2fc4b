// Fused decode kernels: a decoder layer's attention half and router in one call (Layer.decode, layer.h), for bf16 models
// on the CPU.
//
//   h [M, H] (+ add [M, H], the previous layer's MLP output)
//     -> RMSNorm -> q/k/v projections (one parallel pass over the rows of all three) -> q/k norms -> rotary
//     -> k, v rows written to the paged pool at each token's position -> attention over its context (GQA,
//        optional sliding window) -> o_proj -> residual -> RMSNorm -> router: softmax, top-k (renormalised)
//     -> h2 [M, H] (the residual stream), x2 [M, H] (the MLP's input), top-k ids [M, K] int64, weights [M, K]
//
// Why: a one-token decode step of a 16-layer MoE in transformers' modules is ~1500 small torch ops (norms in 6-7
// ops, rotary, dtype copies, the cache update, the attention's set-up), each a few microseconds: ~9 ms of a 19 ms
// step on a 2-core CPU, where the weight reads take ~10 ms. Here one call per layer does all of it; the experts stay
// with the offload executor (tiers, fetches, statistics).
//
// Numbers: every intermediate is rounded to bf16 where the module path rounds (after each norm, projection, rotary
// product and sum, attention output, residual add, router logits), the projections use the same dot products as
// gemm_bf16 (bit-identical rows), and attention sums in fp32 as kv._decode_fp32 does (its summation order differs:
// results agree to bf16 rounding, not bit for bit). Tested against the module path.
//
// One token per row of h: M sequences each decoding one token; token t is at position lens[t] - 1 and its context is
// positions [0, lens[t]) of the sequence whose pool rows are blocks[t, p / bs] * bs + p % bs.
// rmsnorm_bf16 is the model's final norm, as the layer computes its norms. Arguments: ops.py.
// Legend: M tokens, H hidden, Hq/Hkv query/KV heads, D head dim, RD rotary dims, R pool rows, NB blocks per sequence,
// bs block size, E experts, K top-k.
#include "layer.h"

#include <c10/util/Float8_e4m3fn.h>

namespace moe_cpu {

namespace {

void check_bf16(const at::Tensor& t, int64_t numel, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.is_contiguous() && (numel < 0 || t.numel() == numel),
              what, ": expected a contiguous bf16 CPU tensor", numel >= 0 ? " of the right size" : "", ", got ",
              t.scalar_type(), " ", t.sizes());
}

const uint16_t* opt_vec(const std::optional<at::Tensor>& t, int64_t n, const char* what) {
  if (!t.has_value()) return nullptr;
  check_bf16(*t, n, what);
  return ptr(*t);
}

// the same, in place over a bf16 vector (q/k norms)
inline void rmsnorm_inplace(uint16_t* v, const uint16_t* w, int64_t n, double eps, int64_t norm_mode) {
  std::vector<float> f(n);
  for (int64_t j = 0; j < n; ++j) f[j] = bf2f(v[j]);
  rmsnorm_row(f.data(), w, n, eps, v, norm_mode);
}

// The k largest of v[0..n) as torch.topk picks them on the CPU (ATen's TopKImpl.h): (value, index) pairs in index
// order, partial_sort when k * 64 <= n, else nth_element and a sort of the first k - 1, with the same comparator.
// Equal values then come out in the same order as on the module path (ties are common in bf16 router logits).
inline void torch_topk(const float* v, int64_t n, int64_t k, std::vector<std::pair<float, int64_t>>& q) {
  q.resize(n);
  for (int64_t j = 0; j < n; ++j) q[j] = {v[j], j};
  auto greater = [](const std::pair<float, int64_t>& x, const std::pair<float, int64_t>& y) {
    return (std::isnan(x.first) && !std::isnan(y.first)) || (x.first > y.first);
  };
  if (k * 64 <= n) {
    std::partial_sort(q.begin(), q.begin() + k, q.end(), greater);
  } else {
    std::nth_element(q.begin(), q.begin() + k - 1, q.end(), greater);
    std::sort(q.begin(), q.begin() + k - 1, greater);
  }
}

// rows [begin, end) of the stacked matrices (a row index below cut[0] reads ws[0], ...): out[t, i] for M tokens,
// each matrix's part through gemm_range (the rows gemm_bf16 computes, bit for bit)
void stacked_rows(const std::vector<const uint16_t*>& ws, const std::vector<int64_t>& lds,
                  const std::vector<const uint16_t*>& bs, const std::vector<int64_t>& cut,
                  const uint16_t* x, int64_t M, int64_t n, int64_t begin, int64_t end, uint16_t* out, int64_t N) {
  int64_t lo = 0;
  for (size_t m = 0; m < cut.size(); lo = cut[m++]) {
    const int64_t b = std::max(begin, lo), e = std::min(end, cut[m]);
    if (b < e) gemm_range(ws[m], lds[m], x, n, M, n, bs[m], b - lo, e - lo, out + lo, N);
  }
}

void project(const std::vector<const uint16_t*>& ws, const std::vector<int64_t>& lds, const std::vector<const uint16_t*>& bs,
             const std::vector<int64_t>& cut, const uint16_t* x, int64_t M, int64_t n, uint16_t* out) {
  const int64_t N = cut.back();
  at::parallel_for(0, N, std::max<int64_t>(1, grain(n) / M), [&](int64_t s, int64_t e) {
    stacked_rows(ws, lds, bs, cut, x, M, n, s, e, out, N);
  });
}

// the same with int8 weights (per-row fp32 scales) or ggml blocks (quant.h): activations quantized per token as
// gemv_q does for each weight's format, each output exactly gemv_q's (same row dots, bias added in fp32, one rounding)
void project_q(const std::vector<moe_quant::Weight>& ws, const std::vector<const uint16_t*>& bs,
               const std::vector<int64_t>& cut, const uint16_t* x, int64_t M, int64_t n, uint16_t* out) {
  at::Tensor xt = at::empty({M, n}, at::TensorOptions().dtype(at::kBFloat16));  // prepare() reads a tensor
  std::memcpy(xt.data_ptr(), x, M * n * sizeof(uint16_t));
  std::vector<moe_quant::Tokens> prepared(ws.size());  // one per weight whose x preparation differs from the previous
  std::vector<const moe_quant::Tokens*> tw(ws.size());
  for (size_t m = 0; m < ws.size(); ++m) {
    const bool same = m > 0 && ws[m].fmt == ws[m - 1].fmt && ws[m].gl.act == ws[m - 1].gl.act && ws[m].perm == ws[m - 1].perm;
    if (!same) moe_quant::prepare(xt, M, n, ws[m], prepared[m]);
    tw[m] = same ? tw[m - 1] : &prepared[m];
  }
  const int64_t N = cut.back();
  at::parallel_for(0, N, std::max<int64_t>(1, moe_quant::grain(ws[0].ld) / M), [&](int64_t s, int64_t e) {
    size_t m = 0;
    int64_t lo = 0;
    for (int64_t i = s; i < e;) {  // rows of one weight at a time
      while (i >= cut[m]) lo = cut[m++];
      const int64_t stop = std::min(e, cut[m]);
      moe_quant::rows_tokens(ws[m], i - lo, stop - lo, *tw[m], nullptr, M, [&](int64_t tok, int64_t r, float v) {
        out[tok * N + lo + r] = f2bf(v + (bs[m] ? bf2f(bs[m][r]) : 0.0f));
      });
      i = stop;
    }
  });
}

void check_w(const at::Tensor& w, int64_t rows, int64_t cols, const char* what) {
  check_weight(w, what);
  TORCH_CHECK(w.size(0) == rows && w.size(1) == cols, what, ": expected [", rows, ", ", cols, "], got ", w.sizes());
}

}  // namespace

// ---- layer.h: what a layer kernel other than attention shares with this one -----------------------------------------

Proj proj_of(const at::Tensor& w, const std::optional<at::Tensor>& scale, int64_t rows, int64_t cols, const char* what) {
  Proj p;
  if (scale.has_value()) {
    TORCH_CHECK((w.scalar_type() == at::kChar && w.dim() == 2) || w.scalar_type() == at::kBits8, what,
                ": expected int8 [", rows, ", ", cols, "] with its scales or ggml blocks, got ", w.scalar_type(), " ",
                w.sizes());
    p.q = true;
    p.qw = moe_quant::weight_of(w, *scale, 0, what);
    TORCH_CHECK(p.qw.rows == rows && p.qw.k == cols, what, ": expected [", rows, ", ", cols, "] weights, got ", w.sizes());
  } else {
    check_w(w, rows, cols, what);
    p.w = ptr(w);
    p.ld = w.stride(0);
  }
  return p;
}

void project_all(const std::vector<Proj>& ps, const std::vector<int64_t>& cut, const uint16_t* x, int64_t M, int64_t n,
                 uint16_t* out) {
  const bool q = ps[0].q;
  TORCH_CHECK(std::all_of(ps.begin(), ps.end(), [&](const Proj& p) { return p.q == q; }),
              "project_all: expected every projection bf16, or every one int8 rows / ggml blocks");
  std::vector<const uint16_t*> bs;
  for (const Proj& p : ps) bs.push_back(p.bias);
  if (q) {
    std::vector<moe_quant::Weight> ws;
    for (const Proj& p : ps) ws.push_back(p.qw);
    project_q(ws, bs, cut, x, M, n, out);
  } else {
    std::vector<const uint16_t*> ws;
    std::vector<int64_t> lds;
    for (const Proj& p : ps) { ws.push_back(p.w); lds.push_back(p.ld); }
    project(ws, lds, bs, cut, x, M, n, out);
  }
}

// rows t < M: h_out = bf16(h + add) (add null: h), x = its norm with ln (the fp32 sum, rounded once, is what the norm
// reads); scale != 1 (a residual multiplier): h + bf16(add * scale), the product rounded first as the module's op is
static void add_norm_rows(const uint16_t* hp, const uint16_t* ap, int64_t M, int64_t H, const uint16_t* ln, double eps,
                          int64_t norm_mode, uint16_t* h_out, uint16_t* x, double scale) {
  std::vector<float> f(H);
  const float s = static_cast<float>(scale);
  const bool one = scale == 1.0;
  for (int64_t t = 0; t < M; ++t) {
    for (int64_t j = 0; j < H; ++j) {
      const float a = ap ? (one ? bf2f(ap[t * H + j]) : rbf(bf2f(ap[t * H + j]) * s)) : 0.0f;
      const float v = ap ? rbf(bf2f(hp[t * H + j]) + a) : bf2f(hp[t * H + j]);
      h_out[t * H + j] = f2bf(v);
      f[j] = v;
    }
    rmsnorm_row(f.data(), ln, H, eps, x + t * H, norm_mode);
  }
}

at::Tensor residual_norm(const at::Tensor& h, const std::optional<at::Tensor>& add, const at::Tensor& ln, double eps,
                         int64_t norm_mode, std::vector<uint16_t>& x, double scale) {
  TORCH_CHECK(h.dim() == 2, "h: expected [M, H], got ", h.sizes());
  check_bf16(h, -1, "h");
  const int64_t M = h.size(0), H = h.size(1);
  if (add.has_value()) check_bf16(*add, M * H, "add");
  check_bf16(ln, H, "norm weight");
  at::Tensor h_in = at::empty({M, H}, h.options());
  x.resize(M * H);
  add_norm_rows(ptr(h), add.has_value() ? ptr(*add) : nullptr, M, H, ptr(ln), eps, norm_mode,
                reinterpret_cast<uint16_t*>(h_in.data_ptr()), x.data(), scale);
  return h_in;
}

void check_router(const std::optional<at::Tensor>& wr, int64_t H, int64_t top_k) {
  if (!wr.has_value()) return;
  check_weight(*wr, "wr");
  TORCH_CHECK(wr->size(1) == H && top_k >= 1 && top_k <= wr->size(0), "wr: expected [E, ", H, "] and 1 <= top_k <= E");
}

std::vector<at::Tensor> layer_tail(const at::Tensor& h_in, const uint16_t* o, const at::Tensor& ln2, double eps,
                                   int64_t norm_mode, const std::optional<at::Tensor>& wr,
                                   const std::optional<at::Tensor>& rb, int64_t top_k, bool norm_topk, bool w_bf16,
                                   int64_t router_mode, double scale) {
  const int64_t M = h_in.size(0), H = h_in.size(1), E = wr.has_value() ? wr->size(0) : 0;
  at::Tensor h2 = at::empty({M, H}, h_in.options());
  at::Tensor x2 = at::empty({M, H}, h_in.options());
  uint16_t* x2p = reinterpret_cast<uint16_t*>(x2.data_ptr());
  add_norm_rows(ptr(h_in), o, M, H, ptr(ln2), eps, norm_mode, reinterpret_cast<uint16_t*>(h2.data_ptr()), x2p, scale);

  // router: logits (bf16, as F.linear rounds) -> softmax in fp32 -> top-k -> renormalise -> bf16
  at::Tensor ids = at::empty({wr.has_value() ? M : 0, top_k}, h_in.options().dtype(at::kLong));
  at::Tensor wts = at::empty({wr.has_value() ? M : 0, top_k}, w_bf16 ? h_in.options() : h_in.options().dtype(at::kFloat));
  if (wr.has_value()) {
    std::vector<uint16_t> logits(M * E);
    project({ptr(*wr)}, {wr->stride(0)}, {opt_vec(rb, E, "router bias")}, {E}, x2p, M, H, logits.data());
    int64_t* ip = ids.data_ptr<int64_t>();
    uint16_t* wp = w_bf16 ? reinterpret_cast<uint16_t*>(wts.data_ptr()) : nullptr;
    float* wf = w_bf16 ? nullptr : wts.data_ptr<float>();
    std::vector<float> pr(E);
    std::vector<std::pair<float, int64_t>> top;
    for (int64_t t = 0; t < M && router_mode == 1; ++t) {  // top-k of the logits, then softmax over those (gpt-oss)
      for (int64_t e = 0; e < E; ++e) pr[e] = bf2f(logits[t * E + e]);
      torch_topk(pr.data(), E, top_k, top);
      float mx = top[0].first, sum = 0.0f;
      for (int64_t k = 1; k < top_k; ++k) mx = std::max(mx, top[k].first);
      for (int64_t k = 0; k < top_k; ++k) sum += std::exp(top[k].first - mx);
      for (int64_t k = 0; k < top_k; ++k) {
        ip[t * top_k + k] = top[k].second;
        const float v = std::exp(top[k].first - mx) / sum;
        if (wp) wp[t * top_k + k] = f2bf(v); else wf[t * top_k + k] = v;
      }
    }
    for (int64_t t = 0; t < M && router_mode == 0; ++t) {  // softmax over all experts, top-k, renormalised or not
      float mx = -std::numeric_limits<float>::infinity(), sum = 0.0f;
      for (int64_t e = 0; e < E; ++e) mx = std::max(mx, bf2f(logits[t * E + e]));
      for (int64_t e = 0; e < E; ++e) { pr[e] = std::exp(bf2f(logits[t * E + e]) - mx); sum += pr[e]; }
      for (int64_t e = 0; e < E; ++e) pr[e] /= sum;
      torch_topk(pr.data(), E, top_k, top);
      float tot = 0.0f;
      for (int64_t k = 0; k < top_k; ++k) tot += top[k].first;
      for (int64_t k = 0; k < top_k; ++k) {
        ip[t * top_k + k] = top[k].second;
        const float v = norm_topk ? top[k].first / tot : top[k].first;
        if (wp) wp[t * top_k + k] = f2bf(v); else wf[t * top_k + k] = v;
      }
    }
  }
  return {h2, x2, ids, wts};
}

int64_t norm_code(const std::string& kind) {
  if (kind == "rms") return 0;
  if (kind == "rms_fp32_scale") return 1;
  TORCH_CHECK(kind == "rms_one_plus", "norm: expected rms, rms_fp32_scale or rms_one_plus, got ", kind);
  return 2;
}

int64_t router_code(const std::string& order) {
  TORCH_CHECK(order == "score_then_topk" || order == "topk_then_score",
              "router order: expected score_then_topk or topk_then_score, got ", order);
  return order == "topk_then_score";
}

// A quantized KV cache's rows (runtime/kv.py quantize / dequantize, the same float operations in the same order, so
// the module path and this one read the same numbers): per (row, head) s = amax * (1 / QMAX) (1 for an all-zero head),
// codes = clamp(x / s, +-QMAX) rounded (int8: to nearest even; fp8: e4m3fn), values = bf16(code * s).
enum KvKind : int { KV_BF16 = 0, KV_INT8 = 1, KV_FP8 = 2 };

static float kv_qmax(int kind) { return kind == KV_INT8 ? 127.0f : 448.0f; }

static const float* fp8_values() {  // the 256 e4m3fn codes as floats
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = float(c10::Float8_e4m3fn(uint8_t(i), c10::Float8_e4m3fn::from_bits()));
    return t;
  }();
  return table.data();
}

static void kv_quantize(const uint16_t* x, int64_t D, int kind, uint8_t* codes, float* scale) {
  const float qmax = kv_qmax(kind);
  float amax = 0.0f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(bf2f(x[d])));
  float s = amax * float(1.0 / double(qmax));  // as torch multiplies by a Python float
  if (s == 0.0f) s = 1.0f;
  for (int64_t d = 0; d < D; ++d) {
    const float y = std::min(std::max(bf2f(x[d]) / s, -qmax), qmax);
    codes[d] = kind == KV_INT8 ? uint8_t(int8_t(std::nearbyint(y))) : c10::Float8_e4m3fn(y).x;
  }
  *scale = s;
}

static const uint16_t* kv_dequantize(const uint8_t* q, float s, int64_t D, int kind, uint16_t* out) {
  const int64_t done = codes_to_bf16(q, kind == KV_FP8, s, D, out);  // vec.h: 16 at a time where the ISA has it
  if (kind == KV_INT8) {
    for (int64_t d = done; d < D; ++d) out[d] = f2bf(float(int8_t(q[d])) * s);
  } else {
    const float* f = fp8_values();
    for (int64_t d = done; d < D; ++d) out[d] = f2bf(f[q[d]] * s);
  }
  return out;
}

static int kv_kind(const at::Tensor& pool, const std::optional<at::Tensor>& scale, int64_t R, int64_t Hkv, const char* what) {
  TORCH_CHECK(pool.is_contiguous(), what, ": expected a contiguous pool");
  const auto t = pool.scalar_type();
  if (t == at::kBFloat16) {
    TORCH_CHECK(!scale.has_value(), what, ": bf16 rows take no scales");
    return KV_BF16;
  }
  TORCH_CHECK(t == at::kChar || t == at::kByte, what, ": expected bf16 rows, int8 codes or fp8 bits (uint8), got ", t);
  TORCH_CHECK(scale.has_value() && scale->scalar_type() == at::kFloat && scale->is_contiguous() && scale->dim() == 2 &&
                  scale->size(0) == R && scale->size(1) == Hkv,
              what, ": a quantized pool needs fp32 scales [", R, ", ", Hkv, "] (Layer.kv_scales)");
  return t == at::kChar ? KV_INT8 : KV_FP8;
}

int64_t rope_code(const std::string& kind) {  // halves and partial: rotate_half over cos / sin as the caller lays them
  if (kind == "rotate_half" || kind == "halves" || kind == "partial") return 0;
  TORCH_CHECK(kind == "interleaved_fp32", "rotary: expected rotate_half, halves, partial or interleaved_fp32, got ", kind);
  return 1;
}

std::vector<at::Tensor> Layer::decode(const T& h, const OT& add, const T& cos, const T& sin, const T& blocks,
                                      const T& lens) {
  TORCH_CHECK(wq.defined() && kpool.defined() && wo.defined() && ln1.defined(),
              "Layer.decode: expected .norms, .attention, .pools and .output first");
  const int64_t top_k = wr.has_value() ? this->top_k : 0;
  TORCH_CHECK(h.dim() == 2, "Layer.decode h: expected [M, H], got ", h.sizes());
  const int64_t M = h.size(0), H = h.size(1);
  check_bf16(ln2, H, "ln2");
  TORCH_CHECK(kpool.dim() == 3 && vpool.dim() == 3, "kpool/vpool: expected [R, Hkv, D]");
  const int64_t R = kpool.size(0), Hkv = kpool.size(1), D = kpool.size(2), Dv = vpool.size(2);
  TORCH_CHECK(vpool.size(0) == R && vpool.size(1) == Hkv && Dv == D, "vpool: expected the shape of kpool ", kpool.sizes(),
              ", got ", vpool.sizes());
  const int kind = kv_kind(kpool, kscale, R, Hkv, "kpool");
  TORCH_CHECK(kv_kind(vpool, vscale, R, Hkv, "vpool") == kind, "vpool: expected the dtype of kpool");
  const bool q8 = sq.has_value();  // int8 q/k/v/o with per-row scales, or ggml blocks (empty scales): all four, or none
  TORCH_CHECK(q8 == sk.has_value() && q8 == sv.has_value() && q8 == so.has_value(),
              "sq/sk/sv/so: expected all four scales (int8 or ggml-block q/k/v/o) or none");
  TORCH_CHECK(wq.dim() == 2 || (wq.scalar_type() == at::kBits8 && wq.dim() == 3), "wq: expected 2-D (or ggml blocks), got ", wq.sizes());
  // gated (Qwen3-Next): wq's rows are per head [q (D) | gate (D)]; the attention output is scaled by sigmoid(gate)
  const int64_t Nqp = wq.size(0), Nq = gated ? Nqp / 2 : Nqp, Nk = Hkv * D, Hq = Nq / D;
  TORCH_CHECK(Nq % D == 0 && Hq % Hkv == 0 && (!gated || Nqp % 2 == 0), "wq: ", Nqp, " rows are not ",
              gated ? "twice " : "", "a multiple of ", Hkv, " KV heads of ", D);
  const std::optional<at::Tensor> none;
  std::vector<Proj> pqkv = {proj_of(wq, q8 ? sq : none, Nqp, H, "wq"), proj_of(wk, q8 ? sk : none, Nk, H, "wk"),
                            proj_of(wv, q8 ? sv : none, Nk, H, "wv")};
  Proj po = proj_of(wo, q8 ? so : none, H, Nq, "wo");
  pqkv[0].bias = opt_vec(bq, Nqp, "bq");
  pqkv[1].bias = opt_vec(bk, Nk, "bk");
  pqkv[2].bias = opt_vec(bv, Nk, "bv");
  po.bias = opt_vec(bo, H, "bo");
  const uint16_t* qnp = opt_vec(qn, -1, "qn");
  const uint16_t* knp = opt_vec(kn, -1, "kn");
  const int64_t qnw = qn.has_value() ? qn->numel() : 0, knw = kn.has_value() ? kn->numel() : 0;
  TORCH_CHECK(qnw == 0 || qnw == D || qnw == Nq, "qn: expected ", D, " or ", Nq, " elements, got ", qnw);
  TORCH_CHECK(knw == 0 || knw == D || knw == Nk, "kn: expected ", D, " or ", Nk, " elements, got ", knw);
  // rotary over the first R dims of each head (R = D, or partial rotary), rotate_half within them; interleaved_fp32: over
  // interleaved pairs (2j, 2j + 1) of all D dims in fp32, cos/sin fp32 [M, D / 2] (pair j's angle)
  const int64_t RD = cos.dim() != 2 ? -1 : rope_mode == 1 ? 2 * cos.size(1) : cos.size(1);
  TORCH_CHECK(RD > 0 && RD <= D && RD % 2 == 0 && cos.size(0) == M && (rope_mode == 0 || RD == D), "cos: expected [M, R] ",
              "with R even and <= ", D, " (interleaved_fp32: [M, ", D / 2, "]), got ", cos.sizes());
  if (rope_mode == 0) {
    check_bf16(cos, M * RD, "cos");
    check_bf16(sin, M * RD, "sin");
  } else {
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                sin.is_contiguous() && sin.numel() == M * RD / 2, "interleaved_fp32: expected contiguous fp32 cos and sin [M, ",
                RD / 2, "]");
  }
  TORCH_CHECK(blocks.scalar_type() == at::kLong && blocks.dim() == 2 && blocks.size(0) == M && blocks.is_contiguous(),
              "blocks: expected contiguous int64 [M, NB]");
  TORCH_CHECK(lens.scalar_type() == at::kLong && lens.numel() == M && lens.is_contiguous(), "lens: expected int64 [M]");
  TORCH_CHECK(bs >= 1, "bs: expected >= 1");
  const int64_t NB = blocks.size(1);
  const int64_t* bp = blocks.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t t = 0; t < M; ++t) {
    TORCH_CHECK(lp[t] >= 1 && lp[t] <= NB * bs, "lens[", t, "] = ", lp[t], " outside [1, ", NB * bs, "]");
    for (int64_t b = 0; b < (lp[t] + bs - 1) / bs; ++b)
      TORCH_CHECK(bp[t * NB + b] >= 0 && (bp[t * NB + b] + 1) * bs <= R, "blocks[", t, ", ", b, "] outside the pool");
  }
  check_router(wr, H, top_k);

  // residual in, first norm
  std::vector<uint16_t> x1;
  at::Tensor h_in = residual_norm(h, add, ln1, eps, norm_mode, x1, res);

  // q (| gate), k, v in one pass over their rows; gated: each row's q heads then moved before its gate heads
  const int64_t N3 = Nqp + 2 * Nk;
  std::vector<uint16_t> qkv(M * N3);
  project_all(pqkv, {Nqp, Nqp + Nk, N3}, x1.data(), M, H, qkv.data());
  if (gated) {
    std::vector<uint16_t> row(Nqp);
    for (int64_t t = 0; t < M; ++t) {
      uint16_t* q = qkv.data() + t * N3;
      std::memcpy(row.data(), q, Nqp * sizeof(uint16_t));
      for (int64_t a = 0; a < Hq; ++a) {
        std::memcpy(q + a * D, row.data() + 2 * a * D, D * sizeof(uint16_t));
        std::memcpy(q + Nq + a * D, row.data() + (2 * a + 1) * D, D * sizeof(uint16_t));
      }
    }
  }

  // q/k norms, rotary (q*cos + rotate_half(q)*sin, each product and the sum rounded), k/v into the pool
  uint16_t* kp = reinterpret_cast<uint16_t*>(kpool.data_ptr());  // bf16 rows (kind KV_BF16)
  uint16_t* vp = reinterpret_cast<uint16_t*>(vpool.data_ptr());
  uint8_t* kc = reinterpret_cast<uint8_t*>(kpool.data_ptr());  // codes (a quantized cache)
  uint8_t* vc = reinterpret_cast<uint8_t*>(vpool.data_ptr());
  float* ksp = kind != KV_BF16 ? kscale->data_ptr<float>() : nullptr;
  float* vsp = kind != KV_BF16 ? vscale->data_ptr<float>() : nullptr;
  const int64_t half = RD / 2;
  std::vector<uint16_t> tmp(RD);
  auto rope_half = [&](uint16_t* v, const uint16_t* c, const uint16_t* s) {
    for (int64_t d = 0; d < RD; ++d) {
      const float rot = d < half ? -bf2f(v[d + half]) : bf2f(v[d - half]);
      tmp[d] = f2bf(rbf(bf2f(v[d]) * bf2f(c[d])) + rbf(rot * bf2f(s[d])));
    }
    std::memcpy(v, tmp.data(), RD * sizeof(uint16_t));
  };
  // token t's rotary of one head: bf16 cos/sin rows of RD, or (interleaved_fp32) fp32 rows of RD / 2
  auto rope = [&](uint16_t* v, int64_t t) {
    if (rope_mode == 1)
      rope_pairs_fp32(v, cos.data_ptr<float>() + t * half, sin.data_ptr<float>() + t * half, half);
    else
      rope_half(v, ptr(cos) + t * RD, ptr(sin) + t * RD);
  };
  for (int64_t t = 0; t < M; ++t) {
    uint16_t* q = qkv.data() + t * N3;
    uint16_t* k = q + Nqp;
    uint16_t* v = k + Nk;
    // a norm of D values is per head (with one head, D == the whole projection: normalised once, not twice)
    if (qnw == Nq && qnw != D) rmsnorm_inplace(q, qnp, Nq, eps, norm_mode);
    if (knw == Nk && knw != D) rmsnorm_inplace(k, knp, Nk, eps, norm_mode);
    for (int64_t a = 0; a < Hq; ++a) {
      if (qnw == D) rmsnorm_inplace(q + a * D, qnp, D, eps, norm_mode);
      rope(q + a * D, t);
    }
    for (int64_t a = 0; a < Hkv; ++a) {
      if (knw == D) rmsnorm_inplace(k + a * D, knp, D, eps, norm_mode);
      rope(k + a * D, t);
    }
    const int64_t p = lp[t] - 1, row = bp[t * NB + p / bs] * bs + p % bs;
    if (kind == KV_BF16) {
      std::memcpy(kp + row * Nk, k, Nk * sizeof(uint16_t));
      std::memcpy(vp + row * Nk, v, Nk * sizeof(uint16_t));
    } else {
      for (int64_t a = 0; a < Hkv; ++a) {
        kv_quantize(k + a * D, D, kind, kc + (row * Hkv + a) * D, ksp + row * Hkv + a);
        kv_quantize(v + a * D, D, kind, vc + (row * Hkv + a) * D, vsp + row * Hkv + a);
      }
    }
  }

  // attention: one task per (token, KV head, slice of its query heads), so each key and value row is read once for
  // all the query heads that share it (GQA) and a long context streams its KV once per layer; the heads are sliced
  // only when there are fewer (token, KV head) pairs than threads. Per head: scores, softmax and the weighted sum in
  // fp32, in position order (a head's numbers do not depend on the slicing).
  std::vector<uint16_t> attn(M * Nq);
  const int64_t groups = Hq / Hkv;
  const uint16_t* skp = opt_vec(sinks, Hq, "sinks");
  const float score_mul = skp ? 1.0f : float(scaling);  // with sinks the scaling is applied (and rounded) below
  const int64_t slices = std::min<int64_t>(groups, std::max<int64_t>(1, (at::get_num_threads() + M * Hkv - 1) / (M * Hkv)));
  const int64_t per = (groups + slices - 1) / slices;
  at::parallel_for(0, M * Hkv * slices, 1, [&](int64_t b, int64_t e) {
    std::vector<float> sc, o, qbuf;
    std::vector<uint16_t> rbuf(D);  // a quantized cache: the row dequantized
    for (int64_t u = b; u < e; ++u) {
      const int64_t t = u / (Hkv * slices), g = (u / slices) % Hkv, a0 = g * groups + (u % slices) * per;
      const int64_t a1 = std::min(a0 + per, (g + 1) * groups), G = a1 - a0, L = lp[t];
      if (G <= 0) continue;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, L - window) : 0, n = L - lo;
      const xval* q = as_x(qkv.data() + t * N3 + a0 * D, G * D, qbuf);  // G query heads, consecutive (vec.h)
      const int64_t* tb = bp + t * NB;
      sc.assign(G * n, 0.0f);
      o.assign(G * D, 0.0f);
      // KV rows of one head are D values every Hkv * D: a stride the hardware prefetcher follows badly, so each
      // row PF_ROWS positions ahead is requested in software (2048 positions from DRAM: 530 -> 233 us per layer)
      auto row_of = [&](int64_t l) { return (tb[l / bs] * bs + l % bs) * Hkv + g; };
      // a quantized cache: row l's codes dequantized into rbuf (bf16, as the module path reads them)
      auto deq = [&](const uint8_t* codes, const float* sp, int64_t l) -> const uint16_t* {
        const int64_t r = row_of(l);
        if (l + PF_ROWS < L) prefetch_row(reinterpret_cast<const uint16_t*>(codes + row_of(l + PF_ROWS) * D), (D + 1) / 2);
        return kv_dequantize(codes + r * D, sp[r], D, kind, rbuf.data());
      };
      if (kind == KV_BF16) {
        for (int64_t l = lo; l < L; ++l) {
          if (l + PF_ROWS < L) prefetch_row(kp + row_of(l + PF_ROWS) * D, D);
          const uint16_t* kr = kp + row_of(l) * D;
          for (int64_t h = 0; h < G; ++h) sc[h * n + l - lo] = dot_row_x(kr, q + h * D, D) * score_mul;
        }
      } else {
        for (int64_t l = lo; l < L; ++l) {
          const uint16_t* kr = deq(kc, ksp, l);
          for (int64_t h = 0; h < G; ++h) sc[h * n + l - lo] = dot_row_x(kr, q + h * D, D) * score_mul;
        }
      }
      if (skp == nullptr) {
        for (int64_t h = 0; h < G; ++h) softmax_row(sc.data() + h * n, n);
      } else {  // attention sinks, as the module path's eager bf16 attention rounds: scores, shift, probabilities
        for (int64_t h = 0; h < G; ++h) {
          float* sh = sc.data() + h * n;
          const float sink = bf2f(skp[a0 + h]);
          float mx = sink, sum = 0.0f;
          for (int64_t i = 0; i < n; ++i) {
            sh[i] = rbf(rbf(sh[i]) * float(scaling));  // the bf16 matmul's rounding, then the bf16 scaling
            mx = std::max(mx, sh[i]);
          }
          for (int64_t i = 0; i < n; ++i) { sh[i] = std::exp(rbf(sh[i] - mx)); sum += sh[i]; }
          sum += std::exp(rbf(sink - mx));
          for (int64_t i = 0; i < n; ++i) sh[i] = rbf(sh[i] / sum);
        }
      }
      if (kind == KV_BF16) {
        for (int64_t l = lo; l < L; ++l) {
          if (l + PF_ROWS < L) prefetch_row(vp + row_of(l + PF_ROWS) * D, D);
          const uint16_t* vr = vp + row_of(l) * D;
          for (int64_t h = 0; h < G; ++h) axpy_bf16(o.data() + h * D, sc[h * n + l - lo], vr, D);
        }
      } else {
        for (int64_t l = lo; l < L; ++l) {
          const uint16_t* vr = deq(vc, vsp, l);
          for (int64_t h = 0; h < G; ++h) axpy_bf16(o.data() + h * D, sc[h * n + l - lo], vr, D);
        }
      }
      uint16_t* out = attn.data() + t * Nq + a0 * D;
      for (int64_t i = 0; i < G * D; ++i) out[i] = f2bf(o[i]);
    }
  });

  // gated: attention output * sigmoid(gate), each rounded to bf16 as the module's ops round
  if (gated)
    for (int64_t t = 0; t < M; ++t)
      for (int64_t i = 0; i < Nq; ++i) {
        uint16_t& a = attn[t * Nq + i];
        const float g = bf2f(qkv[t * N3 + Nq + i]);
        a = f2bf(bf2f(a) * rbf(1.0f / (1.0f + std::exp(-g))));
      }

  // o_proj, then residual, second norm, router
  std::vector<uint16_t> o(M * H);
  project_all({po}, {H}, attn.data(), M, Nq, o.data());
  return layer_tail(h_in, o.data(), ln2, eps, norm_mode, wr, rb, top_k, norm_topk, w_bf16, router_mode, res);
}

at::Tensor norm_rows(const at::Tensor& h, const std::optional<at::Tensor>& add, const at::Tensor& w, double eps,
                     int64_t norm_mode, double scale) {
  std::vector<uint16_t> x;
  residual_norm(h, add, w, eps, norm_mode, x, scale);  // the layer's head without its residual
  at::Tensor y = at::empty({h.size(0), h.size(1)}, h.options());
  std::memcpy(y.data_ptr(), x.data(), x.size() * sizeof(uint16_t));
  return y;
}

at::Tensor rmsnorm_bf16(const at::Tensor& h, const std::optional<at::Tensor>& add, const at::Tensor& w, double eps,
                        const std::string& norm) {
  return norm_rows(h, add, w, eps, norm_code(norm), 1.0);
}

}  // namespace moe_cpu
