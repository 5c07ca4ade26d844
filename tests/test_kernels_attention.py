"""tonp attention: a query at position t gets the same bits from every path (CONTRACT.md).

The paths: the full causal pass over packed sequences (attention_varlen, training / prefill),
token-by-token decode from a paged cache whose pages are scattered (attention_paged), chunked
prefill with random chunk sizes, and the sequence packed among others of random lengths.
Lengths sit around the block boundaries (1, B-1, B, B+1, 2B, 3B+5) with a small block B=16, and
once with the default B=64. GQA with Hq = 4 Hkv, head_dim 64 and 128. Stock SDPA breaks
decode == full pass (the twin). Plus accuracy, gradients, errors and odd layouts.
"""
from __future__ import annotations

import pytest
import torch

import tonp_kernels as tk
from tonp_kernels import reference
from tonp_models.engine import PageAllocator
from tonp_models.layers.kv_cache import PagedKVCache
from conftest import DTYPES, assert_bitwise, assert_close, check_thread_invariance, env, randn

HQ, HKV = 8, 2  # GQA: 4 query heads per key-value head
GARBAGE = 1e3   # unwritten cache rows hold large values: a kernel that reads them shows it


def _seq(L, D, dtype, gen):
    """q [L, HQ, D], k/v [L, HKV, D] of one sequence."""
    return (randn(L, HQ, D, dtype=dtype, gen=gen), randn(L, HKV, D, dtype=dtype, gen=gen),
            randn(L, HKV, D, dtype=dtype, gen=gen))


class ScatteredCache:
    """A paged K/V cache for the test: pages handed out in a random order, so no sequence's
    pages are contiguous or ascending; every unwritten row holds garbage."""

    def __init__(self, lengths, B, D, dtype, gen, spare_pages=3):
        need = [-(-L // B) for L in lengths]
        P = sum(need) + spare_pages
        self.B = B
        self.k = randn(P, B, HKV, D, dtype=dtype, gen=gen, scale=GARBAGE)
        self.v = randn(P, B, HKV, D, dtype=dtype, gen=gen, scale=GARBAGE)
        order = torch.randperm(P, generator=gen).tolist()
        self.page_table = torch.zeros(len(lengths), max(need + [1]), dtype=torch.int32)
        for s, n in enumerate(need):
            self.page_table[s, :n] = torch.tensor(order[:n], dtype=torch.int32)
            order = order[n:]

    def write(self, seq, start, k, v):
        for i in range(k.shape[0]):
            p = start + i
            page = int(self.page_table[seq, p // self.B])
            self.k[page, p % self.B] = k[i]
            self.v[page, p % self.B] = v[i]

    def attend(self, q, q_seq, q_pos, scale):
        return tk.attention_paged(q, self.k, self.v, self.page_table,
                                  torch.as_tensor(q_seq, dtype=torch.int32),
                                  torch.as_tensor(q_pos, dtype=torch.int64), scale=scale)


def _random_chunks(L, gen):
    cuts, s = [], 0
    while s < L:
        n = int(torch.randint(1, 2 * 16 + 4, (1,), generator=gen))
        cuts.append((s, min(L, s + n)))
        s += n
    return cuts


def _all_paths_agree(L, B, D, dtype, gen):
    scale = D ** -0.5
    q, k, v = _seq(L, D, dtype, gen)
    full = tk.attention_varlen(q, k, v, torch.tensor([0, L]), scale=scale, block=B)
    assert full.shape == q.shape and full.dtype == dtype
    tag = f"L={L} B={B} D={D} {dtype}"

    # Token-by-token decode; the sequence lives in slot 1 of 3, pages scattered.
    cache = ScatteredCache([5, L, 2 * B + 1], B, D, dtype, gen)
    steps = []
    for t in range(L):
        cache.write(1, t, k[t:t + 1], v[t:t + 1])
        steps.append(cache.attend(q[t:t + 1], [1], [t], scale))
    assert_bitwise(torch.cat(steps), full, f"decode vs full pass, {tag}")

    # Chunked prefill with random chunk sizes into a fresh scattered cache.
    cache = ScatteredCache([L], B, D, dtype, gen)
    outs = []
    for s, e in _random_chunks(L, gen):
        cache.write(0, s, k[s:e], v[s:e])
        outs.append(cache.attend(q[s:e], [0] * (e - s), list(range(s, e)), scale))
    assert_bitwise(torch.cat(outs), full, f"chunked prefill vs full pass, {tag}")

    # Packed among other sequences of random lengths (one empty), at a random place.
    others = [int(x) for x in torch.randint(0, 3 * B + 7, (4,), generator=gen)] + [0]
    at = int(torch.randint(0, len(others) + 1, (1,), generator=gen))
    lengths = others[:at] + [L] + others[at:]
    pieces = [_seq(n, D, dtype, gen) if i != at else (q, k, v) for i, n in enumerate(lengths)]
    cu = torch.tensor([0] + lengths).cumsum(0)
    packed = tk.attention_varlen(*(torch.cat(p) for p in zip(*pieces)), cu, scale=scale, block=B)
    assert_bitwise(packed[cu[at]:cu[at + 1]], full, f"packed among {lengths} vs alone, {tag}")

    # One paged call mixing every sequence's queries in a shuffled order (continuous batching).
    cache = ScatteredCache(lengths, B, D, dtype, gen)
    rows = []
    for s, (qs, ks, vs) in enumerate(pieces):
        cache.write(s, 0, ks, vs)
        rows += [(s, t) for t in range(lengths[s])]
    order = torch.randperm(len(rows), generator=gen).tolist()
    rows = [rows[i] for i in order]
    q_mix = torch.stack([pieces[s][0][t] for s, t in rows]) if rows else q[:0]
    mixed = cache.attend(q_mix, [s for s, _ in rows], [t for _, t in rows], scale)
    mine = [i for i, (s, _) in enumerate(rows) if s == at]
    pos = [rows[i][1] for i in mine]
    assert_bitwise(mixed[mine], full[pos], f"mixed paged batch vs full pass, {tag}")
    return full


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", (64, 128))
@pytest.mark.parametrize("L", (1, 15, 16, 17, 32, 53))
def test_full_pass_equals_decode_equals_chunked_prefill_equals_packed(L, D, dtype, gen):
    _all_paths_agree(L, 16, D, dtype, gen)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_paths_agree_with_the_default_block(dtype, gen):
    for L in (63, 65, 197):
        _all_paths_agree(L, 64, 64, dtype, gen)


def test_stock_sdpa_decode_differs_from_the_full_pass(torch_mode, gen):
    """The twin: SDPA for the last query alone differs from the same row of the causal pass."""
    L, B, D = 40, 16, 64
    q, k, v = _seq(L, D, torch.float32, gen)
    full = tk.attention_varlen(q, k, v, torch.tensor([0, L]), scale=D ** -0.5, block=B)
    cache = ScatteredCache([L], B, D, torch.float32, gen)
    cache.write(0, 0, k, v)
    steps = torch.cat([cache.attend(q[t:t + 1], [0], [t], D ** -0.5) for t in range(L)])
    assert not torch.equal(steps, full)


def test_decode_through_the_paged_kv_cache_object(gen):
    """Two sequences decoding in turns through PagedKVCache pages the PageAllocator hands out
    (so their pages interleave) give the full pass's bits: the cache layout and the kernel
    agree."""
    B, D, dtype = 16, 64, torch.bfloat16
    lengths = (37, 20)
    seqs = [_seq(L, D, dtype, gen) for L in lengths]
    pages = PageAllocator(PagedKVCache(1, HKV, D, page_size=B, num_pages=8, max_seqs=3,
                                       max_seq_len=48, dtype=dtype))
    cache = pages.kv
    slots = [pages.add_sequence() for _ in lengths]
    prompt = (5, 3)
    outs = [[] for _ in lengths]

    def step(counts):
        live = [i for i, n in enumerate(counts) if n]
        st = pages.prepare([slots[i] for i in live], [counts[i] for i in live])
        qkv = [tuple(t[pages.lengths[slots[i]]:pages.lengths[slots[i]] + counts[i]]
                     for t in seqs[i]) for i in live]
        q, k, v = (torch.cat(p) for p in zip(*qkv))
        cache.write(0, st, k, v)
        o = tk.attention_paged(q, cache.k[0], cache.v[0], st.page_table, st.q_seq,
                               st.positions, scale=D ** -0.5)
        pages.commit(st)
        for i, part in zip(live, o.split([counts[i] for i in live])):
            outs[i].append(part)

    step(prompt)
    while any(pages.lengths[s] < L for s, L in zip(slots, lengths)):
        step([1 if pages.lengths[s] < L else 0 for s, L in zip(slots, lengths)])
    for i, (q, k, v) in enumerate(seqs):
        full = tk.attention_varlen(q, k, v, torch.tensor([0, lengths[i]]), scale=D ** -0.5,
                                   block=B)
        assert_bitwise(torch.cat(outs[i]), full, f"sequence {i} via PagedKVCache")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,D", [(16, 2, 128), (6, 2, 40), (4, 4, 24)])
def test_head_groups_and_widths_keep_the_portable_builds_bits(hq, hkv, D, dtype, gen):
    """G = 8 query heads a KV head (the softmax's eight head lanes full), 3 (padded) and 1; head_dim
    128, 40 and 24 (the AVX-512 build's sixteen-wide P.V with an eight-wide tail). Decode one
    query at a time (a task per KV head) equals the full pass (a task per query, all its heads),
    and this build equals the portable one on both."""
    L, B = 45, 16
    q = randn(L, hq, D, dtype=dtype, gen=gen)
    k, v = (randn(L, hkv, D, dtype=dtype, gen=gen) for _ in range(2))
    P = -(-L // B)
    order = torch.randperm(P, generator=gen)
    kc, vc = (randn(P, B, hkv, D, dtype=dtype, gen=gen, scale=GARBAGE) for _ in range(2))
    for t in range(L):
        kc[order[t // B], t % B], vc[order[t // B], t % B] = k[t], v[t]
    table = order[None].to(torch.int32)

    def paths():
        full = tk.attention_varlen(q, k, v, torch.tensor([0, L]), scale=D ** -0.5, block=B)
        steps = torch.cat([tk.attention_paged(q[t:t + 1], kc, vc, table, torch.zeros(1, dtype=torch.int32),
                                              torch.tensor([t]), scale=D ** -0.5) for t in range(L)])
        return full, steps

    full, steps = paths()
    assert_bitwise(steps, full, f"decode vs full pass, G={hq // hkv} D={D} {dtype}")
    with env("TONP_FORCE_PORTABLE", "1"):
        assert tk.isa() == "portable"
        portable = paths()
    assert_bitwise((full, steps), portable, f"{tk.isa()} vs portable, G={hq // hkv} D={D} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_thread_count_does_not_change_bits(dtype, gen):
    B, D = 16, 64
    lengths = [3, 40, 17, 1, 70]
    q, k, v = (torch.cat(p) for p in zip(*[_seq(L, D, dtype, gen) for L in lengths]))
    cu = torch.tensor([0] + lengths).cumsum(0)
    check_thread_invariance(lambda q, k, v: tk.attention_varlen(q, k, v, cu, scale=0.1, block=B),
                            q, k, v, what=f"attention_varlen {dtype}")
    cache = ScatteredCache(lengths, B, D, dtype, gen)
    for s, L in enumerate(lengths):
        cache.write(s, 0, k[cu[s]:cu[s + 1]], v[cu[s]:cu[s + 1]])
    q_seq = [s for s, L in enumerate(lengths) for _ in range(L)]
    q_pos = [t for L in lengths for t in range(L)]
    check_thread_invariance(lambda q: cache.attend(q, q_seq, q_pos, 0.1), q,
                            what=f"attention_paged {dtype}")
    check_thread_invariance(lambda q: cache.attend(q, [1], [39], 0.1), q[:1],
                            what=f"attention_paged one query {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", (64, 128))
def test_accuracy_against_the_references(D, dtype, gen):
    B, lengths = 16, [1, 16, 45]
    q, k, v = (torch.cat(p) for p in zip(*[_seq(L, D, dtype, gen) for L in lengths]))
    cu = torch.tensor([0] + lengths).cumsum(0)
    out = tk.attention_varlen(q, k, v, cu, scale=D ** -0.5, block=B)
    assert_close(out, reference.attention_varlen(q, k, v, cu, D ** -0.5), dtype=dtype,
                 what=f"attention_varlen vs fp32 reference D={D}")
    o64 = reference.attention_varlen(q.double(), k.double(), v.double(), cu, D ** -0.5)
    # fp32: accumulation error only; bf16: plus one rounding of the output (2^-8 relative).
    rel, abs_ = (1e-5, 1e-6) if dtype == torch.float32 else (4e-3, 1e-5)
    err = (out.double() - o64).abs()
    assert bool((err <= rel * o64.abs() + abs_).all()), \
        f"attention off the float64 oracle by {float(err.max()):.2e} ({dtype}, D={D})"
    cache = ScatteredCache(lengths, B, D, dtype, gen)
    for s in range(len(lengths)):
        cache.write(s, 0, k[cu[s]:cu[s + 1]], v[cu[s]:cu[s + 1]])
    q_seq, q_pos = torch.tensor([2, 0, 2, 1]), torch.tensor([44, 0, 16, 15])
    got = cache.attend(q[:4], q_seq, q_pos, D ** -0.5)
    want = reference.attention_paged(q[:4], cache.k, cache.v, cache.page_table, q_seq, q_pos,
                                     D ** -0.5)
    assert_close(got, want, dtype=dtype, what="attention_paged vs reference")


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_match_reference_autograd(dtype, gen):
    D, lengths = 64, [5, 20]
    q0, k0, v0 = (torch.cat(p) for p in zip(*[_seq(L, D, dtype, gen) for L in lengths]))
    cu = torch.tensor([0] + lengths).cumsum(0)
    g = randn(*q0.shape, dtype=dtype, gen=gen)

    def grads(fn):
        q, k, v = (t.clone().requires_grad_(True) for t in (q0, k0, v0))
        fn(q, k, v).backward(g)
        return q.grad, k.grad, v.grad

    got = grads(lambda q, k, v: tk.attention_varlen(q, k, v, cu, scale=0.125, block=16))
    want = grads(lambda q, k, v: reference.attention_varlen(q, k, v, cu, 0.125))
    for name, a, e in zip("qkv", got, want):
        assert_close(a, e, dtype=dtype, scale=float(e.abs().max()), what=f"d{name}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_inputs_give_the_bits_of_contiguous_copies(dtype, gen):
    """q, k, v as views of one fused QKV projection (the model's layout), and a strided q."""
    D, L, B = 64, 37, 16
    qkv = randn(L, HQ + 2 * HKV, D, dtype=dtype, gen=gen)
    q, k, v = qkv.split([HQ, HKV, HKV], dim=1)
    assert not q.is_contiguous() and not k.is_contiguous()
    cu = torch.tensor([0, L])
    want = tk.attention_varlen(q.contiguous(), k.contiguous(), v.contiguous(), cu, scale=0.1,
                               block=B)
    assert_bitwise(tk.attention_varlen(q, k, v, cu, scale=0.1, block=B), want, "split QKV views")
    cache = ScatteredCache([L], B, D, dtype, gen)
    cache.write(0, 0, k, v)
    pos = list(range(L))
    assert_bitwise(cache.attend(q, [0] * L, pos, 0.1), want, "paged with a view q")
    q_t = q.transpose(0, 1).contiguous().transpose(0, 1)  # heads outermost in memory
    assert_bitwise(cache.attend(q_t, [0] * L, pos, 0.1), want, "paged with transposed q")


def test_empty_batches(gen):
    D = 64
    q, k, v = _seq(0, D, torch.float32, gen)
    out = tk.attention_varlen(q, k, v, torch.tensor([0]), scale=0.1, block=16)
    assert out.shape == (0, HQ, D)
    out = tk.attention_varlen(q, k, v, torch.tensor([0, 0, 0]), scale=0.1, block=16)
    assert out.shape == (0, HQ, D)
    cache = ScatteredCache([4], 16, D, torch.float32, gen)
    assert cache.attend(q, [], [], 0.1).shape == (0, HQ, D)


def test_bad_inputs_raise_clear_errors(gen):
    D = 64
    q, k, v = _seq(10, D, torch.float32, gen)
    cu = torch.tensor([0, 10])
    with pytest.raises(TypeError, match="dtypes differ"):
        tk.attention_varlen(q, k.bfloat16(), v, cu, scale=0.1)
    with pytest.raises(ValueError, match="head_dim"):
        tk.attention_varlen(q, k[..., :32], v[..., :32], cu, scale=0.1)
    with pytest.raises(ValueError, match="not a multiple"):
        tk.attention_varlen(q[:, :3], k, v, cu, scale=0.1)
    with pytest.raises(ValueError, match="cu_seqlens"):
        tk.attention_varlen(q, k, v, torch.tensor([0, 7]), scale=0.1)
    with pytest.raises(ValueError, match="cu_seqlens"):
        tk.attention_varlen(q, k, v, torch.tensor([0, 6, 4, 10]), scale=0.1)
    with pytest.raises(ValueError, match="tokens"):
        tk.attention_varlen(q, k[:9], v[:9], cu, scale=0.1)
    with pytest.raises(RuntimeError, match="CPU"):
        tk.attention_varlen(*(t.to("meta") for t in (q, k, v)), cu, scale=0.1)
    cache = ScatteredCache([20], 16, D, torch.float32, gen)  # 2 pages per sequence
    with pytest.raises(IndexError, match="capacity"):
        cache.attend(q[:1], [0], [32], 0.1)                     # needs a third page
    with pytest.raises(IndexError, match="q_seq"):
        cache.attend(q[:1], [1], [3], 0.1)
    with pytest.raises(ValueError, match="q_seq/q_pos"):
        cache.attend(q[:2], [0], [3], 0.1)
    with pytest.raises(TypeError, match="dtypes differ"):
        tk.attention_paged(q[:1].bfloat16(), cache.k, cache.v, cache.page_table,
                           torch.tensor([0]), torch.tensor([3]), scale=0.1)
    with pytest.raises(ValueError, match=r"\[pages, block"):
        tk.attention_paged(q[:1], cache.k[0], cache.v[0], cache.page_table,
                           torch.tensor([0]), torch.tensor([3]), scale=0.1)
