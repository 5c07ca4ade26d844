"""Sparse MoE block: router -> top-k experts (SwiGLU) -> token-owned combine in slot order.

    logits = linear(x, router)            [M, E]   (the chunk-tree linear)
    ids, w = moe_route(logits, k, norm)   [M, K]   (fp32 softmax, stable top-k, renorm in slot order)
    y[m, k] = down_e(silu(gate_e(x[m])) * up_e(x[m])), e = ids[m, k]
                                           (moe_experts: every expert in one call, the linear
                                            kernel's bits: a row's output does not depend on
                                            how many rows its expert got)
    out    = moe_combine(w, y[M, K, H])    (sum over slots k = 0..K-1 in fp32)

The reference path `_per_expert` runs one `linear`/`silu_mul`/`linear` call per expert: the
fused op's bits (tests/test_model_invariance.py), more Python per step. It serves when
`fused_experts` is False, and beside the fused op when a probe hook wants detail (layers/probe.py).

Expert weights are 3-D like transformers 5: gate_up_proj [E, 2I, H] (gate rows first),
down_proj [E, H, I]. Under expert parallelism a rank owns the contiguous id range
[ep_rank * E/ep, (ep_rank + 1) * E/ep) and holds only those experts:

    route all tokens (router weights replicated)        -> ids, w [M, K]
    this rank's share of the tokens (TP ranks hold the same tokens: each dispatches a part,
        so every expert sees each token once)           -> x, ids, w [n, K]
    (token, slot) rows sorted by expert id = by owner rank; all_to_all the rows (counts first)
    the owner runs the rows it received through their experts
    all_to_all the results back; unsort                 -> y [n, K, H]
    out = moe_combine(w, y)  token-owned, slot order, fp32; then the TP parts are gathered.
A row's expert output depends only on the row and the expert's weights, and the combine runs
where the token lives, so EP = 1, 2, 4 give the same bits. Every rank of the EP group must run
each forward (and backward) together, with any number of tokens (zero included).
Under sequence parallelism (`sp`) the block gathers the TP group's rows first and keeps this
rank's rows of the output: inside, every TP rank holds every token, as without SP.

Weight groups (layers/weight_groups.py): the rollout engine keeps the expert weights also in
column groups laid out the way the CPU kernels read them (bf16: the one-row tiles' groups, for an
expert that gets one row, every expert at batch 1, most at 16; fp32: the lane tiles' panels, for
every row count); the same bits.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import nn

import tonp_kernels as tk

from .linear import Shard, _tp_rank, _tp_size
from .probe import probe
from .probe import probing, wants_detail
from .weight_groups import HoldsWeightGroups


class SparseMoeBlock(HoldsWeightGroups, nn.Module):
    """x [M, H] -> [M, H] in x.dtype.

    Args: hidden_size, moe_intermediate_size (I), num_experts (E), top_k (K), norm_topk_prob,
    chunks (C), ep_group (None = EP 1), tp_group (the ranks holding the same tokens; used to
    split the dispatch under EP, None = TP 1), dtype.
    """

    def __init__(self, hidden_size: int, moe_intermediate_size: int, num_experts: int,
                 top_k: int, norm_topk_prob: bool, *, chunks: int = tk.DEFAULT_CHUNKS,
                 ep_group=None, tp_group=None, dtype: torch.dtype = torch.float32):
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
        self.fused_experts = True  # False: the per-expert reference path (the same bits)
        self.gate = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype))  # router
        self.gate_up_proj = nn.Parameter(torch.empty(self.local_experts, 2 * moe_intermediate_size,
                                                     hidden_size, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(self.local_experts, hidden_size,
                                                  moe_intermediate_size, dtype=dtype))
        self.shards: Dict[str, Shard] = {} if ep_size == 1 else {
            name: Shard(0, self.first_expert, self.local_experts, num_experts, "ep")
            for name in ("gate_up_proj", "down_proj")}
        # Under EP the TP ranks that share this EP group split the tokens into `token_parts`.
        self.tp_group, tp_size = tp_group, _tp_size(tp_group)
        if ep_size == 1 or tp_size == 1:
            self.token_parts = 1
        elif tp_size % ep_size == 0 or ep_size % tp_size == 0:
            self.token_parts = min(tp_size, ep_size)
        else:
            raise ValueError(f"SparseMoeBlock: tensor-parallel degree {tp_size} and expert-"
                             f"parallel degree {ep_size} must divide one another")

    def forward(self, x: torch.Tensor, sp=None) -> torch.Tensor:
        """x [M, H] (under sequence parallelism `sp`: this rank's [n, H]) -> like x."""
        if sp is not None and sp.size > 1:
            # Replicated consumer: every TP rank's x-gradient is the whole one (no sum).
            return sp.scatter(self.forward(sp.gather(x, sum_grads=False)))
        logits = tk.linear(x, self.gate, chunks=self.chunks)                       # (M, E)
        ids, weights = tk.moe_route(logits, self.top_k, self.norm_topk_prob)       # (M, K) x2
        if probing():
            probe("router_logits", logits)
            probe("route.ids", ids, kind="route")
            probe("route.weights", weights)
        if self.ep_size > 1:
            return self._forward_ep(x, ids, weights)
        out = tk.moe_combine(weights, self._experts(x, ids))                       # (M, H)
        probe("combine", out)
        return out

    def _grouped_weights(self) -> Tuple[Optional[torch.Tensor], ...]:
        return self.gate_up_proj, self.down_proj

    def _experts(self, x: torch.Tensor, ids: torch.Tensor, received: bool = False
                 ) -> torch.Tensor:
        """x [R, H], ids [R, J] (this rank's experts) -> y [R, J, H]: row (r, j) through expert
        ids[r, j]. received: x's rows came from EP peers (for probes)."""
        if not self.fused_experts:
            y = self._per_expert(x, ids, received)
        else:
            gu, dn = self._read_groups() or (None, None)
            y = tk.moe_experts(x, ids, self.gate_up_proj, self.down_proj,
                               first_expert=self.first_expert, chunks=self.chunks,
                               gate_up_groups=gu, down_groups=dn)
            if wants_detail():
                self._per_expert(x, ids, received)  # observed only: the same bits as y
        if probing():
            R, J = ids.shape
            probe("experts", y.reshape(R * J, x.shape[1]),
                  rows=torch.arange(R, device=ids.device).repeat_interleave(J),
                  experts=ids.reshape(-1),
                  received=received)
        return y

    def _forward_ep(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
                    ) -> torch.Tensor:
        from tonp_parallel import all_to_all
        from tonp_parallel.collectives import all_to_all_rows
        from tonp_parallel.sharding import (gather_rows_from_region, row_share,
                                            scatter_rows_to_region)
        M, K, W, tp, P = x.shape[0], self.top_k, self.ep_size, self.tp_group, self.token_parts
        x = scatter_rows_to_region(x, tp, P)                                       # (n, H)
        weights = scatter_rows_to_region(weights, tp, P)                           # (n, K)
        start = 0
        if P > 1:
            start, n = row_share(M, P, _tp_rank(tp) % P)
            ids = ids[start:start + n]
        n = x.shape[0]
        flat = ids.reshape(-1)                                                     # (n*K,)
        order = torch.argsort(flat, stable=True)     # by expert id, hence by owner rank
        expert_sorted = flat.index_select(0, order)
        token = order // K                                                         # (n*K,)
        if probing():  # each sent row's forward row and expert
            probe("dispatch", expert_sorted, kind="dispatch", rows=token + start,
                  experts=expert_sorted)
        send = torch.bincount(expert_sorted // self.local_experts, minlength=W)     # (W,)
        recv = all_to_all_rows(send, None, None, self.ep_group)                    # (W,)
        send, recv = send.tolist(), recv.tolist()
        rows = x.index_select(0, token)                                            # (n*K, H)
        got = all_to_all(rows, recv, send, self.ep_group)                          # (R, H)
        got_expert = all_to_all_rows(expert_sorted, recv, send, self.ep_group)     # (R,)
        y_got = self._experts(got, got_expert.unsqueeze(1), True).squeeze(1)       # (R, H)
        y_rows = all_to_all(y_got, send, recv, self.ep_group)                      # (n*K, H)
        y = y_rows.index_select(0, _inverse(order)).view(n, K, x.shape[1])         # (n, K, H)
        out = tk.moe_combine(weights, y)                                           # (n, H)
        if probing():  # this rank's share of the tokens (rows split over TP ranks when P > 1)
            probe("combine", out, rows=torch.arange(start, start + n, device=out.device),
                  shard_dim=0 if P > 1 else None)
        return gather_rows_from_region(out, tp, M, P)                              # (M, H)

    def _per_expert(self, x: torch.Tensor, ids: torch.Tensor, received: bool = False
                    ) -> torch.Tensor:
        """The reference path of `_experts`: this rank's experts in ascending id, one
        linear / silu_mul / linear call each on the rows it got; probes every step."""
        I, outs, start = self.intermediate, [], 0
        flat = ids.reshape(-1)                                                     # (R*J,)
        order = torch.argsort(flat, stable=True)            # rows grouped by expert, row order
        row_of = order // ids.shape[1]
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        # One unbind, not an index per expert: each index's backward would build a zero gradient
        # the size of the whole [E, 2I, H] tensor (30x slower training at 128 experts).
        gate_up, down = self.gate_up_proj.unbind(0), self.down_proj.unbind(0)
        for e in range(self.local_experts):
            n = counts[self.first_expert + e]
            if n == 0:
                continue
            rows = row_of[start:start + n]
            xe = x.index_select(0, rows)                                           # (n, H)
            gu = tk.linear(xe, gate_up[e], chunks=self.chunks)                     # (n, 2I)
            h = tk.silu_mul(gu[:, :I].contiguous(), gu[:, I:].contiguous())        # (n, I)
            outs.append(tk.linear(h, down[e], chunks=self.chunks))                # (n, H)
            if probing():
                meta = dict(rows=rows, experts=torch.full_like(rows, self.first_expert + e),
                            received=received)
                probe("expert.gate_up", gu, **meta)
                probe("expert.act", h, **meta)
                probe("expert.down", outs[-1], **meta)
            start += n
        # x[:0] keeps the graph connected, so every EP rank runs the backward all_to_all.
        y_sorted = torch.cat(outs, 0) if outs else x[:0]                          # (R*J, H)
        return y_sorted.index_select(0, _inverse(order)).view(*ids.shape, x.shape[1])

    def extra_repr(self) -> str:
        return (f"ep={self.ep_size}, experts={self.num_experts} (local {self.first_expert}.."
                f"{self.first_expert + self.local_experts - 1}), top_k={self.top_k}, "
                f"norm_topk_prob={self.norm_topk_prob}, intermediate={self.intermediate}")


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv
