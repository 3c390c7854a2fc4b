// DeepSeek-V3's grouped top-k selection (also GLM-4.5/4.6/4.7, dots.llm1, Kimi K2, ...): from the router's sigmoid
// scores to each token's experts and weights, in one call.
//
//   scores [M, E] fp32 (sigmoid of the router logits) + bias [E] (e_score_correction_bias) -> choice
//     -> groups: E / G experts each, a group's score = the sum of its two best choices
//     -> the topk_group best groups kept, the other groups' experts masked
//     -> the top_k best choices among the kept -> ids [M, K] int64 (best first)
//     -> weights = scores at ids (not the choice: the bias only selects), / (their sum + 1e-20) if norm_topk,
//        * scale                                                                          -> w [M, K] fp32
//
// Why: the router module is ~15 small torch ops per layer (two top-k, a scatter, a masked fill, gather, sum, two
// divides); on a 2-core CPU that is ~0.3 ms of a layer whose weights stream in ~2 ms.
// Numbers: the same fp32 operations as the module (its sum of the K weights may add in another order: the weights
// agree to one rounding; the choice of experts is the module's up to exact ties).
// Legend: M tokens, E experts, G groups, K top-k.
#include "common.h"

namespace moe_cpu {

std::vector<at::Tensor> grouped_topk(const at::Tensor& scores, const std::optional<at::Tensor>& bias, int64_t n_group,
                                     int64_t topk_group, int64_t top_k, bool norm_topk, double scale) {
  TORCH_CHECK(scores.device().is_cpu() && scores.scalar_type() == at::kFloat && scores.dim() == 2 && scores.is_contiguous(),
              "grouped_topk: scores: expected a contiguous [M, E] fp32 CPU tensor, got ", scores.scalar_type(), " ",
              scores.sizes());
  const int64_t M = scores.size(0), E = scores.size(1);
  TORCH_CHECK(n_group >= 1 && E % n_group == 0 && topk_group >= 1 && topk_group <= n_group && top_k >= 1 &&
                  top_k <= (E / n_group) * topk_group,
              "grouped_topk: ", E, " experts in ", n_group, " groups, ", topk_group, " groups kept, top-", top_k,
              " is not a valid selection");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->numel() == E && bias->is_contiguous(),
                "grouped_topk: bias: expected [E] fp32");
    b = bias->data_ptr<float>();
  }
  auto ids = at::empty({M, top_k}, scores.options().dtype(at::kLong));
  auto w = at::empty({M, top_k}, scores.options());
  const float* s = scores.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* wp = w.data_ptr<float>();
  const int64_t per = E / n_group;
  const float ninf = -std::numeric_limits<float>::infinity();
  std::vector<float> choice(E), gscore(n_group);
  std::vector<int64_t> order(std::max(E, n_group));
  for (int64_t m = 0; m < M; ++m) {
    const float* sm = s + m * E;
    for (int64_t e = 0; e < E; ++e) choice[e] = b ? sm[e] + b[e] : sm[e];
    if (n_group > 1) {
      for (int64_t g = 0; g < n_group; ++g) {  // the sum of the group's two best
        float a = ninf, c = ninf;
        for (int64_t e = g * per; e < (g + 1) * per; ++e) {
          const float v = choice[e];
          if (v > a) { c = a; a = v; } else if (v > c) { c = v; }
        }
        gscore[g] = per >= 2 ? a + c : a;
      }
      for (int64_t g = 0; g < n_group; ++g) order[g] = g;
      std::partial_sort(order.begin(), order.begin() + topk_group, order.begin() + n_group,
                        [&](int64_t x, int64_t y) { return gscore[x] > gscore[y] || (gscore[x] == gscore[y] && x < y); });
      std::vector<char> keep(n_group, 0);
      for (int64_t i = 0; i < topk_group; ++i) keep[order[i]] = 1;
      for (int64_t e = 0; e < E; ++e)
        if (!keep[e / per]) choice[e] = ninf;
    }
    for (int64_t e = 0; e < E; ++e) order[e] = e;
    std::partial_sort(order.begin(), order.begin() + top_k, order.begin() + E,
                      [&](int64_t x, int64_t y) { return choice[x] > choice[y] || (choice[x] == choice[y] && x < y); });
    float sum = 0.0f;
    for (int64_t k = 0; k < top_k; ++k) {
      ip[m * top_k + k] = order[k];
      wp[m * top_k + k] = sm[order[k]];
      sum += sm[order[k]];
    }
    const float den = sum + 1e-20f;
    for (int64_t k = 0; k < top_k; ++k) {
      float v = wp[m * top_k + k];
      if (norm_topk) v /= den;
      wp[m * top_k + k] = v * float(scale);
    }
  }
  return {ids, w};
}

}  // namespace moe_cpu
