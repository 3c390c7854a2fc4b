// What a decoder layer's one-call kernels share (decode.cpp defines them; deltanet.cpp's layer uses them too):
//
//   residual_norm: h_in = bf16(h + add), x = the first norm of h_in                      (the layer's head)
//   project_all:   out[t, :] = [x[t] . P0^T | x[t] . P1^T | ...] in one parallel pass over the rows of all of them,
//                  each P bf16 rows (gemm_range's dots) or int8 rows / ggml blocks (moe_quant's, as gemv_q computes)
//   layer_tail:    h2 = bf16(h_in + o), x2 = the second norm of h2, the fused router's top-k    (the layer's tail)
//
// Numbers: those of decode_layer_bf16 (decode.cpp), whose parts these are.
#pragma once

#include "common.h"
#include "quant.h"

namespace moe_cpu {

struct Proj {  // one projection as a layer kernel reads it
  const uint16_t* w = nullptr;  // bf16 rows (q false)
  int64_t ld = 0;
  bool q = false;  // int8 rows with per-row scales, or ggml blocks: qw
  moe_quant::Weight qw{};
  const uint16_t* bias = nullptr;
};

// w [rows, cols] bf16 (no scale), or int8 rows with their scales / ggml blocks (empty scales), checked
Proj proj_of(const at::Tensor& w, const std::optional<at::Tensor>& scale, int64_t rows, int64_t cols, const char* what);

// x [M, n] through ps stacked (cut[m]: the end of ps[m]'s columns in out [M, cut.back()]); every p bf16, or every
// one quantized
void project_all(const std::vector<Proj>& ps, const std::vector<int64_t>& cut, const uint16_t* x, int64_t M, int64_t n,
                 uint16_t* out);

// h [M, H] (+ add): returns h_in [M, H]; x (resized to M * H) its norm with ln (norm_mode: rmsnorm_row's)
at::Tensor residual_norm(const at::Tensor& h, const std::optional<at::Tensor>& add, const at::Tensor& ln, double eps,
                         int64_t norm_mode, std::vector<uint16_t>& x);

// the fused router's weights: [E, H] bf16 rows, 1 <= top_k <= E
void check_router(const std::optional<at::Tensor>& wr, int64_t H, int64_t top_k);

// o [M * H] the token mixer's output: {h2, x2, ids [M, K], weights [M, K]} (no router: ids and weights empty)
std::vector<at::Tensor> layer_tail(const at::Tensor& h_in, const uint16_t* o, const at::Tensor& ln2, double eps,
                                   int64_t norm_mode, const std::optional<at::Tensor>& wr,
                                   const std::optional<at::Tensor>& rb, int64_t top_k, bool norm_topk, bool w_bf16,
                                   int64_t router_mode);

}  // namespace moe_cpu
