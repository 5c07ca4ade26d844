// Test-facing ops of the bf16 pair chains (bf16dot.h): one step of the chains by a chosen build,
// so tests compare vdpbf16ps, the AVX2 emulation and the portable flush on millions of inputs.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "kernels.h"

namespace tonp {
namespace {

const Kernels* table_named(const std::string& isa) {
  if (isa == "portable") return kernels_portable();
  if (isa == "avx2" && cpu_has_avx2_fma()) return kernels_avx2();
  if (isa == "avx512bf16" && kernels_avx512bf16()) return kernels_avx512bf16();
  return nullptr;
}

// The builds this CPU can run, portable first.
std::vector<std::string> bf16_pair_isas() {
  std::vector<std::string> out;
  for (const char* isa : {"portable", "avx2", "avx512bf16"})
    if (table_named(isa)) out.push_back(isa);
  return out;
}

// out[i] = acc[i] after one step of the pair chains on the pairs a[i], b[i] (acc fp32 [n],
// a, b bf16 [n, 2]: element 1 is the odd one, taken first).
at::Tensor bf16_pair_step(const at::Tensor& acc, const at::Tensor& a, const at::Tensor& b, const std::string& isa) {
  TORCH_CHECK_TYPE(acc.scalar_type() == at::kFloat && a.scalar_type() == at::kBFloat16 && b.scalar_type() == at::kBFloat16,
                   "tonp.bf16_pair_step: expected acc float32 and a, b bfloat16, got ", acc.scalar_type(), ", ",
                   a.scalar_type(), ", ", b.scalar_type());
  TORCH_CHECK_VALUE(acc.dim() == 1 && a.dim() == 2 && a.size(1) == 2 && a.sizes() == b.sizes() && a.size(0) == acc.size(0),
                    "tonp.bf16_pair_step: expected acc [n] and a, b [n, 2], got ", acc.sizes(), ", ", a.sizes(), ", ",
                    b.sizes());
  const Kernels* k = table_named(isa);
  TORCH_CHECK_VALUE(k, "tonp.bf16_pair_step: isa '", isa, "' is not available on this CPU (available: ",
                    c10::Join(", ", bf16_pair_isas()), ")");
  const at::Tensor ac = acc.contiguous(), ab = a.contiguous(), bb = b.contiguous();
  at::Tensor out = at::empty_like(ac);
  k->bf16_pair_step(ac.data_ptr<float>(), static_cast<const uint16_t*>(ab.data_ptr()),
                    static_cast<const uint16_t*>(bb.data_ptr()), out.data_ptr<float>(), ac.numel());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tonp, m) {
  m.def("bf16_pair_isas() -> str[]", &bf16_pair_isas);
  m.def("bf16_pair_step(Tensor acc, Tensor a, Tensor b, str isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(tonp, CPU, m) { m.impl("bf16_pair_step", &bf16_pair_step); }

}  // namespace tonp
