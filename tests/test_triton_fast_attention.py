"""The Triton `fast` attention gives a token the same bits in a packed prefill, a chunked prefill
and a one-token paged decode step, whatever shares its batch (Triton's interpreter).

Block B = 16 (the page size), packed sequences of 1, 20 and 37 tokens (one key, a block and a
bit, two blocks and a bit, so prefill tiles mix queries whose last blocks differ), GQA groups of
2 and of 3 (padded to 4 rows), head_dim 16 and 24 (padded to 32), fp32 and bf16; the paged cache
has shuffled pages whose unused rows hold garbage, NaN and inf. The twins: another block size
gives other bits, and stock torch attention breaks prefill == decode.
"""
from __future__ import annotations

import pytest
import torch

import tonp_kernels as tk
from conftest import assert_bitwise, randn
from triton_interpreted import _launch  # first: sets TRITON_INTERPRET
from tonp_kernels.accel import fast_attention as fa  # noqa: E402

B = 16
LENS = (1, 20, 37)


def _packed(Hq, Hkv, D, dtype, gen, lens=LENS):
    T = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return (randn(T, Hq, D, dtype=dtype, gen=gen), randn(T, Hkv, D, dtype=dtype, gen=gen),
            randn(T, Hkv, D, dtype=dtype, gen=gen), cu)


def _paged_cache(k, v, cu, dtype, gen):
    """The packed K/V in shuffled pages of B rows (page i of sequence s is perm[first[s] + i]);
    rows past a sequence's end hold NaN (K) and inf (V), the spare pages large garbage."""
    lens = cu[1:] - cu[:-1]
    need = (lens + B - 1) // B
    first = torch.cat([torch.zeros(1, dtype=torch.int64), need.cumsum(0)])
    perm = torch.randperm(int(first[-1]) + 2, generator=gen)
    shape = (perm.numel(), B) + tuple(k.shape[1:])
    kc = randn(*shape, dtype=dtype, gen=gen, scale=1e3)
    vc = randn(*shape, dtype=dtype, gen=gen, scale=1e3)
    used = perm[:int(first[-1])]
    kc[used], vc[used] = float("nan"), float("inf")  # then overwritten where a key lives
    seq = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    pos = torch.arange(seq.numel()) - cu[seq]
    page = perm[first[seq] + pos // B]
    kc[page, pos % B], vc[page, pos % B] = k, v
    slot = torch.arange(int(need.max()))
    table = perm[(first[:-1, None] + slot).clamp(max=int(first[-1]) - 1)]
    return kc, vc, torch.where(slot < need[:, None], table, 0).to(torch.int32)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("Hq,Hkv,D", ((4, 2, 16), (3, 1, 24)))
def test_prefill_equals_decode_per_token(Hq, Hkv, D, dtype, gen):
    """Every token of every sequence decoded alone (a one-query paged call) equals its row of
    the packed prefill; so does a batch of decode queries from all sequences in one call, and a
    chunk of prefill (positions 3..21 of the longest, consecutive queries sharing a tile)."""
    q, k, v, cu = _packed(Hq, Hkv, D, dtype, gen)
    scale = D ** -0.5
    packed = fa.attention_varlen(q, k, v, cu, scale, B)
    kc, vc, table = _paged_cache(k, v, cu, dtype, gen)
    assert not packed.isnan().any()
    for s, n in enumerate(LENS):
        for t in range(n):
            row = int(cu[s]) + t
            one = fa.attention_paged(q[row:row + 1], kc, vc, table, torch.tensor([s]),
                                     torch.tensor([t]), scale)
            assert_bitwise(one[0], packed[row], f"seq {s} token {t} decoded alone")
    seq = torch.tensor([2, 0, 1, 2, 1] + [2] * 19)
    pos = torch.tensor([36, 0, 19, 16, 3] + list(range(3, 22)))
    rows = cu[seq] + pos
    got = fa.attention_paged(q[rows], kc, vc, table, seq, pos, scale)
    assert_bitwise(got, packed[rows], f"decode batch + chunked prefill {dtype}")


def test_a_sequence_alone_equals_it_packed_with_others(gen):
    """Batch invariance of the training pass: the 37-token sequence alone, and packed after
    others (another offset, other tile boundaries), gives the same rows."""
    q, k, v, cu = _packed(4, 2, 16, torch.bfloat16, gen)
    packed = fa.attention_varlen(q, k, v, cu, 0.25, B)
    s, e = int(cu[2]), int(cu[3])
    alone = fa.attention_varlen(q[s:e], k[s:e], v[s:e], torch.tensor([0, e - s]), 0.25, B)
    assert_bitwise(alone, packed[s:e], "alone vs packed")
    order = [2, 0, 1]
    perm = torch.cat([torch.arange(int(cu[i]), int(cu[i + 1])) for i in order])
    cu2 = torch.tensor([0, *torch.tensor([LENS[i] for i in order]).cumsum(0).tolist()])
    shuffled = fa.attention_varlen(q[perm], k[perm], v[perm], cu2, 0.25, B)
    assert_bitwise(shuffled, packed[perm], "sequences in another order")


def test_the_tile_config_never_depends_on_the_queries():
    """attention_config takes the head shape, the block and the dtype only; a one-query decode
    and a packed prefill launch one kernel with one config (recorded, not run)."""
    cfg = fa.attention_config(32, 4, 128, 64, torch.bfloat16)
    assert (cfg["BQ"] * cfg["GP"], cfg["DOT"]) == (64, "bf16")
    metas = []
    q = torch.zeros(300, 32, 128, dtype=torch.bfloat16)
    kv = torch.zeros(300, 4, 128, dtype=torch.bfloat16)
    cache = torch.zeros(8, 64, 4, 128, dtype=torch.bfloat16)
    for call in (lambda: fa.attention_varlen(q, kv, kv, torch.tensor([0, 300]), 0.1, 64),
                 lambda: fa.attention_paged(q[:1], cache, cache, torch.arange(8)[None],
                                            torch.tensor([0]), torch.tensor([299]), 0.1)):
        _launch.recorder = calls = []
        try:
            call()
        finally:
            _launch.recorder = None
        (kernel, _, meta), = calls
        metas.append((kernel, meta))
    assert metas[0] == metas[1]


def test_other_blocks_and_stock_torch_break_it(gen):
    """The twins: blocks of 2B (another key grouping) give other bits; stock torch's decode
    (SDPA per query) differs from its own full pass, so the tests above can fail."""
    q, k, v, cu = _packed(4, 2, 16, torch.float32, gen, lens=(40,))
    assert not torch.equal(fa.attention_varlen(q, k, v, cu, 0.25, B),
                           fa.attention_varlen(q, k, v, cu, 0.25, 2 * B))
    kc, vc, table = _paged_cache(k, v, cu, torch.float32, gen)
    kc, vc = kc.nan_to_num(0.0, 0.0, 0.0), vc.nan_to_num(0.0, 0.0, 0.0)
    with tk.use("torch"):
        full = tk.attention_varlen(q, k, v, cu, scale=0.25, block=B)
        steps = torch.cat([tk.attention_paged(q[t:t + 1], kc, vc, table, torch.tensor([0]),
                                              torch.tensor([t]), scale=0.25) for t in range(40)])
    assert not torch.equal(steps, full)


def test_bad_inputs_raise_clear_errors(gen):
    """The shared argument rules (_op_checks), and the paged kernel's own: contiguous caches."""
    q, k, v, cu = _packed(4, 2, 16, torch.float32, gen)
    kc, vc, table = _paged_cache(k, v, cu, torch.float32, gen)
    one, zero = torch.tensor([0]), torch.tensor([0])
    strided = kc.transpose(0, 1).contiguous().transpose(0, 1)
    bad = [(ValueError, "multiple of 8", lambda: fa.attention_varlen(
                q[..., :12], k[..., :12], v[..., :12], cu, 0.3, B)),
           (TypeError, "dtypes differ", lambda: fa.attention_varlen(q, k.bfloat16(), v, cu, 0.3,
                                                                    B)),
           (ValueError, "cu_seqlens", lambda: fa.attention_varlen(q, k, v, cu + 1, 0.3, B)),
           (IndexError, "capacity", lambda: fa.attention_paged(q[:1], kc, vc, table, zero,
                                                               torch.tensor([99]), 0.3)),
           (IndexError, "page id", lambda: fa.attention_paged(q[:1], kc, vc, table - 50, zero,
                                                              one, 0.3)),
           (RuntimeError, "contiguous", lambda: fa.attention_paged(q[:1], strided, vc, table,
                                                                   zero, one, 0.3))]
    for exc, match, call in bad:
        with pytest.raises(exc, match=match):
            call()
    assert fa.attention_varlen(q[:0], k[:0], v[:0], cu[:1], 0.3, B).shape == (0, 4, 16)
