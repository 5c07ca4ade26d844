"""tonp_kernels.linear: a row's output depends only on the row and the weight (CONTRACT.md).

Invariances (bitwise): any batch size / offset / order, 1 vs 2 threads, TP splits 1-8 through
linear_partial + tree_sum, non-contiguous inputs. Stock F.linear breaks the batch invariance
(twin test). Accuracy against the fp32 and float64 references, gradients against the
reference's autograd, clear errors on bad input, torch.compile through torch.ops.tonp.linear.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tonp_kernels as tk
from tonp_kernels import reference
from conftest import (DTYPES, ROW_COUNTS, assert_bitwise, assert_close, check_row_invariance,
                      check_thread_invariance, env, randn, rows_differ_somewhere)

# (K, N): small reductions for speed; an odd N (tails of the output tile); K=2048 where it
# matters (the model's hidden size, where MKL's M-dependence was measured).
SHAPES = ((256, 64), (512, 37))


def _weights(K, N, dtype, gen, bias=False):
    w = randn(N, K, dtype=dtype, gen=gen, scale=K ** -0.5)
    b = randn(N, dtype=dtype, gen=gen) if bias else None
    return w, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K,N", SHAPES)
@pytest.mark.parametrize("M", ROW_COUNTS)
def test_row_does_not_depend_on_its_batch(M, K, N, dtype, gen):
    w, b = _weights(K, N, dtype, gen, bias=(N % 2 == 1))
    check_row_invariance(lambda x: tk.linear(x, w, b),
                         lambda n: [randn(n, K, dtype=dtype, gen=gen)], M)


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_invariance_at_k2048_and_fp32_output(dtype, gen):
    K, N = 2048, 48
    w, _ = _weights(K, N, dtype, gen)
    # 8, 9 and 10 rows and 31, 32 and 33: about the fp32 lane-pass thresholds (8; the AVX-512
    # build 32, its dot tiles four rows), each row also computed alone and among other rows
    for M in (1, 5, 8, 9, 10, 31, 32, 33, 64, 129):
        check_row_invariance(lambda x: tk.linear(x, w, out_dtype=torch.float32),
                             lambda n: [randn(n, K, dtype=dtype, gen=gen)], M, seed=M)


@pytest.mark.parametrize("wdtype", (torch.float32, torch.bfloat16))
def test_fp32_dot_tiles_at_every_edge_column_group(wdtype, gen):
    """The fp32 dot products run four weight rows at a time with every row tile on them; a
    panel's last group can be 1, 2 or 3 columns wide (N = 17, 18, 35: edge panels of 1, 2, 3) and
    the last row tile 1-3 rows (the AVX-512 build's tiles take 4, the others 3). Each row's bits
    equal the row alone, among other rows, and the portable build's."""
    K = 256
    for N in (17, 18, 35):
        w = randn(N, K, dtype=wdtype, gen=gen, scale=K ** -0.5)
        for M in (2, 5, 6, 7, 13):
            check_row_invariance(lambda x: tk.linear(x, w, out_dtype=torch.float32),
                                 lambda n: [randn(n, K, dtype=torch.float32, gen=gen)], M, seed=M)
        x = randn(13, K, dtype=torch.float32, gen=gen)
        with env("TONP_FORCE_PORTABLE", "1"):
            portable = tk.linear(x, w, out_dtype=torch.float32)
        assert_bitwise(tk.linear(x, w, out_dtype=torch.float32), portable, f"N={N} native vs portable")


@pytest.mark.parametrize("wdtype", (torch.float32, torch.bfloat16))
def test_fp32_tasks_of_256_and_96_rows_give_the_same_bits(wdtype, gen):
    """The AVX2 and AVX-512 builds' fp32 tasks take up to 256 rows (kRowBlockF32), the portable
    build's 96 (kRowBlock): at 300 rows two tasks of 152 against four of 76, at 256 one against
    three. Every build this CPU runs gives the portable build's bits, and each row its bits alone."""
    K, N = 768, 40
    w = randn(N, K, dtype=wdtype, gen=gen, scale=K ** -0.5)
    x = randn(300, K, dtype=torch.float32, gen=gen)
    with env("TONP_FORCE_PORTABLE", "1"):
        assert tk.isa() == "portable"
        want = [tk.linear(x[:m], w, out_dtype=torch.float32) for m in (256, 300)]
    builds = [tk.isa()] + (["avx2"] if tk.isa() == "avx512bf16" else [])
    for build in builds:
        with env("TONP_FORCE_AVX2", "1" if build == "avx2" else None):
            assert tk.isa() == build
            for m, ref in zip((256, 300), want, strict=True):
                assert_bitwise(tk.linear(x[:m], w, out_dtype=torch.float32), ref, f"{build} M={m} vs portable")
            assert_bitwise(tk.linear(x[299:], w, out_dtype=torch.float32), want[1][299:], f"{build}: the last row alone")


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_invariance_with_short_chunks(dtype, gen):
    """Chunks of 3, 5, 8, 12 and 13 elements (K = 24 .. 104 at C = 8): the dot products (1 and
    2 rows), the lane passes (from 3 rows when a chunk is at most 8 elements, from 8 otherwise)
    and the vector tails all give a row the same bits, in the AVX2 and the portable builds."""
    for K, N in ((24, 37), (40, 16), (64, 64), (96, 21), (104, 40)):
        w, b = _weights(K, N, dtype, gen, bias=True)
        for M in (1, 2, 3, 7, 100):
            check_row_invariance(lambda x: tk.linear(x, w, b),
                                 lambda n: [randn(n, K, dtype=dtype, gen=gen)], M, seed=M)
        x = randn(100, K, dtype=dtype, gen=gen)
        for m in (7, 100):  # 7: dot tiles with tails and an edge tile (kc > 8), or lane passes
            with env("TONP_FORCE_PORTABLE", "1"):
                portable = tk.linear(x[:m], w, b)
            assert_bitwise(tk.linear(x[:m], w, b), portable, f"K={K} M={m} native vs portable")
        assert_close(tk.linear(x, w, b), reference.linear(x, w, b), dtype=dtype,
                     what=f"K={K} vs reference")


def test_row_invariance_on_fp32_weight_groups(gen):
    """Given its fp32 weight groups, tk.linear reads them from a row count chosen per CPU
    (torch.ops.tonp.linear_group_rows(): 1 on an AMD Zen 5 and on Intel, 20 on other AVX-512
    CPUs, 8 on AVX2) and in place below it, in row blocks whose lane-packed x fits a per-CPU
    budget (kernels.h group_row_block: 60 rows at K = 2048 on Intel, else 256): each row alone,
    among other rows and on another thread count gives the same bits across those thresholds
    (the twin: test_stock_torch_linear_depends_on_the_batch)."""
    K, N = 2048, 48
    w, _ = _weights(K, N, torch.float32, gen)
    groups = tk.pack_weight_groups(w)
    f = lambda x: tk.linear(x, w, weight_groups=groups)  # noqa: E731
    for M in (1, 2, 3, 7, 8, 9, 19, 20, 21, 31, 32, 33, 64, 65, 129):
        check_row_invariance(f, lambda n: [randn(n, K, gen=gen)], M, seed=M)
    x = randn(21, K, gen=gen)
    assert_bitwise(f(x), tk.linear(x, w), "groups against the weight in place")
    check_thread_invariance(f, x, what="linear on fp32 groups, M=21")


def test_large_fp32_calls_pack_their_groups_with_the_same_bits(gen):
    """On Intel a call of at least 512 rows on an fp32 weight given without its groups packs them
    itself (kernels.h kLinearPackRowsIntel, when K >= 2048 and its chunks are longer than the
    two-panel tiles take: K = 4096 with 8 chunks), where fewer rows read the weight in place:
    each row alone and among other rows, across that threshold, gives the same bits, as do the
    groups passed in and the portable build (the twin:
    test_stock_torch_linear_depends_on_the_batch)."""
    K, N = 4096, 56  # three whole panels and an edge panel of eight columns (read in place)
    w, b = _weights(K, N, torch.float32, gen, bias=True)
    f = lambda x: tk.linear(x, w, b)  # noqa: E731
    for M in (511, 512):
        check_row_invariance(f, lambda n: [randn(n, K, gen=gen)], M, seed=M)
    x = randn(600, K, gen=gen)
    groups = tk.pack_weight_groups(w)
    if groups is not None:
        assert_bitwise(f(x), tk.linear(x, w, b, weight_groups=groups), "packed in the call against passed in")
    with env("TONP_FORCE_PORTABLE", "1"):
        portable = f(x)
    assert_bitwise(f(x), portable, "native against portable")
    check_thread_invariance(f, x, what="linear fp32, M=600")


@pytest.mark.parametrize("K,N,chunks", [(768, 80, 8), (256, 56, 1), (4096, 48, 8)])
def test_two_panel_lane_tiles_give_the_portable_bits(K, N, chunks, gen):
    """On Intel, fp32 lane passes take two adjacent whole panels a call in tiles of 6 rows
    (kernels.h kLanePanelsIntel, kPairTileRows) on chunks of at most 256 (kPairTileMaxKc; longer
    chunks keep one panel and 8-row tiles), in place and on groups, and row blocks cut to a byte
    cap hold whole tiles. Chunks of 96, exactly 256 and 512; five panels (two pairs and one alone)
    and three plus an edge panel of eight columns; row counts around the 6-row tiles, the
    lane-pass threshold and the 256-row blocks (a chunk read by several tiles spreads the next
    block's prefetch over them: a hint, no bit): each row alone and among others, with and
    without groups, gives the portable build's bits (the twin:
    test_stock_torch_linear_depends_on_the_batch). TONP_FORCE_PAIR_TILES=1 runs those tiles on
    any AVX512-BF16 CPU (Intel's choice; elsewhere the table's own, checked the same way)."""
    w, b = _weights(K, N, torch.float32, gen, bias=True)
    groups = tk.pack_weight_groups(w, chunks)
    f = lambda x: tk.linear(x, w, b, chunks=chunks)  # noqa: E731
    fg = lambda x: tk.linear(x, w, b, chunks=chunks, weight_groups=groups)  # noqa: E731
    x = randn(600, K, gen=gen)
    with env("TONP_FORCE_PORTABLE", "1"):
        want = {m: f(x[:m]) for m in (1, 5, 6, 7, 12, 31, 32, 37, 97, 257, 600)}
    for pair_tiles in ("0", "1"):
        with env("TONP_FORCE_PAIR_TILES", pair_tiles):
            for M in (6, 13, 33, 257):
                check_row_invariance(f, lambda n: [randn(n, K, gen=gen)], M, seed=M)
            for m, ref in want.items():
                assert_bitwise(f(x[:m]), ref, f"K={K} M={m} in place vs portable, pair tiles {pair_tiles}")
                assert_bitwise(fg(x[:m]), ref, f"K={K} M={m} on groups vs portable, pair tiles {pair_tiles}")


def test_stock_torch_linear_depends_on_the_batch(torch_mode, gen):
    """The twin: F.linear(x[:m]) != F.linear(x)[:m] for some m in fp32 (MKL picks its algorithm
    by M), so the invariance tests above can fail."""
    K, N = 2048, 256
    w, _ = _weights(K, N, torch.float32, gen)
    assert rows_differ_somewhere(lambda x: tk.linear(x, w),
                                 lambda n: [randn(n, K, gen=gen)], (16, 64))


@pytest.mark.parametrize("dtype", DTYPES)
def test_thread_count_does_not_change_bits(dtype, gen):
    K, N, M = 512, 96, 203
    w, b = _weights(K, N, dtype, gen, bias=True)
    x = randn(M, K, dtype=dtype, gen=gen)
    check_thread_invariance(lambda x: tk.linear(x, w, b), x, what=f"linear {dtype} M={M}")
    check_thread_invariance(lambda x: tk.linear(x, w, b), x[:1], what=f"linear {dtype} M=1")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", (512, 2048))
def test_tp_subtree_partials_finish_to_the_same_bits(K, dtype, gen):
    """A TP-t row-parallel rank holds K/t columns = C/t chunks; its fp32 subtree partials,
    finished by tree_sum in rank order, equal the one-call kernel for t = 1, 2, 4, 8."""
    C, N = 8, 40
    w, b = _weights(K, N, dtype, gen, bias=True)
    x = randn(33, K, dtype=dtype, gen=gen)
    whole32 = tk.linear(x, w, chunks=C, out_dtype=torch.float32)
    whole = tk.linear(x, w, chunks=C)
    whole_b32 = tk.linear(x, w, b, chunks=C, out_dtype=torch.float32)
    for t in (1, 2, 4, 8):
        cols = K // t
        parts = [tk.linear_partial(x[:, r * cols:(r + 1) * cols], w[:, r * cols:(r + 1) * cols],
                                   chunks=C // t) for r in range(t)]
        assert all(p.dtype == torch.float32 for p in parts)
        summed = tk.tree_sum(parts)
        assert_bitwise(summed, whole32, f"TP={t} subtree partials vs one call (K={K}, {dtype})")
        assert_bitwise(summed.to(dtype), whole, f"TP={t} rounded once vs one call ({dtype})")
        # A row-parallel layer adds its bias after the reduction, in fp32.
        assert_bitwise(summed + b.float(), whole_b32, f"TP={t} + bias vs one call with bias")
        assert_bitwise(tk.tree_sum(torch.stack(parts)), summed, "tree_sum of a stacked tensor")


def test_tree_sum_is_the_fixed_pairwise_tree_for_any_count(gen):
    """Level by level, an odd last node carried up (the cross-rank sum of tonp_parallel uses the
    same function); in_place accumulates into the left operands with the same bits."""
    p = [randn(257, gen=gen, scale=10.0 ** (i % 5)) for i in range(8)]  # magnitudes: order shows
    want = {1: p[0], 2: p[0] + p[1], 3: (p[0] + p[1]) + p[2],
            5: ((p[0] + p[1]) + (p[2] + p[3])) + p[4],
            6: ((p[0] + p[1]) + (p[2] + p[3])) + (p[4] + p[5]),
            7: ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + p[6]),
            8: ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]))}
    assert not torch.equal(want[8], (((p[0] + p[1]) + p[2]) + p[3]) + (p[4] + p[5] + p[6] + p[7]))
    for n, expected in want.items():
        assert_bitwise(tk.tree_sum(p[:n]), expected, f"tree_sum of {n}")
        assert_bitwise(tk.tree_sum(torch.stack(p[:n])), expected, f"stacked tree_sum of {n}")
        copies = [t.clone() for t in p[:n]]
        got = tk.tree_sum(copies, in_place=True)
        assert_bitwise(got, expected, f"in-place tree_sum of {n}")
        assert got.data_ptr() == copies[0].data_ptr(), "accumulates into the first partial"


def test_chunks_one_is_a_single_sequential_chain(gen):
    """chunks=1 is a valid tree (one chunk); it must still be row-invariant."""
    K, N = 96, 24
    w, _ = _weights(K, N, torch.float32, gen)
    check_row_invariance(lambda x: tk.linear(x, w, chunks=1), lambda n: [randn(n, K, gen=gen)], 37)


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_inputs_give_the_bits_of_contiguous_copies(dtype, gen):
    K, N, M = 256, 48, 29
    w, b = _weights(K, N, dtype, gen, bias=True)
    expected_x = randn(M, K, dtype=dtype, gen=gen)
    transposed = expected_x.t().contiguous().t()          # column-major view
    strided = torch.stack([expected_x, expected_x], -1)[..., 0]  # stride 2 along K
    row_strided = torch.cat([expected_x, expected_x], 1)[:, :K]  # rows 2K apart
    ref = tk.linear(expected_x, w, b)
    for name, x in (("transposed", transposed), ("strided", strided), ("row-strided", row_strided)):
        assert not x.is_contiguous()
        assert_bitwise(tk.linear(x, w, b), ref, f"{name} x")
    w_t = w.t().contiguous().t()
    assert_bitwise(tk.linear(expected_x, w_t, b), ref, "column-major weight")
    b_s = torch.stack([b, b], -1)[:, 0]
    assert_bitwise(tk.linear(expected_x, w, b_s), ref, "strided bias")


def test_leading_dims_and_empty_batch(gen):
    K, N = 64, 16
    w, b = _weights(K, N, torch.float32, gen, bias=True)
    x = randn(2, 5, K, gen=gen)
    y = tk.linear(x, w, b)
    assert y.shape == (2, 5, N)
    assert_bitwise(y.reshape(10, N), tk.linear(x.reshape(10, K), w, b), "[2, 5, K] vs [10, K]")
    for dtype in DTYPES:
        empty = tk.linear(torch.empty(0, K, dtype=dtype), w.to(dtype), b.to(dtype))
        assert empty.shape == (0, N) and empty.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", (256, 2048))
def test_accuracy_against_the_references(K, dtype, gen):
    N, M = 56, 17
    w, b = _weights(K, N, dtype, gen, bias=True)
    x = randn(M, K, dtype=dtype, gen=gen)
    y = tk.linear(x, w, b)
    assert y.dtype == dtype
    assert_close(y, reference.linear(x, w, b), dtype=dtype, what=f"linear vs fp32 reference")
    # float64 oracle: the fp32 chunked chain errs at most ~ (K/C + log C) eps sum|x w|.
    y64 = reference.linear(x.double(), w.double(), b.double())
    bound = (x.double().abs() @ w.double().abs().t() + b.double().abs())
    rel = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: one output rounding
    y32 = tk.linear(x, w, b, out_dtype=torch.float32)
    assert bool(((y32.double() - y64).abs() <= 1e-5 * bound + 1e-7).all()), \
        f"fp32 accumulation off the float64 oracle: {float((y32.double() - y64).abs().max()):.2e}"
    assert bool(((y.double() - y64).abs() <= rel * bound + 1e-6).all()), \
        f"{dtype} output off the float64 oracle by {float((y.double() - y64).abs().max()):.2e}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_match_reference_autograd(dtype, gen):
    K, N, M = 128, 24, 9
    w0, b0 = _weights(K, N, dtype, gen, bias=True)
    x0 = randn(M, K, dtype=dtype, gen=gen)
    g = randn(M, N, dtype=dtype, gen=gen)

    def grads(fn):
        x, w, b = (t.clone().requires_grad_(True) for t in (x0, w0, b0))
        fn(x, w, b).backward(g)
        return x.grad, w.grad, b.grad

    got, want = grads(tk.linear), grads(reference.linear)
    for name, a, e in zip(("x", "weight", "bias"), got, want):
        assert a.dtype == e.dtype == dtype
        assert_close(a, e, dtype=dtype, scale=float(e.abs().max()), what=f"d{name}")


def _update_under_no_grad(w, new):      # an optimizer step
    with torch.no_grad():
        w.copy_(new)
    return w


def _update_through_data(w, new):      # a weight sync through .data (own version counter)
    w.data.copy_(new)
    return w


def _update_inference_tensor(w, new):  # rollout-side weights made under inference_mode
    with torch.inference_mode():
        w_inf = w.detach().clone()
        tk.linear(torch.zeros(1, w.shape[1]), w_inf)
        w_inf.copy_(new)
    return w_inf


@pytest.mark.parametrize("update", (_update_under_no_grad, _update_through_data,
                                    _update_inference_tensor), ids=lambda f: f.__name__[8:])
def test_packed_weights_follow_in_place_updates(update, gen):
    """If the kernel keeps any packed copy of a weight, every way a trainer or a weight sync
    rewrites a weight in place must be seen (a stale pack would silently use old weights)."""
    K, N = 64, 16
    x = randn(3, K, gen=gen)
    w = torch.nn.Parameter(randn(N, K, gen=gen))
    tk.linear(x, w)
    w = update(w, randn(N, K, gen=gen))
    assert_bitwise(tk.linear(x, w).detach(), tk.linear(x, w.detach().clone()),
                   f"linear after {update.__name__}")


def test_mixed_dtypes_compute_in_fp32_and_round_once(gen):
    """x and weight may differ in dtype (bf16 weights with fp32 activations, or the reverse):
    both are read as fp32, accumulated in fp32 and rounded once to the output dtype. A bf16
    weight and its fp32 copy take different layouts at 8-19 rows (dot products vs lane passes,
    kernels.h) and still give the same bits."""
    K, N = 128, 24
    w32 = randn(N, K, gen=gen, scale=K ** -0.5)
    w16, b16 = w32.bfloat16(), randn(N, gen=gen).bfloat16()
    for M in (9, 16, 19, 20, 100):
        x32 = randn(M, K, gen=gen)
        y = tk.linear(x32, w16, b16)
        assert y.dtype == torch.float32
        assert_bitwise(y, tk.linear(x32, w16.float(), b16.float()), f"fp32 x, bf16 weight, M={M}")
    x32 = randn(9, K, gen=gen)
    x16 = x32.bfloat16()
    y = tk.linear(x16, w32)
    assert y.dtype == torch.bfloat16
    assert_bitwise(y, tk.linear(x16.float(), w32).bfloat16(), "bf16 x, fp32 weight")


def test_bad_inputs_raise_clear_errors(gen):
    w = randn(16, 100, gen=gen)
    with pytest.raises(ValueError, match="divisible"):
        tk.linear(randn(3, 100, gen=gen), w)          # K=100, C=8
    with pytest.raises(ValueError, match="power of two"):
        tk.linear(randn(3, 96, gen=gen), randn(16, 96, gen=gen), chunks=3)
    with pytest.raises(ValueError, match="match"):
        tk.linear(randn(3, 64, gen=gen), randn(16, 96, gen=gen))
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        tk.linear(randn(3, 64, gen=gen), randn(16, 64, gen=gen), out_dtype=torch.float16)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        tk.linear(torch.ones(3, 64, dtype=torch.float16), torch.ones(16, 64, dtype=torch.float16))
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        tk.linear(torch.ones(3, 64, dtype=torch.int32), torch.ones(16, 64))
    with pytest.raises(RuntimeError, match="CPU"):
        tk.linear(torch.empty(3, 64, device="meta"), torch.empty(16, 64, device="meta"))
    with pytest.raises((ValueError, RuntimeError), match="(?i)bias"):
        tk.linear(randn(3, 64, gen=gen), randn(16, 64, gen=gen), randn(15, gen=gen))
    with pytest.raises(ValueError, match="no partials"):
        tk.tree_sum([])


def test_torch_compile_through_the_op(gen):
    """torch.ops.tonp.linear traces under torch.compile (fake impl + autograd registration)."""
    K, N = 64, 16
    w = randn(N, K, gen=gen)

    def f(x, w):
        return torch.relu(torch.ops.tonp.linear(x, w, None, 8, None)) * 2.0

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    x = randn(7, K, gen=gen).requires_grad_(True)
    out = compiled(x, w)
    assert_bitwise(out, f(x, w), "compiled vs eager")
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    via_api = torch.compile(lambda x: tk.linear(x, w) + 1, backend="aot_eager")
    assert_bitwise(via_api(x.detach()), tk.linear(x.detach(), w) + 1, "compiled tk.linear")


def test_stock_mode_matches_f_linear(torch_mode, gen):
    x, w = randn(5, 32, gen=gen), randn(8, 32, gen=gen)
    assert_bitwise(tk.linear(x, w), F.linear(x, w), "torch mode is F.linear")
