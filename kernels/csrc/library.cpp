// Operator schemas of the tonp library (torch.ops.tonp.*). CPU implementations live in ops.cpp
// and moe_ops.cpp, autograd in autograd.cpp; fake (meta) implementations are registered from
// Python (kernels/_fakes.py, registered from the op table by kernels/_register.py).
#include <torch/library.h>

#include <string>
#include <vector>

#include "ops_common.h"

TORCH_LIBRARY(tonp, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias, int chunks, ScalarType? out_dtype, "
        "Tensor? weight_groups=None) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, float scale, int block) -> Tensor");
  m.def("attention_paged(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor q_seq, "
        "Tensor q_pos, float scale) -> Tensor");
  m.def("lse_partial(Tensor logits, float temperature, int chunks) -> (Tensor, Tensor)");
  m.def("lse_finish(Tensor maxes, Tensor sums) -> Tensor");
  m.def("max_with_index(Tensor logits) -> (Tensor, Tensor)");
  m.def("argmax(Tensor logits) -> Tensor");
  m.def("token_logprobs(Tensor logits, Tensor targets, float temperature, int chunks) -> Tensor");
  m.def("sample(Tensor logits, float temperature, int top_k, float top_p, int seed, "
        "Tensor request_ids, Tensor positions) -> Tensor");
  m.def("moe_route(Tensor router_logits, int top_k, bool normalize) -> (Tensor, Tensor)");
  m.def("moe_combine(Tensor weights, Tensor expert_out) -> Tensor");
  m.def("moe_experts(Tensor x, Tensor expert_ids, Tensor gate_up, Tensor down, int first_expert, int chunks, "
        "Tensor? gate_up_groups=None, Tensor? down_groups=None) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin, Tensor positions) -> Tensor");
  m.def("moe_experts_backward(Tensor grad, Tensor x, Tensor expert_ids, Tensor gate_up, Tensor down, int first_expert, "
        "bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
  // A weight's columns in groups (ops.cpp; empty where the table reads none): the copy a caller
  // keeps beside the weight and passes as linear's weight_groups or moe_experts' *_groups.
  m.def("pack_weight_groups(Tensor weight, int chunks) -> Tensor");
  // The kernel table this process uses: "avx512bf16", "avx2" (TONP_FORCE_AVX2=1) or "portable"
  // (TONP_FORCE_PORTABLE=1, or no AVX2).
  m.def("isa() -> str", [] { return std::string(tonp::K()->name); });
  // The backward GEMM's bf16 x bf16 arithmetic in this process now: "amx" (tdpbf16ps; the
  // AVX512-BF16 table where AMX may run, unless TONP_BACKWARD_AMX=0), else the table's name.
  // Gradients are correct, not order-locked: each build has its own (CONTRACT.md).
  m.def("backward_gemm() -> str", [] {
    const tonp::Kernels* k = tonp::K();
    return std::string(k->gemm_on_amx && k->gemm_on_amx() ? "amx" : k->name);
  });
  // The row count from which this table's tk.linear reads an fp32 weight group it is given
  // (Kernels::linear_group_rows_f32; 0: it reads none). A speed choice made per CPU: the bits are
  // the same either way.
  m.def("linear_group_rows() -> int", [] { return static_cast<int64_t>(tonp::K()->linear_group_rows_f32); });
  // The constants the Python side imports (tonp_kernels._library), defined here once: the most
  // reduction chunks a linear may use (kernels.h) and the float dtypes the kernels take (elem_of).
  m.def("max_chunks() -> int", [] { return static_cast<int64_t>(tonp::kMaxChunks); });
  m.def("float_dtypes() -> str[]", [] { return std::vector<std::string>{"float32", "bfloat16"}; });
}

// A Python module named tonp_kernels._C so that `import tonp_kernels._C` loads the library.
#include <Python.h>
static struct PyModuleDef tonp_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&tonp_module); }
