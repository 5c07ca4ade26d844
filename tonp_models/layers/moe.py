"""Sparse MoE block: router -> top-k experts (SwiGLU) -> token-owned combine in slot order.

    logits = linear(x, router)            [M, E]   (the chunk-tree linear)
    ids, w = moe_route(logits, k, norm)   [M, K]   (fp32 softmax, stable top-k, renorm in slot order)
    rows grouped by expert id (stable, so each expert sees its tokens in token order)
    y_e    = down_e(silu(gate_e(x)) * up_e(x))     (the linear kernel: a row's bits do not depend
                                                    on how many rows the expert got)
    out    = moe_combine(w, y[M, K, H])            (sum over slots k = 0..K-1 in fp32)

Expert weights are 3-D like transformers 5: gate_up_proj [E, 2I, H] (gate rows first),
down_proj [E, H, I]. Under expert parallelism a rank owns the contiguous id range
[ep_rank * E/ep, (ep_rank + 1) * E/ep) and holds only those experts.
"""
from __future__ import annotations

import torch
from torch import nn

import tonp_kernels as tk


class SparseMoeBlock(nn.Module):
    """x [M, H] -> [M, H] in x.dtype.

    Args: hidden_size, moe_intermediate_size (I), num_experts (E), top_k (K), norm_topk_prob,
    chunks (C), ep_group (None = EP 1), dtype.
    """

    def __init__(self, hidden_size: int, moe_intermediate_size: int, num_experts: int,
                 top_k: int, norm_topk_prob: bool, *, chunks: int = tk.DEFAULT_CHUNKS,
                 ep_group=None, dtype: torch.dtype = torch.float32):
        super().__init__()
        ep_size, ep_rank = 1, 0
        if ep_group is not None:
            import torch.distributed as dist
            ep_size, ep_rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
        if num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel "
                             f"degree {ep_size}")
        self.ep_group, self.ep_size = ep_group, ep_size
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.local_experts = num_experts // ep_size
        self.first_expert = ep_rank * self.local_experts
        self.intermediate, self.chunks = moe_intermediate_size, chunks
        self.gate = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype))  # router
        self.gate_up_proj = nn.Parameter(torch.empty(self.local_experts, 2 * moe_intermediate_size,
                                                     hidden_size, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(self.local_experts, hidden_size,
                                                  moe_intermediate_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        M, K = x.shape[0], self.top_k
        logits = tk.linear(x, self.gate, chunks=self.chunks)                       # (M, E)
        ids, weights = tk.moe_route(logits, K, self.norm_topk_prob)                # (M, K) x2
        if self.ep_size > 1:
            # TODO(EP issue): all_to_all the rows to the ranks owning their experts, run
            # _run_local_experts there, all_to_all back; the combine below stays token-owned.
            raise NotImplementedError("SparseMoeBlock: expert parallelism > 1 is not wired yet")
        flat = ids.reshape(-1)                                                     # (M*K,)
        order = torch.argsort(flat, stable=True)            # slots grouped by expert, token order
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        y_sorted = self._run_local_experts(x, order // K, counts)                  # (M*K, H)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        y = y_sorted.index_select(0, inverse).view(M, K, -1)                       # (M, K, H)
        return tk.moe_combine(weights, y)

    def _run_local_experts(self, x: torch.Tensor, token_of_row: torch.Tensor,
                           counts: list) -> torch.Tensor:
        """Rows sorted by expert: row r is token token_of_row[r] sent to the r-th expert in
        counts order. Runs this rank's experts in ascending id -> [rows, H] in x.dtype."""
        I, outs, start = self.intermediate, [], 0
        for e in range(self.local_experts):
            n = counts[self.first_expert + e]
            if n == 0:
                continue
            xe = x.index_select(0, token_of_row[start:start + n])                  # (n, H)
            gu = tk.linear(xe, self.gate_up_proj[e], chunks=self.chunks)           # (n, 2I)
            h = tk.silu_mul(gu[:, :I].contiguous(), gu[:, I:].contiguous())        # (n, I)
            outs.append(tk.linear(h, self.down_proj[e], chunks=self.chunks))      # (n, H)
            start += n
        if not outs:
            return x.new_zeros(0, x.shape[1])
        return torch.cat(outs, 0)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts} (local {self.first_expert}.."
                f"{self.first_expert + self.local_experts - 1}), top_k={self.top_k}, "
                f"norm_topk_prob={self.norm_topk_prob}, intermediate={self.intermediate}")
