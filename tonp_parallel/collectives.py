"""Fixed-order collectives: sums over ranks whose bits never depend on the backend or message size.

Stock all-reduces (NCCL, HCCL, gloo) pick ring / tree / chunking by message size and world, so
an element is summed in a different order in prefill and in decode. Here the sum of the ranks'
fp32 partials p0..p(W-1) (in group-rank order) is always the contract's fixed pairwise tree

    W = 4:  (p0 + p1) + (p2 + p3)          W = 8:  ((p0+p1)+(p2+p3)) + ((p4+p5)+(p6+p7))

computed with plain fp32 `+` (IEEE-exact per element, so it does not matter which rank adds or
how the elements are cut into messages). For W not a power of two the tree pairs neighbours
level by level and carries an odd last node up unchanged: W = 3 -> (p0 + p1) + p2,
W = 6 -> ((p0+p1)+(p2+p3)) + (p4+p5). The tree is `tonp_kernels.tree_sum` (the same function
finishes a row-parallel linear's chunk tree); `tree_order_sum` is its name here.

Two wire forms, picked by message size, give the same bits:
* small (<= SMALL_MESSAGE_BYTES): all_gather the partials, every rank runs the whole tree;
  one latency step, (W-1) x n elements received per rank.
* large: all_to_all of W equal chunks (rank r receives chunk r of every partial), each rank
  tree-reduces its chunk, then all_gather of the reduced chunks: 2 (W-1)/W x n elements per
  rank, the bytes of a ring all-reduce. (On gloo the last step is an all_to_all that sends
  the reduced chunk to every rank: same bytes, measured faster than gloo's allgather.) On CPU
  its scratch buffers are reused between calls (`clear_workspace()` frees them).

`group=None` means "this rank alone": the reduction is the identity (see groups.py).
These functions are not differentiable; regions.py wraps them for autograd.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from tonp_kernels import tree_sum as tree_order_sum

SMALL_MESSAGE_BYTES = 64 * 1024
ALGORITHMS = ("auto", "gather", "all_to_all")
_SUM_DTYPES = (torch.float32, torch.float64)
# torch >= 2.10 renamed the flat-buffer collectives; older releases only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    """World size of `group`; 1 for None (a group of one)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    """This process's rank inside `group` (ascending global rank order); 0 for None."""
    return 0 if group is None else dist.get_rank(group)


def _check_partial(name: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"tonp_parallel.{name}: expected a tensor, got {type(x).__name__}")
    if x.dtype not in _SUM_DTYPES:
        raise TypeError(f"tonp_parallel.{name}: partials must be float32 (or float64), got "
                        f"{x.dtype}; the contract sums partials in fp32 and rounds once after")


def all_gather_stacked(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Every rank's `x` stacked in group-rank order: x [...] -> [W, ...] (same on every rank)."""
    W = group_size(group)
    if W == 1:
        return x.unsqueeze(0)
    # Flat buffers: gloo wants the output as the inputs concatenated along dim 0.
    out = x.new_empty(W * x.numel())
    _all_gather_flat(out, x.contiguous().view(-1), group=group)
    return out.view(W, *x.shape)


def all_gather_along(x: torch.Tensor, group: Optional[dist.ProcessGroup], dim: int) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` in group-rank order (equal shapes on all ranks)."""
    if group_size(group) == 1:
        return x
    dim = dim % x.dim()
    stacked = all_gather_stacked(x.movedim(dim, 0), group)  # [W, x.shape[dim], ...]
    return stacked.flatten(0, 1).movedim(0, dim)


def _equal_chunks(name: str, x: torch.Tensor, W: int, dim: int) -> List[torch.Tensor]:
    if x.shape[dim] % W:
        raise ValueError(f"tonp_parallel.{name}: dim {dim} of size {x.shape[dim]} is not "
                         f"divisible by the group size {W}")
    return list(x.chunk(W, dim))


def tree_all_reduce(x: torch.Tensor, group: Optional[dist.ProcessGroup], *,
                    algorithm: str = "auto") -> torch.Tensor:
    """Fixed-tree sum over the group of each rank's fp32 partial `x` -> same shape, same bits
    on every rank, for every message size and `algorithm` ("auto" | "gather" | "all_to_all").

    x: float32 (or float64) [...], the same shape on every rank. Returns a new tensor.
    """
    _check_partial("tree_all_reduce", x)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"tonp_parallel.tree_all_reduce: algorithm must be one of {ALGORITHMS}, "
                         f"got {algorithm!r}")
    W = group_size(group)
    if W == 1 or x.numel() == 0:
        return x.clone()
    if algorithm == "auto":
        small = x.numel() * x.element_size() <= SMALL_MESSAGE_BYTES
        algorithm = "gather" if small or x.numel() < W else "all_to_all"
    if algorithm == "gather":
        return tree_order_sum(all_gather_stacked(x.detach(), group))

    # all_to_all form: pad the flat message to W equal chunks; pads are zeros and dropped.
    flat = x.detach().reshape(-1)
    n = flat.numel()
    chunk = -(-n // W)
    send = flat.contiguous()
    if chunk * W != n:
        send = _scratch("pad", chunk * W, flat)
        send[:n].copy_(flat)
        send[n:].zero_()
    received = _scratch("recv", chunk * W, flat)  # chunk r (ours) of every rank's partial
    dist.all_to_all_single(received, send, group=group)
    mine = tree_order_sum(received.view(W, chunk), in_place=True)
    out = flat.new_empty(chunk * W)
    if dist.get_backend(group) == "gloo":
        # gloo's allgather measured ~2x slower than its all_to_all of the same bytes (16-32 MiB,
        # loopback): send our reduced chunk to every rank with all_to_all instead.
        bcast = _scratch("bcast", chunk * W, flat)
        bcast.view(W, chunk).copy_(mine.expand(W, chunk))
        dist.all_to_all_single(out, bcast, group=group)
    else:
        _all_gather_flat(out, mine, group=group)
    return out[:n].view(x.shape)


_WORKSPACE: Dict[Tuple[str, torch.dtype], torch.Tensor] = {}


def _scratch(slot: str, numel: int, like: torch.Tensor) -> torch.Tensor:
    """A flat scratch buffer reused across calls on CPU, where every fresh multi-MiB tensor
    page-faults its memory in again (measured: more than the transfer itself on loopback gloo).
    Other devices get a fresh tensor: their caching allocators already reuse memory.
    Not thread-safe: one collective at a time per process (as on one process group)."""
    if like.device.type != "cpu":
        return like.new_empty(numel)
    key = (slot, like.dtype)
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < numel:
        buf = _WORKSPACE[key] = like.new_empty(numel)
    return buf[:numel]


def clear_workspace() -> None:
    """Free the CPU scratch buffers of the large-message form (up to 3 message sizes)."""
    _WORKSPACE.clear()


def tree_reduce_scatter(x: torch.Tensor, group: Optional[dist.ProcessGroup],
                        dim: int = 0) -> torch.Tensor:
    """Rank r's 1/W slice along `dim` of the fixed-tree sum of every rank's fp32 partial `x`.

    x: float32 [..., S, ...] with S (= x.shape[dim]) divisible by W -> [..., S / W, ...]; the
    bits equal the matching slice of `tree_all_reduce(x, group)` (sequence parallelism).
    """
    _check_partial("tree_reduce_scatter", x)
    W = group_size(group)
    if W == 1:
        return x.clone()
    dim = dim % x.dim()
    pieces = _equal_chunks("tree_reduce_scatter", x.detach(), W, dim)
    send = torch.stack([p.contiguous() for p in pieces])  # [W, piece...], piece j goes to rank j
    received = torch.empty_like(send)  # [W, piece...]: our piece of every rank's partial
    dist.all_to_all_single(received, send, group=group)
    return tree_order_sum(received)


def scatter_along(x: torch.Tensor, group: Optional[dist.ProcessGroup], dim: int) -> torch.Tensor:
    """This rank's 1/W slice of `x` along `dim` (no communication)."""
    W = group_size(group)
    if W == 1:
        return x
    return _equal_chunks("scatter_to_region", x, W, dim % x.dim())[group_rank(group)].contiguous()


def all_to_all_rows(x: torch.Tensor, output_split_sizes: Optional[Sequence[int]],
                    input_split_sizes: Optional[Sequence[int]],
                    group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Send rows x[sum(in[:j]) : sum(in[:j+1])] to rank j; receive out[j] rows from rank j.

    x [N, ...] with N = sum(input_split_sizes) -> [sum(output_split_sizes), ...]; None splits
    mean W equal parts. Any dtype (use it on int counts to exchange split sizes first).
    """
    W = group_size(group)
    ins = None if input_split_sizes is None else [int(s) for s in input_split_sizes]
    outs = None if output_split_sizes is None else [int(s) for s in output_split_sizes]
    for name, s in (("input_split_sizes", ins), ("output_split_sizes", outs)):
        if s is not None and (len(s) != W or min(s) < 0):
            raise ValueError(f"tonp_parallel.all_to_all: {name} must be {W} non-negative sizes "
                             f"(one per rank), got {s}")
    if ins is not None and sum(ins) != x.shape[0]:
        raise ValueError(f"tonp_parallel.all_to_all: input_split_sizes sum to {sum(ins)} but x "
                         f"has {x.shape[0]} rows")
    if ins is None and x.shape[0] % W:
        raise ValueError(f"tonp_parallel.all_to_all: {x.shape[0]} rows cannot be split equally "
                         f"over {W} ranks; pass input_split_sizes")
    if W == 1:
        if outs is not None and outs[0] != x.shape[0]:
            raise ValueError(f"tonp_parallel.all_to_all: a group of one receives its own "
                             f"{x.shape[0]} rows, not {outs[0]}")
        return x.clone()
    n_out = x.shape[0] if outs is None else sum(outs)
    out = x.new_empty((n_out, *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=outs,
                           input_split_sizes=ins, group=group)
    return out
