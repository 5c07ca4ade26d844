"""Context parallelism gives the one-process model's bits (CONTRACT.md, Attention).

Each CP rank holds zig-zag chunks r and 2C-1-r of every packed sequence, gathers every rank's
keys and values into pages of the attention block and reads positions 0..t of its sequence
through the paged kernel: the blocks and their order are CP 1's. One spawn of 4 gloo ranks
walks CP in {1, 2, 4}, CP 2 x TP 2 and PP 2 x CP 2 (tests/layout_walk.py; sequences of 3 to 37
tokens, some shorter than 2C, one spanning three blocks): token_logprobs, logits, generate
(decode runs every row on every CP rank), a training step's loss and logprobs: torch.equal;
gradients after the DP x CP sum within 2e-6 + 1e-5 |g| of CP 1's (the backward recomputes
attention with torch math per block of queries and sums key/value gradients over the ranks);
the twin: stock torch's attention of a slice of the queries differs from the causal pass.
"""
from __future__ import annotations

import pytest
import torch

import layout_walk as lw
from dist_utils import run_distributed

WORLD = 4
LAYOUTS = [dict(), dict(cp=2), dict(cp=4), dict(cp=2, tp=2), dict(pp=2, cp=2)]


@pytest.mark.timeout(600)
def test_context_parallel_layouts_equal_the_one_process_model():
    """Bits, rescoring, gradients and the stock-torch twins (see the module doc)."""
    spawned = run_distributed(lw.walk, WORLD, LAYOUTS, timeout=600)
    lw.check_layouts(spawned)


def test_zig_zag_split():
    """Rank r holds chunks r and 2C-1-r of each sequence (row_share's chunks); every row once;
    the causal work (keys read: position + 1 a row) differs by < 3% between ranks, where
    contiguous slices would differ by > 50%."""
    import tonp_parallel.context as ctx
    from tonp_parallel.sharding import row_share
    bounds = [0, 7, 8, 8, 300, 301, 333]
    for C in (2, 3, 4):
        splits = []
        for r in range(C):
            s = ctx.ContextSplit.__new__(ctx.ContextSplit)
            orig = ctx.group_size, ctx.group_rank
            ctx.group_size, ctx.group_rank = (lambda g, C=C: C), (lambda g, r=r: r)
            try:
                s.__init__(bounds, object())
            finally:
                ctx.group_size, ctx.group_rank = orig
            splits.append(s)
        rows = splits[0].rows_of
        assert torch.equal(torch.sort(torch.cat(rows)).values, torch.arange(bounds[-1]))
        a, b = 8, 300                                              # the 292-token sequence
        for r in range(C):
            want = []
            for j in (r, 2 * C - 1 - r):
                start, n = row_share(b - a, 2 * C, j)
                want += range(a + start, a + start + n)
            got = [x for x in rows[r].tolist() if a <= x < b]
            assert got == sorted(want), (C, r)
        pos = splits[0].positions + 1
        work = [int(pos[rs].sum()) for rs in rows]
        assert max(work) - min(work) < 0.03 * sum(work) / C, work
        naive = [int(p.sum()) for p in pos[8:300].chunk(C)]
        assert max(naive) - min(naive) > 0.5 * sum(naive) / C, naive
        dest, table = splits[0].key_pages(16)
        assert dest.shape == (bounds[-1],) and table.shape == (6, 19)
