"""Sequence parallelism (Megatron's) gives the bits of SP off.

In the norm and residual regions each TP rank holds ceil(T / tp) token rows (zero rows pad T
to a multiple of tp; they never meet a real row in a reduction: every op there is row-wise,
the all-gather drops them before attention, linears and routing, and the reduce-scatter that
replaces the row-parallel all-reduce adds them after the partials). The reduce-scatter is the
fixed tree of the all-reduce it replaces. One spawn of 4 gloo ranks walks TP 2 and TP 4 with
SP, TP 2 x EP 2 with SP, PP 2 x TP 2 with SP and CP 2 x TP 2 with SP (ragged sequences: 74
tokens, not a multiple of 4; decode steps of 3 rows): token_logprobs, logits, generate, a
training step's loss: torch.equal to SP off (= the one-process model); gradients within
2e-6 + 1e-5 |g| (backward reduce-scatters in the backend's order); the twins: stock torch
changes the bits at every layout, and at TP 4 SP itself changes them (gloo's reduce_scatter
sums in another order than its all_reduce; at TP 2 the two addends commute).
"""
from __future__ import annotations

import pytest
import torch

import layout_walk as lw
from dist_utils import run_distributed

WORLD = 4
LAYOUTS = [dict(), dict(tp=4), dict(tp=4, sp=True), dict(tp=2, sp=True),
           dict(tp=2, ep=2, sp=True), dict(pp=2, tp=2, sp=True), dict(cp=2, tp=2, sp=True)]


@pytest.mark.timeout(600)
def test_sequence_parallel_layouts_equal_sp_off():
    """Bits, rescoring, gradients and the twins (see the module doc); stock torch at TP 4
    gives other bits with SP than without (the backend's reduce_scatter)."""
    spawned = run_distributed(lw.walk, WORLD, LAYOUTS, timeout=600)
    lw.check_layouts(spawned)
    by = {r["layout"]: r["twin"] for r in spawned[0]}
    sp, off = by[lw.key(dict(tp=4, sp=True))], by[lw.key(dict(tp=4))]
    assert any(not torch.equal(a, b) for a, b in zip(sp, off)), \
        "stock torch at TP 4 gave the same bits with and without SP"


def test_sequence_split_pads_and_shares():
    from tonp_parallel.sequence import SequenceSplit
    s = SequenceSplit(None, 7)
    assert (s.local, s.pad, s.size) == (7, 0, 1)
    x = torch.arange(6.0).view(3, 2)
    assert s.scatter(x) is x and s.gather(x) is x and s.reduce_scatter(x) is x
