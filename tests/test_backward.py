"""Backward passes of every tonp op: correct, and deterministic.

Correct: gradients against torch autograd of the float64 reference (tonp_kernels.reference) on
the same input values, fp32 and bf16, at the shapes TP and EP produce (one row, odd widths,
chunks not a multiple of 16, experts that receive no rows or more rows than a GEMM tile, an EP
rank's share of the experts, empty sequences), in every build this CPU has (native, the AVX2
table, the portable one: each has its own backward GEMM).
Deterministic: the same inputs give the same gradient bits twice, and with 1 and 2 threads.
"""
from __future__ import annotations

import pytest
import torch

import tonp_kernels as tk
import tonp_kernels.amx  # noqa: F401  (tk.amx: the AMX tests below, run alone or in the suite)
from tonp_kernels import reference
from conftest import assert_bitwise, env, num_threads, randn

BUILDS = {"native": ("TONP_FORCE_PORTABLE", None), "avx2": ("TONP_FORCE_AVX2", "1"),
          "portable": ("TONP_FORCE_PORTABLE", "1")}
# Where this process may run AMX, the native build's bf16 x bf16 backward GEMM runs on it
# (csrc/gemm_amx.h): its zmm tiles (TONP_BACKWARD_AMX=0) are then a build of their own.
if torch.ops.tonp.backward_gemm() == "amx":
    BUILDS["avx512bf16 without AMX"] = ("TONP_BACKWARD_AMX", "0")
DTYPES = (torch.float32, torch.bfloat16)


def grads_of(fn, inputs, grad_out):
    """d(sum(fn(*inputs) * grad_out)) / d(every floating input), as a list (None if unused)."""
    ins = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*ins)
    diff = [t for t in ins if t.requires_grad]
    got = torch.autograd.grad(out, diff, grad_out, allow_unused=True)
    return list(got)


def check_grads(fn, ref, inputs, grad_out, dtype, what):
    """tonp's gradients against the float64 reference's, relative to each gradient's size."""
    got = grads_of(fn, inputs, grad_out)
    want = grads_of(ref, [t.double() if t.is_floating_point() else t for t in inputs],
                    grad_out.double())
    tol = 1e-4 if dtype == torch.float32 else 4e-2
    floats = [t for t in inputs if t.is_floating_point()]
    for i, (a, e, t) in enumerate(zip(got, want, floats)):
        if e is None:
            continue
        assert a is not None and a.dtype == t.dtype and a.shape == t.shape, f"{what}: gradient {i}"
        scale = float(e.abs().max()) if e.numel() else 1.0
        err = float((a.double() - e).abs().max()) if e.numel() else 0.0
        assert err <= tol * (scale or 1.0), f"{what}: gradient {i} off by {err:.3e} (scale {scale:.3e})"


def check_deterministic(fn, inputs, grad_out, what):
    first = grads_of(fn, inputs, grad_out)
    with num_threads(1):
        one = grads_of(fn, inputs, grad_out)
    with num_threads(2):
        two = grads_of(fn, inputs, grad_out)
    for a, b, c in zip(first, one, two):
        if a is not None:
            assert_bitwise(c, a, f"{what}: twice")
            assert_bitwise(b, a, f"{what}: 1 thread vs 2")


def run_everywhere(fn, ref, inputs, grad_out, dtype, what):
    for build, (var, val) in BUILDS.items():
        with env(var, val):
            check_grads(fn, ref, inputs, grad_out, dtype, f"{what} [{build}]")
            check_deterministic(fn, inputs, grad_out, f"{what} [{build}]")


# --- linear ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,K,N", [(1, 64, 37), (7, 40, 16), (33, 256, 100), (300, 96, 70)])
def test_linear(M, K, N, dtype, gen):
    x = randn(M, K, dtype=dtype, gen=gen)
    w = randn(N, K, dtype=dtype, gen=gen, scale=K ** -0.5)
    b = randn(N, dtype=dtype, gen=gen)
    g = randn(M, N, dtype=dtype, gen=gen)
    run_everywhere(lambda *a: tk.linear(*a), reference.linear, [x, w, b], g, dtype, f"linear {M}x{K}x{N}")


def test_a_reduction_over_many_rows_keeps_its_bits_with_any_thread_count(gen):
    """The bias gradient of a one-output linear sums 2^22 rows: tonp's in one fixed order; stock
    torch splits the rows across threads, so 1 and 2 threads give different bits (the twin;
    for some of eight output gradients, as two orders can agree by chance)."""
    x, w, b = randn(1 << 22, 8, gen=gen), randn(1, 8, gen=gen), randn(1, gen=gen)
    gs = [randn(1 << 22, 1, gen=gen) for _ in range(8)]

    def bias_grads(threads):
        with num_threads(threads):
            return torch.cat([grads_of(lambda *a: tk.linear(*a), [x, w, b], g)[2] for g in gs])
    with tk.use("torch"):
        assert not torch.equal(bias_grads(1), bias_grads(2)), "stock torch unexpectedly kept its bits"
    assert_bitwise(bias_grads(2), bias_grads(1), "tonp bias gradients, 1 thread vs 2")


def test_linear_fp32_out_of_bf16_and_a_transposed_input(gen):
    """The LM head's case (bf16 x and weight, fp32 logits and gradient), and x a column-major view."""
    x = randn(40, 24, dtype=torch.bfloat16, gen=gen).t().contiguous().t()
    w = randn(50, 24, dtype=torch.bfloat16, gen=gen)
    g = randn(40, 50, gen=gen)
    run_everywhere(lambda a, b: tk.linear(a, b, out_dtype=torch.float32),
                   lambda a, b: reference.linear(a, b, out_dtype=torch.float32 if a.dtype != torch.float64
                                                 else torch.float64),
                   [x, w], g, torch.bfloat16, "lm-head linear")


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_backward_gemm_gives_the_same_bits_from_any_operand_layout(dtype, gen):
    """The backward GEMM packs its operands before any sum: whole tiles and strips of contiguous
    rows by pointer and by vector, the rest element by element. Row-major operands take the
    first paths, column-major views of the same values the last, so the gradients must be the
    same bits either way, in every build (ragged shapes: partial row tiles and column strips).
    No stock twin: MKL's torch.mm also keeps its bits across these layouts (measured), so this
    test guards tonp's packs rather than showing an order stock ops break."""
    x = randn(301, 96, dtype=dtype, gen=gen)
    w = randn(70, 96, dtype=dtype, gen=gen)
    g = randn(301, 70, dtype=dtype, gen=gen)
    col = lambda t: t.t().contiguous().t()  # noqa: E731  (the same values, column-major)
    for build, (var, val) in BUILDS.items():
        with env(var, val):
            want = torch.ops.tonp.linear_backward(g, x, w, [True, True, False], None)
            got = torch.ops.tonp.linear_backward(g, col(x), col(w), [True, True, False], None)
        assert_bitwise(got[0], want[0], f"dx, column-major operands [{build}]")
        assert_bitwise(got[1], want[1], f"dW, column-major operands [{build}]")


def test_the_bf16_backward_gemm_runs_on_amx_where_the_process_may(gen):
    """Gradients are correct, not order-locked (CONTRACT.md "Gradients"), so on a CPU whose AMX
    this process may use, the bf16 x bf16 backward GEMM runs on tdpbf16ps; TONP_BACKWARD_AMX=0
    and the other tables keep their own. The switch is live: a weight gradient over 600 rows
    (three k blocks; the gradient's A column-major, its B row-major; edge tiles of 8 rows and 9
    columns) gets other bits on AMX than on the zmm tiles, both correct (every test here runs
    both) and each its own bits twice."""
    amx = tk.amx.available() and tk.isa() == "avx512bf16"
    assert (torch.ops.tonp.backward_gemm() == "amx") == amx
    with env("TONP_BACKWARD_AMX", "0"):
        assert torch.ops.tonp.backward_gemm() == tk.isa()
    with env("TONP_FORCE_PORTABLE", "1"):
        assert torch.ops.tonp.backward_gemm() == "portable"
    if not amx:
        return
    x = randn(600, 136, dtype=torch.bfloat16, gen=gen)
    g = randn(600, 73, dtype=torch.bfloat16, gen=gen)
    w = randn(73, 136, dtype=torch.bfloat16, gen=gen)
    on = torch.ops.tonp.linear_backward(g, x, w, [True, True, False], None)
    with env("TONP_BACKWARD_AMX", "0"):
        off = torch.ops.tonp.linear_backward(g, x, w, [True, True, False], None)
    assert not torch.equal(on[1].float(), off[1].float()), "the weight gradient did not change: AMX not run"
    assert_bitwise(torch.ops.tonp.linear_backward(g, x, w, [True, True, False], None)[1], on[1], "AMX twice")


def _amx_chain(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A [m, k] @ B [k, n] (bf16) as the AMX backward GEMM sums it: from +0, one tdpbf16ps (the
    measured model, tk.amx) per 32 elements of k in order, k zero-padded to a multiple of 32."""
    m, k = a.shape
    kp = -(-k // 32) * 32
    ap = torch.zeros(m, kp, dtype=torch.bfloat16)
    bp = torch.zeros(kp, b.shape[1], dtype=torch.bfloat16)
    ap[:, :k], bp[:k] = a, b
    c = torch.zeros(m, b.shape[1])
    for s in range(0, kp, 32):
        c = tk.amx.tdpbf16ps_model(c, ap[:, s:s + 32].reshape(m, 16, 2),
                                   bp[s:s + 32].reshape(16, 2, -1).permute(0, 2, 1))
    return c


def test_the_amx_backward_gemm_is_the_instructions_chain_bit_for_bit(gen):
    """The bf16 backward GEMM on AMX packs both operands once for all its tiles (gemm_amx.h,
    grad_common.h): each output must still be its own chain of tdpbf16ps over k from +0, rounded
    once to bf16, wherever its tile, k block and 32 x 32 block fall. Checked against the
    instruction's measured model (tk.amx.tdpbf16ps_model, 100% of its outputs in amx_bench.py)
    on a dx and a weight gradient of 2 x 3 tiles of C, k blocks of 8 steps and a partial one,
    edge blocks of 24 rows and 14 columns, from row-major and column-major operands (the packs'
    paths by 32-line blocks and by steps of k), at 1 and 2 threads. A plain fp32 sum of the
    same products (torch.mm) gives other bits: the check can fail. No stock twin: stock torch's
    bf16 matmul also keeps its bits across these thread counts and layouts here (measured on
    the Intel Xeon), so this guards tonp's packs and tiles against the instruction's model; the
    thread twin of the backward is test_a_reduction_over_many_rows_keeps_its_bits_with_any_thread_count."""
    if not (tk.amx.available() and torch.ops.tonp.backward_gemm() == "amx"):
        pytest.skip("no AMX-BF16 this process may use (the zmm builds are covered above)")
    g = randn(600, 300, dtype=torch.bfloat16, gen=gen)
    x = randn(600, 270, dtype=torch.bfloat16, gen=gen)
    w = randn(300, 270, dtype=torch.bfloat16, gen=gen)
    want_dx, want_dw = _amx_chain(g, w).bfloat16(), _amx_chain(g.t(), x).bfloat16()
    assert not torch.equal((g.float() @ w.float()).bfloat16(), want_dx), "the chain and a plain sum agree"
    col = lambda t: t.t().contiguous().t()  # noqa: E731
    for threads in (1, 2):
        for gg, xx, ww in ((g, x, w), (col(g), col(x), col(w))):
            with num_threads(threads):
                dx, dw, _ = torch.ops.tonp.linear_backward(gg, xx, ww, [True, True, False], None)
            layout = "row-major" if gg.is_contiguous() else "column-major"
            assert_bitwise(dx, want_dx, f"dx on AMX, {layout}, {threads} thread(s)")
            assert_bitwise(dw, want_dw, f"dW on AMX, {layout}, {threads} thread(s)")


def test_linear_backward_refuses_operands_that_do_not_match(gen):
    """The op reads its operands by their sizes: grad, x and weight of mismatched shapes (here x
    and weight swapped) are refused by name, never read past a tensor's end."""
    x, w, g = randn(8, 24, gen=gen), randn(16, 24, gen=gen), randn(8, 16, gen=gen)
    assert torch.ops.tonp.linear_backward(g, x, w, [True, True, True], None)[1].shape == w.shape
    for args in ((g, w, x), (x, g, w), (g[:, :15], x, w), (g, x.flatten(), w)):
        with pytest.raises(ValueError, match="linear_backward.*do not match"):
            torch.ops.tonp.linear_backward(*args, [True, True, False], None)


# --- row-wise ops ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_silu_mul_and_rope(dtype, gen):
    x = randn(9, 4, 40, dtype=dtype, gen=gen, scale=2.0)    # per-head norm: rows of head_dim
    w = 1 + randn(40, dtype=dtype, gen=gen, scale=0.1)
    run_everywhere(lambda a, b: tk.rms_norm(a, b, 1e-6), lambda a, b: reference.rms_norm(a, b, 1e-6),
                   [x, w], randn(9, 4, 40, dtype=dtype, gen=gen), dtype, "rms_norm")
    gate, up = randn(13, 37, dtype=dtype, gen=gen, scale=3.0), randn(13, 37, dtype=dtype, gen=gen)
    run_everywhere(tk.silu_mul, reference.silu_mul, [gate, up], randn(13, 37, dtype=dtype, gen=gen),
                   dtype, "silu_mul")
    table_c, table_s = torch.randn(64, 16, generator=gen), torch.randn(64, 16, generator=gen)
    pos = torch.tensor([0, 5, 63, 2, 2])
    q = randn(5, 3, 16, dtype=dtype, gen=gen)
    run_everywhere(lambda a: tk.rope(a, table_c, table_s, pos),
                   lambda a: reference.rope(a, table_c.double() if a.dtype == torch.float64 else table_c,
                                            table_s.double() if a.dtype == torch.float64 else table_s, pos),
                   [q], randn(5, 3, 16, dtype=dtype, gen=gen), dtype, "rope")


@pytest.mark.parametrize("normalize", [True, False])
def test_moe_route_and_combine(normalize, gen):
    logits = randn(21, 16, gen=gen, scale=2.0)

    def weights(fn):
        return lambda a: fn(a, 4, normalize)[1]
    run_everywhere(weights(tk.moe_route), weights(reference.moe_route), [logits],
                   randn(21, 4, gen=gen), torch.float32, f"moe_route normalize={normalize}")
    for dtype in DTYPES:
        w, y = torch.rand(21, 4, generator=gen), randn(21, 4, 40, dtype=dtype, gen=gen)
        run_everywhere(tk.moe_combine, reference.moe_combine, [w, y], randn(21, 40, dtype=dtype, gen=gen),
                       dtype, "moe_combine")


# --- embedding ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_lookup(dtype, gen):
    """The token embedding's gradient (tonp::embedding_backward): repeated ids summed, unused rows
    zero, the forward index_select's bits; a bad id is an error naming it."""
    from tonp_models.layers.embedding import select_rows
    ids = torch.tensor([3, 0, 3, 7, 3, 0, 11])                      # rows 1, 2, 4.. never used
    w = randn(13, 40, dtype=dtype, gen=gen)
    run_everywhere(lambda a: select_rows(a, ids), lambda a: a.index_select(0, ids), [w],
                   randn(7, 40, dtype=dtype, gen=gen), dtype, "embedding")
    assert_bitwise(select_rows(w.requires_grad_(), ids).detach(), w.detach().index_select(0, ids), "forward")
    gw, = grads_of(lambda a: select_rows(a, ids), [w], randn(7, 40, dtype=dtype, gen=gen))
    assert not gw[[1, 2, 4, 12]].any() and gw[3].any()
    with pytest.raises(IndexError, match="id 13 at 1 is outside"):
        torch.ops.tonp.embedding_backward(randn(2, 40, gen=gen), torch.tensor([0, 13]), 13)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", (1.0, 0.7))
def test_token_logprobs(temperature, dtype, gen):
    """The training path's logprobs (lse + gather under one autograd node): the gradient of the
    selected log-softmax entries, [S, L, V] logits with repeated targets."""
    x, t = randn(2, 9, 64, dtype=dtype, gen=gen, scale=3.0), torch.randint(0, 64, (2, 9), generator=gen)
    run_everywhere(lambda a: tk.token_logprobs(a, t, temperature=temperature),
                   lambda a: reference.token_logprobs(a, t, temperature), [x], randn(2, 9, gen=gen),
                   dtype, f"token_logprobs T={temperature}")


# --- attention ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_varlen(dtype, gen):
    """GQA 4:1, sequences of 70, 0, 1 and 150 tokens (query blocks of 64 crossed, an empty one)."""
    cu = torch.tensor([0, 70, 70, 71, 221], dtype=torch.int32)
    q = randn(221, 8, 16, dtype=dtype, gen=gen)
    k, v = randn(221, 2, 16, dtype=dtype, gen=gen), randn(221, 2, 16, dtype=dtype, gen=gen)
    run_everywhere(lambda a, b, c: tk.attention_varlen(a, b, c, cu, scale=0.25, block=16),
                   lambda a, b, c: reference.attention_varlen(a, b, c, cu, 0.25),
                   [q, k, v], randn(221, 8, 16, dtype=dtype, gen=gen), dtype, "attention_varlen")


# --- experts --------------------------------------------------------------------------------------
def _routes(M, E, K, gen, skip=()):
    """Random distinct experts per token, avoiding `skip` (experts that then receive no rows)."""
    allowed = torch.tensor([e for e in range(E) if e not in skip])
    return torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:K]] for _ in range(M)])


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_experts_with_empty_experts_and_an_ep_share(dtype, gen):
    H, I, E, K = 40, 24, 8, 2         # chunks of 5 and 3 elements: padded blocks in the forward
    gu = randn(E, 2 * I, H, dtype=dtype, gen=gen, scale=H ** -0.5)
    dn = randn(E, H, I, dtype=dtype, gen=gen, scale=I ** -0.5)
    x = randn(11, H, dtype=dtype, gen=gen)
    ids = _routes(11, E, K, gen, skip=(3, 6))                       # experts 3 and 6 get nothing
    g = randn(11, K, H, dtype=dtype, gen=gen)
    run_everywhere(lambda a, b, c: tk.moe_experts(a, ids, b, c), lambda a, b, c: reference.moe_experts(a, ids, b, c),
                   [x, gu, dn], g, dtype, "moe_experts")
    gx, ggu, gdn = grads_of(lambda a, b, c: tk.moe_experts(a, ids, b, c), [x, gu, dn], g)
    assert not ggu[3].any() and not gdn[6].any() and ggu[0].any()
    # An EP rank holding experts 4..7: [R, 1] ids, first_expert=4 (an expert of its share empty).
    m, k = (ids >= 4).nonzero(as_tuple=True)
    share = ids[m, k].unsqueeze(1)
    run_everywhere(lambda a, b, c: tk.moe_experts(a, share, b, c, first_expert=4),
                   lambda a, b, c: reference.moe_experts(a, share, b, c, first_expert=4),
                   [x[m], gu[4:], dn[4:]], g[m, k].unsqueeze(1), dtype, "moe_experts EP share")


def test_moe_experts_no_rows_and_one_expert_beyond_a_tile(gen):
    """Zero tokens (all weight gradients zero), and 400 rows on one expert (> 384-row GEMM tiles)."""
    H, I, E = 64, 32, 4
    gu, dn = randn(E, 2 * I, H, gen=gen, scale=0.1), randn(E, H, I, gen=gen, scale=0.1)
    ids = torch.zeros(400, 1, dtype=torch.long)
    x, g = randn(400, H, gen=gen), randn(400, 1, H, gen=gen)
    run_everywhere(lambda a, b, c: tk.moe_experts(a, ids, b, c), lambda a, b, c: reference.moe_experts(a, ids, b, c),
                   [x, gu, dn], g, torch.float32, "moe_experts, 400 rows on expert 0")
    gx, ggu, gdn = grads_of(lambda a, b, c: tk.moe_experts(a, torch.zeros(0, 2, dtype=torch.long), b, c),
                            [randn(0, H, gen=gen), gu, dn], randn(0, 2, H, gen=gen))
    assert gx.shape == (0, H) and not ggu.any() and not gdn.any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_experts_weight_gradient_tiles_of_a_megabyte(dtype, gen):
    """Weight-gradient tiles of 1 MB or more (384 rows x 1408 or 1440 columns): the AVX-512 GEMM
    streams them past the caches in whole lines; H = 1440 ends in a half strip of 32 columns."""
    H, I, E = 1440, 1408, 2
    gu = randn(E, 2 * I, H, dtype=dtype, gen=gen, scale=H ** -0.5)
    dn = randn(E, H, I, dtype=dtype, gen=gen, scale=I ** -0.5)
    x, ids, g = randn(6, H, dtype=dtype, gen=gen), _routes(6, E, 2, gen), randn(6, 2, H, dtype=dtype, gen=gen)
    run_everywhere(lambda a, b, c: tk.moe_experts(a, ids, b, c), lambda a, b, c: reference.moe_experts(a, ids, b, c),
                   [x, gu, dn], g, dtype, "moe_experts, 1 MB weight-gradient tiles")


def test_the_experts_backward_ops_agree(gen):
    """moe_experts_backward (recomputes the gate_up rows) equals moe_experts_grad given them."""
    H, I, E = 64, 32, 4
    gu, dn = randn(E, 2 * I, H, gen=gen, scale=0.1), randn(E, H, I, gen=gen, scale=0.1)
    x, ids, g = randn(30, H, gen=gen), _routes(30, E, 2, gen), randn(30, 2, H, gen=gen)
    y, gub = torch.ops.tonp.moe_experts_train(x, ids, gu, dn, 0, 8)
    assert_bitwise(y, tk.moe_experts(x, ids, gu, dn), "training forward = forward")
    a = torch.ops.tonp.moe_experts_grad(g, x, ids, gu, dn, gub, 0, 8, [True, True, True])
    b = torch.ops.tonp.moe_experts_backward(g, x, ids, gu, dn, 0, [True, True, True])
    assert_bitwise(a, b, "moe_experts_grad vs moe_experts_backward")
    with pytest.raises(ValueError, match="gate_up_out"):
        torch.ops.tonp.moe_experts_grad(g, x, ids, gu, dn, gub[:5], 0, 8, [True, True, True])


# --- the model --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_training_step_is_deterministic(dtype):
    """A tiny model's loss.backward(): every parameter's gradient the same bits twice, with 1 and 2
    threads; the gradients of large tensors come from the pool without aliasing live ones."""
    from model_helpers import tiny_model
    model = tiny_model(dtype=dtype, hidden_size=128, moe_intermediate_size=64, vocab_size=320)
    seqs = [torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(n)) for n in (40, 9, 77)]

    def step(threads):
        model.zero_grad(set_to_none=True)
        with num_threads(threads):
            (-torch.cat(model.token_logprobs(seqs)).mean()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}
    first, again, one = step(2), step(2), step(1)
    kept = {n: p.grad for n, p in model.named_parameters()}      # live gradients of the last step
    snapshot = {n: g.clone() for n, g in kept.items()}
    step(2)                                                      # new gradients: kept ones untouched
    for n in first:
        assert_bitwise(again[n], first[n], f"{n}: twice")
        assert_bitwise(one[n], first[n], f"{n}: 1 thread vs 2")
        assert_bitwise(kept[n], snapshot[n], f"{n}: a live gradient was overwritten")
    torch.ops.tonp.release_memory_pool()
