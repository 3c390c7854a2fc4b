// Every op of the library: its schema (m.def) and its CPU kernel (m.impl). Signatures with shapes, and the fake
// kernels torch.compile sees: ops.py. FRAGMENT: the namespace moe_offload stays open to other libraries.
#include <torch/library.h>

#include "common.h"

TORCH_LIBRARY_FRAGMENT(moe_offload, m) {
  // gemm.cpp, moe.cpp
  m.def("gemv_bf16(Tensor x, Tensor w, Tensor? bias=None) -> Tensor");
  m.def("gemm_bf16(Tensor x, Tensor w, Tensor? bias=None) -> Tensor");
  m.def("moe_experts_bf16(Tensor x, Tensor[] gate_ups, Tensor[] downs, Tensor tok, Tensor perm, int[] starts, int[] counts, Tensor(a!) out, "
        "Tensor[]? gate_up_biases=None, Tensor[]? down_biases=None, int gate=0, float alpha=0., float limit=0.) -> ()");
  m.def("clamped_swiglu_bf16(Tensor gate_up, float alpha, float limit) -> Tensor");
  m.def("shared_expert_bf16(Tensor x, Tensor gate_up, Tensor down, Tensor gate, Tensor? gate_up_scale=None, Tensor? down_scale=None) -> Tensor");
  // moe_quant.cpp
  m.def("gemv_q(Tensor x, Tensor w, Tensor w_scale, Tensor? bias=None, int split=0) -> Tensor");
  m.def("dequant_blocks(Tensor w) -> Tensor");
  m.def("moe_experts_q(Tensor x, Tensor[] gate_ups, Tensor[] gate_up_scales, Tensor[] downs, Tensor[] down_scales, "
        "Tensor tok, Tensor perm, int[] starts, int[] counts, Tensor(a!) out, Tensor[]? gate_up_biases=None, "
        "Tensor[]? down_biases=None, int gate=0, float alpha=0., float limit=0.) -> ()");
  // decode.cpp (the layer kernels: the class moe_offload.Layer, layer.h / step.cpp)
  m.def("rmsnorm_bf16(Tensor h, Tensor? add, Tensor w, float eps, str norm=\"rms\") -> Tensor");
  // attention.cpp
  m.def("prefill_attention_bf16(Tensor q, Tensor k, Tensor v, float scale, int window=0) -> Tensor");
  // deltanet.cpp, router.cpp, mla.cpp
  m.def("gated_delta_decode_bf16(Tensor qkvz, Tensor ba, Tensor(a!) conv_state, Tensor conv_w, Tensor? conv_b, "
        "Tensor(b!) state, Tensor a_log, Tensor dt_bias, Tensor norm_w, float eps, int Hk, int Hv, int Dk, int Dv, "
        "Tensor? slots=None, bool plain=False) -> Tensor");
  m.def("grouped_topk(Tensor scores, Tensor? bias, int n_group, int topk_group, int top_k, bool norm_topk, float scale) -> Tensor[]");
  m.def("mla_decode_bf16(Tensor q, Tensor lat, Tensor rope, Tensor lens, Tensor wkv_b, int nope, float scaling, "
        "Tensor? rows=None) -> Tensor");
  m.def("mla_prologue_bf16(Tensor(a!) q, Tensor ckv, Tensor kv_norm, float eps, Tensor cos, Tensor sin, bool interleave, "
        "Tensor(b!) kpool, Tensor(c!) vpool, Tensor slots, int nope) -> ()");
}

TORCH_LIBRARY_IMPL(moe_offload, CPU, m) {
  m.impl("gemv_bf16", &moe_cpu::gemv_bf16);
  m.impl("gemm_bf16", &moe_cpu::gemm_bf16);
  m.impl("moe_experts_bf16", &moe_cpu::moe_experts_bf16);
  m.impl("clamped_swiglu_bf16", &moe_cpu::clamped_swiglu_bf16);
  m.impl("shared_expert_bf16", &moe_cpu::shared_expert_bf16);
  m.impl("gemv_q", &moe_quant::gemv_q);
  m.impl("moe_experts_q", &moe_quant::moe_experts_q);
  m.impl("dequant_blocks", &moe_quant::dequant_blocks);
  m.impl("rmsnorm_bf16", &moe_cpu::rmsnorm_bf16);
  m.impl("prefill_attention_bf16", &moe_cpu::prefill_attention_bf16);
  m.impl("mla_decode_bf16", &moe_cpu::mla_decode_bf16);
  m.impl("mla_prologue_bf16", &moe_cpu::mla_prologue_bf16);
  m.impl("gated_delta_decode_bf16", &moe_cpu::gated_delta_decode_bf16);
  m.impl("grouped_topk", &moe_cpu::grouped_topk);
}
