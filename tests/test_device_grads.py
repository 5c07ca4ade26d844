"""The backward ops' device kernels (tonp_kernels/device_grads.py: torch math, registered for
CUDA and PrivateUse1): called on CPU tensors they agree with the C++ CPU ops (same dtypes,
shapes and empty outputs; values at fp32 / one-bf16-rounding tolerances), with float64 autograd
of the reference math, and inside a whole training step. No GPU here: these prove the math and
the registrations, not a GPU run."""
from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tonp_kernels as tk
from tonp_kernels import device_grads as dg, reference
from conftest import assert_bitwise, randn

DTYPES = (torch.float32, torch.bfloat16)
MASKS2 = list(itertools.product((True, False), repeat=2))
MASKS3 = list(itertools.product((True, False), repeat=3))
CPU_ONLY = {"bf16_pair_step",  # a CPU test helper of the Triton pair step, not a model op
            "amx_tdpbf16ps", "amx_pack_blocks", "amx_linear_blocks",
            "fma_linear_blocks",  # tools measuring the CPU's AMX (amx_ops.cpp)
            "pack_weight_groups"}  # the CPU kernels' weight layout (tk.pack_weight_groups: None
#                                    for a device tensor, whose kernels read weights in place)


def agree(got, want, what):
    """Every output: same dtype and shape as the C++ op's; values allclose (fp32 tight, bf16 at
    about one rounding), relative to the output's largest value."""
    for i, (a, e) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == e.dtype and a.shape == e.shape, \
            f"{what} [{i}]: {a.dtype} {tuple(a.shape)} vs {e.dtype} {tuple(e.shape)}"
        scale = float(e.double().abs().max()) if e.numel() else 1.0
        rtol, atol = (1e-5, 1e-5) if e.dtype == torch.float32 else (1.6e-2, 1e-2)
        assert torch.allclose(a.double(), e.double(), rtol=rtol, atol=atol * (scale or 1.0)), \
            f"{what} [{i}]: max diff {float((a.double() - e.double()).abs().max()):.3e}, " \
            f"scale {scale:.3e}"


def both(op, *args, what=""):
    """The generic kernel and the C++ CPU op on the same arguments agree."""
    got = getattr(dg, op)(*args)
    want = getattr(torch.ops.tonp, op)(*args)
    agree(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,),
          f"{op} {what}")
    return got


def test_every_op_with_a_cpu_kernel_has_cuda_and_npu_kernels():
    """A new backward op (or any op) registered for CPU only fails here until it has a device
    version; the backward ops' device kernels are device_grads' functions."""
    cpu = {r[6:] for r in torch._C._dispatch_get_registrations_for_dispatch_key("CPU")
           if r.startswith("tonp::")}
    grads = {op for op in cpu if op.endswith(("_backward", "_grad"))} | {"moe_experts_train"}
    assert grads <= set(dg.KERNELS) and len(grads) == len(dg.KERNELS), sorted(grads)
    for op in sorted(cpu - CPU_ONLY):
        for key in ("CUDA", "PrivateUse1"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"tonp::{op}", key), (op, key)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_backward(dtype, gen):
    x, w = randn(37, 48, dtype=dtype, gen=gen), randn(29, 48, dtype=dtype, gen=gen, scale=0.2)
    for g in (randn(37, 29, dtype=dtype, gen=gen), randn(37, 29, gen=gen)):  # fp32: the LM head's
        for mask, bias in itertools.product(MASKS3, (None, torch.float32, torch.bfloat16)):
            both("linear_backward", g, x, w, list(mask), bias, what=f"{dtype} {g.dtype} {mask} {bias}")
    both("linear_backward", randn(37, 29, dtype=dtype, gen=gen), x.t().contiguous().t(), w,
         [True, True, True], None, what="strided x")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rowwise_backwards(dtype, gen):
    x, w = randn(2, 5, 48, dtype=dtype, gen=gen), randn(48, dtype=dtype, gen=gen)
    g = randn(2, 5, 48, dtype=dtype, gen=gen)
    for mask in MASKS2:
        both("rms_norm_backward", g, x, w, 1e-6, list(mask), what=f"{dtype} {mask}")
    gate, up = randn(7, 33, dtype=dtype, gen=gen, scale=3), randn(7, 33, dtype=dtype, gen=gen)
    both("silu_mul_backward", randn(7, 33, dtype=dtype, gen=gen), gate, up, what=str(dtype))
    both("silu_mul_backward", randn(7, 33, gen=gen), gate, up.float(), what="fp32 grad and up")
    cos, sin = randn(64, 16, gen=gen), randn(64, 16, gen=gen)
    for pos in (torch.tensor([3, 0, 63, 5, 5]), torch.tensor([1, 2, 3, 4, 9], dtype=torch.int32)):
        both("rope_backward", randn(5, 3, 16, dtype=dtype, gen=gen), cos, sin, pos, dtype,
             what=f"{dtype} {pos.dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normalize", (True, False))
def test_moe_route_and_combine_backwards(dtype, normalize, gen):
    logits = randn(13, 10, dtype=dtype, gen=gen, scale=2)
    ids, w = torch.ops.tonp.moe_route(logits, 3, normalize)
    both("moe_route_backward", randn(13, 3, gen=gen), logits, ids, w, normalize, what=str(dtype))
    y = randn(13, 3, 24, dtype=dtype, gen=gen)
    for mask in MASKS2:
        both("moe_combine_backward", randn(13, 24, dtype=dtype, gen=gen), w, y, list(mask),
             what=f"{dtype} {mask}")


def _experts(dtype, gen, M=11, E=8, K=2, skip=(3, 6), H=40, I=24):
    gu = randn(E, 2 * I, H, dtype=dtype, gen=gen, scale=H ** -0.5)
    dn = randn(E, H, I, dtype=dtype, gen=gen, scale=I ** -0.5)
    allowed = torch.tensor([e for e in range(E) if e not in skip])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:K]] for _ in range(M)])
    return randn(M, H, dtype=dtype, gen=gen), ids.reshape(M, K), gu, dn, randn(M, K, H, dtype=dtype, gen=gen)


def _ep_share(x, ids, gu, dn, g, first):
    """An EP rank holding experts first..: its [R, 1] rows."""
    m, k = (ids >= first).nonzero(as_tuple=True)
    return x[m], ids[m, k].unsqueeze(1), gu[first:], dn[first:], g[m, k].unsqueeze(1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_experts_train_and_grads(dtype, gen):
    """Experts 3 and 6 get no rows; an EP share (first_expert 4); zero tokens."""
    full = _experts(dtype, gen)
    H = full[0].shape[1]
    cases = {"all experts": (full, 0), "EP share": (_ep_share(*full, 4), 4),
             "no tokens": ((torch.zeros(0, H, dtype=dtype), torch.zeros(0, 2, dtype=torch.long),
                            *full[2:4], torch.zeros(0, 2, H, dtype=dtype)), 0)}
    for what, ((x, ids, gu, dn, g), first) in cases.items():
        y, gub = dg.moe_experts_train(x, ids, gu, dn, first, 8)  # the forward's bits, exactly
        assert_bitwise((y, gub), torch.ops.tonp.moe_experts_train(x, ids, gu, dn, first, 8), what)
        for mask in MASKS3:
            got = both("moe_experts_grad", g, x, ids, gu, dn, gub, first, 8, list(mask),
                       what=f"{what} {dtype} {mask}")
            assert_bitwise(dg.moe_experts_grad(g, x, ids, gu, dn, None, first, 8, list(mask)), got,
                           f"{what}: gate_up rows recomputed")
        ggu, gdn = both("moe_experts_backward", g, x, ids, gu, dn, first, [True] * 3, what=what)[1:]
        if what == "all experts":
            assert not ggu[3].any() and not gdn[6].any() and ggu[0].any() and gdn[0].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_varlen_backward(dtype, gen):
    """GQA 4:1 and 1:1, sequences of 70, 0, 1 and 150 tokens; query blocks of 40 keys' worth."""
    cu = torch.tensor([0, 70, 70, 71, 221], dtype=torch.int32)
    for hkv in (2, 8):
        q = randn(221, 8, 16, dtype=dtype, gen=gen)
        k, v = randn(221, hkv, 16, dtype=dtype, gen=gen), randn(221, hkv, 16, dtype=dtype, gen=gen)
        out = torch.ops.tonp.attention_varlen(q, k, v, cu, 0.25, 16)
        args = (randn(221, 8, 16, dtype=dtype, gen=gen), q, k, v, out, cu, 0.25)
        both("attention_varlen_backward", *args, what=f"{dtype} Hkv {hkv}")
        old, dg._SCORES = dg._SCORES, 8 * 150 * 40  # small query blocks: the same gradients
        try:
            agree(dg.attention_varlen_backward(*args), torch.ops.tonp.attention_varlen_backward(*args),
                  f"blocked, Hkv {hkv}")
        finally:
            dg._SCORES = old


def _autograd64(ref, inputs, grad):
    ins = [t.double().requires_grad_() for t in inputs]
    return torch.autograd.grad(ref(*ins), ins, grad.double())


def _near64(got, want, what):
    for i, (a, e) in enumerate(zip(got, want, strict=True)):
        scale = float(e.abs().max())
        assert float((a.double() - e).abs().max()) <= 1e-4 * scale, f"{what} [{i}]"


def test_against_float64_autograd_of_the_reference(gen):
    cu = torch.tensor([0, 70, 70, 71, 100], dtype=torch.int32)
    q, k, v, g = (randn(100, h, 16, gen=gen) for h in (4, 2, 2, 4))
    out = torch.ops.tonp.attention_varlen(q, k, v, cu, 0.25, 16)
    _near64(dg.attention_varlen_backward(g, q, k, v, out, cu, 0.25),
            _autograd64(lambda a, b, c: reference.attention_varlen(a, b, c, cu, 0.25), [q, k, v], g),
            "attention_varlen")
    x, ids, gu, dn, g = _ep_share(*_experts(torch.float32, gen), 4)
    gub = dg.moe_experts_train(x, ids, gu, dn, 4, 8)[1]
    _near64(dg.moe_experts_grad(g, x, ids, gu, dn, gub, 4, 8, [True] * 3),
            _autograd64(lambda a, b, c: reference.moe_experts(a, ids, b, c, 4), [x, gu, dn], g),
            "moe_experts EP share")
    x, w, g = randn(6, 48, gen=gen), randn(48, gen=gen), randn(6, 48, gen=gen)
    _near64(dg.rms_norm_backward(g, x, w, 1e-6, [True, True]),
            _autograd64(lambda a, b: reference.rms_norm(a, b, 1e-6), [x, w], g), "rms_norm")


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_backward(dtype, gen):
    """Repeated, unused and single ids, a [B, L] id tensor; and a bad id named."""
    ids = torch.tensor([[3, 0, 3, 7], [3, 9, 0, 2]])
    g = randn(2, 4, 24, gen=gen).to(dtype)
    out = both("embedding_backward", g, ids, 12, what=str(dtype))
    assert not out[[1, 4, 5, 6, 8, 10, 11]].any()
    with pytest.raises(IndexError, match="outside"):
        dg.embedding_backward(g, ids, 9)


def test_bad_input_is_named(gen):
    x, ids, gu, dn, g = _experts(torch.float32, gen)
    with pytest.raises(IndexError, match="expert id 1 is not one of this call's experts"):
        dg.moe_experts_grad(g, x, ids, gu[2:], dn[2:], None, 2, 8, [True] * 3)
    with pytest.raises(ValueError, match="grad must be"):
        dg.moe_experts_grad(g[:3], x, ids, gu, dn, None, 0, 8, [True] * 3)
    with pytest.raises(ValueError, match="gate_up_out must be"):
        dg.moe_experts_grad(g, x, ids, gu, dn, x, 0, 8, [True] * 3)
    q = randn(9, 4, 8, gen=gen)
    with pytest.raises(ValueError, match="k, v"):
        dg.attention_varlen_backward(q, q, q[:, :3], q[:, :3], q, torch.tensor([0, 9]), 1.0)


class _GenericGrads(TorchDispatchMode):
    """The backward ops (and moe_experts_train) on device_grads' functions; counts the calls."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name.startswith("tonp::") and name[6:] in dg.KERNELS:
            self.calls[name[6:]] = self.calls.get(name[6:], 0) + 1
            return dg.KERNELS[name[6:]](*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_training_step_with_the_generic_backward(dtype):
    """A tiny model's loss.backward() with every backward op on device_grads: each parameter's
    gradient allclose to the C++ backward's (and the routing really happened)."""
    from model_helpers import tiny_model
    model = tiny_model(dtype=dtype, hidden_size=128, moe_intermediate_size=64, vocab_size=320)
    seqs = [torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(n)) for n in (40, 9, 77)]

    def step(mode=None):
        model.zero_grad(set_to_none=True)
        with mode or torch.enable_grad():
            (-torch.cat(model.token_logprobs(seqs)).mean()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}
    want = step()
    mode = _GenericGrads()
    got = step(mode)
    assert {"linear_backward", "rms_norm_backward", "silu_mul_backward", "rope_backward",
            "moe_route_backward", "moe_combine_backward", "moe_experts_train", "moe_experts_grad",
            "attention_varlen_backward", "embedding_backward"} <= set(mode.calls), mode.calls
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for n, e in want.items():
        scale = float(e.double().abs().max()) or 1.0
        err = float((got[n].double() - e.double()).abs().max())
        assert got[n].dtype == e.dtype and err <= tol * scale, f"{n}: {err:.3e} (scale {scale:.3e})"
    torch.ops.tonp.release_memory_pool()
