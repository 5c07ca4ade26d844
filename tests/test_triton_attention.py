"""The Triton `exact` attention equals the C++ kernel bit for bit (run by Triton's interpreter).

Packed ragged sequences (lengths 1 to 3 blocks and a bit, block B=4 so every length crosses
block edges), GQA with a group of 2 and of 3 (not a power of two), head_dim 16 and 24 (not a
power of two), fp32 and bf16; a paged cache whose pages are shuffled and whose unused rows hold
garbage, queried at decode, chunked-prefill and first positions: each equals
torch.ops.tonp.attention_{varlen,paged}, and a paged query equals the packed pass's row at its
position. The twin: stock SDPA gives other bits.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_bitwise, randn
from triton_interpreted import attention

B = 4
LENS = (1, 6, 9)  # a lone token, one and a half blocks, two blocks and one key


def _packed(Hq, Hkv, D, dtype, gen, lens=LENS):
    T = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return (randn(T, Hq, D, dtype=dtype, gen=gen), randn(T, Hkv, D, dtype=dtype, gen=gen),
            randn(T, Hkv, D, dtype=dtype, gen=gen), cu)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("Hq,Hkv,D", ((4, 2, 16), (3, 1, 24)))
def test_attention_varlen_equals_cpp(Hq, Hkv, D, dtype, gen):
    q, k, v, cu = _packed(Hq, Hkv, D, dtype, gen)
    got = attention.attention_varlen(q, k, v, cu, D ** -0.5, B)
    assert_bitwise(got, torch.ops.tonp.attention_varlen(q, k, v, cu, D ** -0.5, B),
                   f"varlen Hq={Hq} Hkv={Hkv} D={D} {dtype}")


def _paged_cache(k, v, cu, dtype, gen, spare=3):
    """Scatter the packed K/V into shuffled pages of B rows; other rows hold garbage."""
    lens = (cu[1:] - cu[:-1]).tolist()
    need = [-(-n // B) for n in lens]
    P = sum(need) + spare
    shape = (P, B) + tuple(k.shape[1:])
    kc = randn(*shape, dtype=dtype, gen=gen, scale=1e3)
    vc = randn(*shape, dtype=dtype, gen=gen, scale=1e3)
    order = torch.randperm(P, generator=gen).tolist()
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    for s, n in enumerate(lens):
        table[s, :need[s]] = torch.tensor(order[:need[s]], dtype=torch.int32)
        order = order[need[s]:]
        for p in range(n):
            page = int(table[s, p // B])
            kc[page, p % B] = k[int(cu[s]) + p]
            vc[page, p % B] = v[int(cu[s]) + p]
    return kc, vc, table


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_attention_paged_equals_cpp_and_the_packed_pass(dtype, gen):
    """Decode (each sequence's last position), a chunk of prefill (positions 3..6 of the
    longest) and position 0, in one call, against the C++ op and against the packed rows."""
    Hq, Hkv, D = 4, 2, 16
    q, k, v, cu = _packed(Hq, Hkv, D, dtype, gen)
    kc, vc, table = _paged_cache(k, v, cu, dtype, gen)
    seq = torch.tensor([0, 1, 2, 2, 2, 2, 2, 1])
    pos = torch.tensor([0, 5, 8, 3, 4, 5, 6, 0])
    rows = cu[seq] + pos
    qq = q[rows]
    got = attention.attention_paged(qq, kc, vc, table, seq, pos, D ** -0.5)
    assert_bitwise(got, torch.ops.tonp.attention_paged(qq, kc, vc, table, seq, pos, D ** -0.5),
                   f"paged {dtype}")
    packed = attention.attention_varlen(q, k, v, cu, D ** -0.5, B)
    assert_bitwise(got, packed[rows], f"paged == packed rows {dtype}")


def test_stock_sdpa_differs_from_the_exact_bits(gen):
    """The twin: SDPA over the longest sequence gives other bits than the exact kernel."""
    q, k, v, cu = _packed(4, 2, 16, torch.float32, gen, lens=(9,))
    exact = attention.attention_varlen(q, k, v, cu, 0.25, B)
    sdpa = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          is_causal=True, scale=0.25, enable_gqa=True)
    assert not torch.equal(sdpa.transpose(0, 1), exact)


def test_bad_inputs_raise_clear_errors(gen):
    q, k, v, cu = _packed(4, 2, 16, torch.float32, gen)
    with pytest.raises(ValueError, match="multiple of 8"):
        attention.attention_varlen(q[..., :12], k[..., :12], v[..., :12], cu, 0.3, B)
    with pytest.raises(TypeError, match="dtypes differ"):
        attention.attention_varlen(q, k.bfloat16(), v, cu, 0.3, B)
    with pytest.raises(ValueError, match="cu_seqlens"):
        attention.attention_varlen(q, k, v, cu + 1, 0.3, B)
    kc, vc, table = _paged_cache(k, v, cu, torch.float32, gen)
    with pytest.raises(IndexError, match="capacity"):
        attention.attention_paged(q[:1], kc, vc, table, torch.tensor([0]), torch.tensor([99]), 0.3)
    with pytest.raises(IndexError, match="page id"):
        attention.attention_paged(q[:1], kc, vc, table - 50, torch.tensor([0]), torch.tensor([0]),
                                  0.3)
    with pytest.raises(IndexError, match="q_seq"):
        attention.attention_paged(q[:1], kc, vc, table, torch.tensor([7]), torch.tensor([0]), 0.3)
    assert attention.attention_varlen(q[:0], k[:0], v[:0], cu[:1], 0.3, B).shape == (0, 4, 16)
