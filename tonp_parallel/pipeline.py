"""Pipeline parallelism: point-to-point messages between neighbouring stages and the schedules
that drive a stage's micro-batches (forward-only, and 1F1B for training).

    comm = PipeComm(groups.pp_group)
    outs = run_forward(comm, n, forward, in_shape)                  # inference
    run_1f1b(comm, n, forward, in_shape, out_shape)                 # training: forward + backward
    value = comm.from_last(value, shape, dtype)       # last stage's result, everywhere; waits
                                                      # until every message was received

Why not `torch.distributed.pipelining`: its stages allocate every receive buffer once, from
the metadata of the first micro-batch (`_make_tensor_from_meta`, static or inferred shapes),
and its schedules split one batch into equal chunks along a dim. tonp's micro-batches are
ragged packed sequences (cu_seqlens): each carries a different number of tokens (under CP and
SP a different slice of them), and the packing metadata (bounds, positions, the CP split)
must reach every stage beside the activations. Here every stage of a pipeline receives the
same micro-batches (token ids are tiny), so each knows every message's shape and only the
activations and their gradients travel: one [T_m, H] tensor per micro-batch and direction.

Failure: every message is preceded by a one-int header. A stage that raises sends a "failed"
header to both neighbours, in place of whatever each waits for next from it; a stage that
receives one raises `StageFailed` (naming the stage that failed first) and passes it on, so
every rank of the pipeline raises within a message time instead of waiting for the
collective timeout. (A rank that fails inside a TP / EP collective of its own stage still
leaves its stage peers to that collective's timeout.) Received tensors are exact copies.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .collectives import group_rank, group_size

Shape = Tuple[int, ...]
_DOWN, _UP = 17, 18          # tags: stage s -> s + 1, stage s + 1 -> s
_OK = 0
# Sends a failing stage leaves behind: their work objects and tensors must outlive the call
# (a dropped gloo work may never deliver its message).
_ABANDONED: List = []


class StageFailed(RuntimeError):
    """A pipeline stage failed (on another rank): this rank stops too. `.stage` is the stage
    that failed first."""

    def __init__(self, stage: int, rank: int):
        super().__init__(f"tonp_parallel.pipeline: stage {stage} (global rank {rank}) of this "
                         f"rank's pipeline failed; see that rank's error")
        self.stage, self.rank = stage, rank


class PipeComm:
    """The point-to-point side of one pipeline (the PP group `group`; None = one stage), with
    messages on `device` (the activations' device: NCCL / HCCL send device tensors).

    Attributes: stage, stages, is_first, is_last, wait_s (seconds spent waiting in receives:
    the bubble the benchmark reports)."""

    def __init__(self, group: Optional[dist.ProcessGroup], device="cpu"):
        self.group, self.device = group, torch.device(device)
        self.stage, self.stages = group_rank(group), group_size(group)
        self.ranks = dist.get_process_group_ranks(group) if group is not None else [0]
        self.is_first, self.is_last = self.stage == 0, self.stage == self.stages - 1
        self._sends: List = []
        self.wait_s = 0.0

    # -- messages --------------------------------------------------------------------------
    def _peer(self, down: bool) -> int:
        return self.ranks[self.stage + 1 if down else self.stage - 1]

    def send(self, x: torch.Tensor, down: bool) -> None:
        """Send x to the next (down) or previous stage, without waiting for it to arrive."""
        dst, tag = self._peer(down), _DOWN if down else _UP
        header = torch.tensor([_OK], dtype=torch.int64, device=self.device)
        payload = x.detach().contiguous()
        self._sends.append((dist.isend(header, dst, group=self.group, tag=tag), header))
        if payload.numel():
            self._sends.append((dist.isend(payload, dst, group=self.group, tag=tag), payload))

    def recv(self, shape: Shape, dtype: torch.dtype, down: bool) -> torch.Tensor:
        """The next tensor from the previous (down: it flows down to us) or the next stage."""
        src, tag = self._peer(not down), _DOWN if down else _UP
        header = torch.empty(1, dtype=torch.int64, device=self.device)
        t0 = time.perf_counter()
        dist.recv(header, src, group=self.group, tag=tag)
        code = int(header[0])
        if code != _OK:
            stage = code - 1
            raise StageFailed(stage, self.ranks[stage])
        out = torch.empty(shape, dtype=dtype, device=self.device)
        if out.numel():
            dist.recv(out, src, group=self.group, tag=tag)
        self.wait_s += time.perf_counter() - t0
        return out

    def fail(self, stage: Optional[int] = None) -> None:
        """Tell both neighbours that `stage` (default: this one) failed; never waits."""
        code = torch.tensor([(self.stage if stage is None else stage) + 1], dtype=torch.int64,
                            device=self.device)
        _ABANDONED.extend(self._sends)
        self._sends = []
        for down in (True, False):
            if (self.is_last if down else self.is_first):
                continue
            try:
                work = dist.isend(code, self._peer(down), group=self.group,
                                  tag=_DOWN if down else _UP)
                _ABANDONED.append((work, code))
            except Exception:  # noqa: BLE001 -- best effort: this rank is failing anyway
                pass

    def finish(self) -> None:
        """Wait until every message sent has been received."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()

    def guard(self, fn: Callable, *args):
        """fn(*args); on any error tell the neighbours (see the module doc) and re-raise.
        Sends are not waited for here: a neighbour that failed never receives them. The
        schedules end with `from_last`, whose success means every message was received."""
        try:
            return fn(*args)
        except StageFailed as e:
            self.fail(e.stage)
            raise
        except BaseException:
            self.fail()
            raise

    def from_last(self, value: Optional[torch.Tensor], shape: Shape, dtype: torch.dtype
                  ) -> torch.Tensor:
        """The last stage's `value` (shape and dtype known to every stage) on every stage,
        passed up the pipeline stage by stage. Call it on every stage (value ignored
        elsewhere); a failure anywhere raises on every stage."""
        if self.stages == 1:
            return value

        def relay():
            v = value if self.is_last else self.recv(shape, dtype, down=False)
            if not self.is_first:
                self.send(v, down=False)
            self.finish()
            return v
        return self.guard(relay)


# -- schedules --------------------------------------------------------------------------------
def run_forward(comm: PipeComm, n: int, forward: Callable[[int, Optional[torch.Tensor]],
                                                          torch.Tensor],
                in_shape: Callable[[int], Tuple[Shape, torch.dtype]]) -> List[torch.Tensor]:
    """Forward-only pipeline over micro-batches 0..n-1: every stage runs forward(m, x) as soon
    as micro-batch m's input x arrives (None on the first stage) and sends the result on, so
    stage s works on micro-batch m while stage s + 1 works on m - 1. Returns the last stage's
    outputs ([] on the other stages)."""
    def body():
        outs = []
        for m in range(n):
            x = None if comm.is_first else comm.recv(*in_shape(m), down=True)
            y = forward(m, x)
            if comm.is_last:
                outs.append(y)
            else:
                comm.send(y, down=True)
        return outs
    return comm.guard(body)


def run_1f1b(comm: PipeComm, n: int,
             forward: Callable[[int, Optional[torch.Tensor]], torch.Tensor],
             in_shape: Callable[[int], Tuple[Shape, torch.dtype]],
             out_shape: Callable[[int], Tuple[Shape, torch.dtype]]) -> None:
    """One training step's forwards and backwards over micro-batches 0..n-1 (PipeDream-flush
    1F1B, megatron's non-interleaved schedule): stage s runs min(P - s - 1, n) forwards, then
    alternates one forward and one backward, then drains its backwards, so it holds at most
    P - s micro-batches' activations. forward(m, x) returns the stage's output (the last
    stage: the micro-batch's scalar loss); the backward of micro-batch m is autograd from that
    output with the gradient the next stage sent (the loss itself on the last stage), and the
    gradient of x goes to the previous stage. Parameter gradients accumulate over the
    micro-batches in order 0..n-1 on every stage, as at PP 1."""
    saved: Dict[int, Tuple[Optional[torch.Tensor], torch.Tensor]] = {}

    def fwd(m: int) -> None:
        x = None
        if not comm.is_first:
            x = comm.recv(*in_shape(m), down=True).requires_grad_(True)
        y = forward(m, x)
        if not comm.is_last:
            comm.send(y, down=True)
        saved[m] = (x, y)

    def bwd(m: int) -> None:
        x, y = saved.pop(m)
        if comm.is_last:
            y.backward()
        else:
            dy = comm.recv(*out_shape(m), down=False)
            torch.autograd.backward(y, dy)
        if not comm.is_first:
            comm.send(x.grad if x.grad is not None else torch.zeros_like(x), down=False)

    def body():
        warm = min(comm.stages - comm.stage - 1, n)
        for m in range(warm):
            fwd(m)
        for m in range(warm, n):
            fwd(m)
            bwd(m - warm)
        for m in range(n - warm, n):
            bwd(m)
    comm.guard(body)


def micro_batch_bounds(sizes: Sequence[int], n: int) -> List[range]:
    """Split items of the given sizes (e.g. sequence lengths) into n contiguous, non-empty
    groups (1 <= n <= len(sizes)) of nearly equal total size: group g starts at the first item
    whose prefix reaches g / n of the total (kept inside the room the other groups need)."""
    N = len(sizes)
    if not 1 <= n <= max(N, 1):
        raise ValueError(f"tonp_parallel.micro_batch_bounds: cannot split {N} items into {n} "
                         f"non-empty micro-batches")
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    cuts = [0]
    for g in range(1, n):
        j = next((j for j in range(N + 1) if prefix[j] * n >= g * prefix[-1]), N)
        cuts.append(min(max(j, cuts[-1] + 1), N - (n - g)))
    cuts.append(N)
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


__all__ = ["PipeComm", "StageFailed", "run_forward", "run_1f1b", "micro_batch_bounds"]
