"""The tiny model through the Triton kernels (Triton's interpreter, `use(backend="triton")`) gives
the C++ path's bits: the training forward (fp32 and bf16), token_logprobs with gradients, and a
sampled generate over the paged cache, whose logprobs the training forward reproduces.

This is the code path a GPU runs: the model's tonp ops go through torch.ops.tonp, whose kernel
for CUDA / NPU tensors is the same registry of Triton kernels (tonp_kernels/_register.py);
registry.CALLS shows which ops ran there. Kept small (2 layers, a few tokens): the interpreter
runs every program in Python. Twin: stock torch (`use("torch")`) gives other bits.
"""
from __future__ import annotations

import pytest
import torch

import tonp_kernels as tk
from conftest import assert_bitwise
from model_helpers import packed, random_seqs, tiny_model
from tonp_models.generation import generate
from triton_interpreted import registry

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
TRITON = dict(backend="triton")


def model_of(dtype=torch.float32):
    """Layer 0 sparse (router, experts, combine), layer 1 dense: every op of the model."""
    return tiny_model("mlp_only", num_hidden_layers=2, dtype=dtype)


def ran(before, *ops):
    return all(registry.CALLS[op] > before[op] for op in ops)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_forward_through_the_triton_kernels_equals_cpp(dtype):
    model = model_of(dtype)
    ids, cu = packed(random_seqs([5, 3], model.config.vocab_size))
    with torch.no_grad():
        want = model(ids, cu)
        before = registry.CALLS.copy()
        with tk.use("invariant", **TRITON):
            got = model(ids, cu)
        assert ran(before, "linear", "rms_norm", "rope", "attention_varlen", "moe_route",
                   "moe_experts", "moe_combine", "silu_mul")
        assert_bitwise(got, want, f"forward {dtype}")
        with tk.use("torch"):
            assert not torch.equal(model(ids, cu), want), "stock torch gave the same bits"


def test_token_logprobs_and_gradients_through_the_triton_kernels():
    """The differentiable scoring path (lse_partial + lse_finish with the explicit log), and
    the C++ autograd above the Triton forward: the same logprobs and the same gradients."""
    model = model_of()
    seqs = random_seqs([6, 4], model.config.vocab_size, seed=3)
    results = []
    for kw in ({}, TRITON):
        model.zero_grad()
        before = registry.CALLS.copy()
        with tk.use("invariant", **kw):
            lps = model.token_logprobs(seqs, temperature=0.8)
            torch.cat(lps).sum().backward()
        assert ran(before, "lse_partial", "lse_finish") == bool(kw)
        results.append((lps, [p.grad.clone() for p in model.parameters()]))
    (lp_c, g_c), (lp_t, g_t) = results
    for a, b in zip(lp_t, lp_c):
        assert_bitwise(a.detach(), b.detach(), "token logprobs")
    for a, b in zip(g_t, g_c):
        assert_bitwise(a, b, "parameter gradient")


def test_sampled_generate_through_the_triton_kernels_equals_cpp():
    """Prefill and decode over the paged cache, top-p sampling: the same tokens and
    logprobs as the C++ path, and the training forward (Triton too) reproduces the logprobs."""
    model = model_of()
    prompts = random_seqs([5, 3], model.config.vocab_size, seed=5)
    kw = dict(max_new_tokens=3, temperature=1.0, top_p=0.9, seed=2 ** 63 + 1)
    want = generate(model, prompts, **kw)
    before = registry.CALLS.copy()
    with tk.use("invariant", **TRITON):
        got = generate(model, prompts, **kw)
        assert ran(before, "attention_paged", "sample", "token_logprobs")
        train = model.token_logprobs(got.sequences)
    for i, (a, b) in enumerate(zip(got.sequences, want.sequences)):
        assert_bitwise(a, b, f"tokens of request {i}")
        assert_bitwise(got.logprobs[i], want.logprobs[i], f"logprobs of request {i}")
        assert_bitwise(train[i][len(prompts[i]) - 1:], got.logprobs[i], f"training vs rollout {i}")
