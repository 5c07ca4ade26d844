// What the MoE forward (moe_ops.cpp) and its backward (moe_backward.cpp) share: the checks, the
// grouping of (token, slot) rows by expert, and the fused forward itself.
#pragma once
#include <ATen/ATen.h>

#include <vector>

namespace tonp {

// Rows of a call grouped by expert, stable: expert e's rows are order[start[e] .. start[e + 1]),
// each the flat index token * K + slot.
struct ExpertGroups {
  std::vector<int64_t> start, order;
};

void check_experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& gate_up, const at::Tensor& down,
                   int64_t chunks);
ExpertGroups group_by_expert(const at::Tensor& ids, int64_t first_expert, int64_t E);
at::Tensor moe_experts_forward(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& gate_up,
                               const at::Tensor& down, int64_t first_expert, int64_t chunks, at::Tensor* gate_up_out,
                               const std::optional<at::Tensor>& gate_up_groups = std::nullopt,
                               const std::optional<at::Tensor>& down_groups = std::nullopt);

}  // namespace tonp
