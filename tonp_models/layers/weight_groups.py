"""Weight column groups: a second copy of a layer's weights laid out the way the CPU kernels read
them (tonp_kernels.pack_weight_groups; kernels.h): bf16 in eight-column groups that the one-row
tiles read as one stream, fp32 in sixteen-column panels in the lane tiles' order, read at every
row count (the AVX2 build: fp32 only, from four rows). The same bits as the weights in place, the
same size again in memory. Who holds them, from measurements on the AMD EPYC (Zen 4):
- the MoE experts, both dtypes: the bf16 one-row experts streamed 1.2-1.4x as fast on the fast
  bus (1.0-1.1x on the slow one), the fp32 experts 1.03-1.24x at 1-16 rows (the AVX2 table
  there: 1.12-1.53x at 1-8 rows; docs/performance.md);
- the dense linears and the LM head, fp32 weights only (`dense_grouped`): `tk.linear` reads
  their groups in the tasks that run lane passes anyway (32 rows and more on AVX-512, 8 on
  AVX2), which then transpose no weight chunk per task: 64 rows 1.17-1.24x (194-199 GFLOP/s on
  2 threads), prefill row blocks 1.05-1.08x; fewer rows read the weight in place. Their bf16
  weights hold none: one long weight read in place (eight streams a row apart marching
  together) ran as fast or faster through the one-row tiles (0.82-1.02x for the groups on the
  slow bus).

A copy is only as good as its match with the weights, so:
- only forwards inside `reading_weight_groups()` read it: the rollout engine's steps
  (engine/engine.py). A training or scoring forward never does.
- inside, a copy is read only while its weights are the same tensors, storage and version
  counters it was made from and no torch optimizer has stepped since (a global step hook: a fused
  optimizer's writes bump no version counter); otherwise it is dropped and the weights are read in
  place.
- a write that bypasses both (`p.data.copy_(...)`) is not seen: the engine re-packs everything
  after clear_prefix_cache(), which every weight update through the service calls (and which the
  prefix cache's K/V need anyway).

A layer holds groups by deriving from `HoldsWeightGroups` and naming its weights in
`_grouped_weights()`; the engine finds such layers by `pack_weight_groups`.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Optional, Tuple

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

import tonp_kernels as tk

_READ_GROUPS = contextvars.ContextVar("tonp_read_weight_groups", default=False)
_OPTIMIZER_STEPS = [0]   # torch optimizer steps taken in this process (any optimizer)


def _count_step(optimizer, args, kwargs) -> None:
    _OPTIMIZER_STEPS[0] += 1


register_optimizer_step_post_hook(_count_step)


@contextlib.contextmanager
def reading_weight_groups() -> Iterator[None]:
    """Forwards in this context (this thread) read the current weight groups their layers hold."""
    token = _READ_GROUPS.set(True)
    try:
        yield
    finally:
        _READ_GROUPS.reset(token)


def dense_grouped(weight: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The weight a dense linear (or the LM head) keeps in groups: fp32 weights only (above)."""
    return weight if weight is not None and weight.dtype == torch.float32 else None


class HoldsWeightGroups:
    """Mixin of an nn.Module with `chunks`: column groups of the weights `_grouped_weights()`
    names (None entries: weights it does not group), made by `pack_weight_groups()`."""

    _groups: Optional[Tuple[tuple, Tuple[Optional[torch.Tensor], ...]]] = None

    def _grouped_weights(self) -> Tuple[Optional[torch.Tensor], ...]:
        raise NotImplementedError

    def _weights_key(self) -> tuple:
        """What identifies the weights' contents short of reading them: the tensors, their
        storage and their version counters (every in-place write through them bumps it), and
        the process's optimizer steps (a fused optimizer's writes bump no counter)."""
        return (self.chunks, _OPTIMIZER_STEPS[0]) + tuple(
            None if p is None else (id(p), p.data_ptr(), p._version, p.dtype, tuple(p.shape))
            for p in self._grouped_weights())

    def pack_weight_groups(self) -> int:
        """(Re)make the groups from the weights' current values; the bytes they hold (0 where
        the kernels read none: another CPU build, a device)."""
        self._groups = None
        copies = tuple(None if w is None else tk.pack_weight_groups(w, self.chunks)
                       for w in self._grouped_weights())
        self._groups = (self._weights_key(), copies)   # all None: nothing to read, still current
        return self.weight_group_bytes()

    def drop_weight_groups(self) -> None:
        self._groups = None

    def weight_group_bytes(self) -> int:
        """Bytes the groups hold (0: none)."""
        return 0 if self._groups is None else \
            sum(t.numel() * t.element_size() for t in self._groups[1] if t is not None)

    def weight_groups_current(self) -> bool:
        """True when pack_weight_groups ran on the weights as they are now."""
        return self._groups is not None and self._groups[0] == self._weights_key()

    def _read_groups(self) -> Optional[Tuple[Optional[torch.Tensor], ...]]:
        """The groups this forward reads (one per grouped weight), or None: outside
        `reading_weight_groups()`, none held, or made from weights that changed (dropped)."""
        if self._groups is None or not _READ_GROUPS.get():
            return None
        if not self.weight_groups_current():
            self._groups = None
            return None
        return self._groups[1]

    def _read_group(self) -> Optional[torch.Tensor]:
        """The one group a layer of one grouped weight reads (the dense linears), or None."""
        groups = self._read_groups()
        return None if groups is None else groups[0]
