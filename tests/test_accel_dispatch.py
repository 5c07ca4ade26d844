"""Dispatch by device and numerics: `tk.use(mode, numerics=, backend=)` per context, the Triton
kernels behind torch.ops.tonp for CUDA / NPU tensors, CPU tensors routed through them under the
interpreter, fast kernels named by the op table, and clear errors for what cannot run.

The public vocabulary ops through the Triton route (logsumexp, log_softmax, token_logprobs with
and without gradients, argmax) give the C++ bits: both sides finish with tonp's explicit log.
Twins: stock torch gives other bits.
"""
from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

import tonp_kernels as tk
from conftest import assert_bitwise, randn
from tonp_kernels import _register
from triton_interpreted import _launch, registry

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def test_use_sets_numerics_and_backend_per_context_and_restores_them():
    assert (tk.get_mode(), tk.get_numerics(), tk.get_backend()) == ("invariant", "exact", "auto")
    with tk.use("invariant", numerics="fast", backend="triton"):
        with tk.use("torch"):  # None keeps the context's numerics and backend
            assert (tk.get_mode(), tk.get_numerics(), tk.get_backend()) == \
                ("torch", "fast", "triton")
        seen = []
        t = threading.Thread(target=lambda: seen.append((tk.get_numerics(), tk.get_backend())))
        t.start()
        t.join()
        assert seen == [("exact", "auto")], "a new thread starts with the defaults"
    assert (tk.get_numerics(), tk.get_backend()) == ("exact", "auto")
    for kw, name in ((dict(numerics="tf32"), "numerics"), (dict(backend="cuda"), "backend")):
        with pytest.raises(ValueError, match=f"tonp_kernels.use: {name} must be one of"):
            tk.use("invariant", **kw)


def test_every_op_has_a_triton_kernel_for_cuda_and_npu_tensors():
    for op in registry.OPS:
        for key in ("CUDA", "PrivateUse1"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"tonp::{op}", key), (op, key)
        assert registry.exact(op).__name__ == op
    # The function registered for CUDA runs the registry's kernel: here on CPU tensors, through
    # the interpreter, with the C++ bits (the GPU runs the same function, compiled).
    x, w = randn(5, 40), randn(24, 40)
    got = _register.DEVICE_KERNELS["linear"](x, w, None, 8, None)
    assert_bitwise(got, torch.ops.tonp.linear(x, w, None, 8, None), "CUDA kernel on CPU")


def test_the_triton_route_runs_the_ops_there(gen):
    x, w = randn(7, 64, gen=gen), randn(16, 64, gen=gen)
    want = tk.linear(x, w)
    before = registry.CALLS["linear"]
    with tk.use("invariant", backend="triton"):
        got = tk.linear(x, w)
    assert registry.CALLS["linear"] == before + 1
    assert_bitwise(got, want, "linear through Triton")
    assert tk.linear(x, w) is not None and registry.CALLS["linear"] == before + 1  # C++ again
    with tk.use("torch", backend="triton"):  # torch mode stays stock torch
        assert not torch.equal(tk.linear(x, w), want)
    assert registry.CALLS["linear"] == before + 1


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_vocab_ops_end_to_end_with_the_explicit_log(dtype, gen):
    """logsumexp, log_softmax, token_logprobs (fused and under autograd, 3-D logits), argmax."""
    x = randn(2, 3, 96, dtype=dtype, gen=gen, scale=4.0)
    x[0, 1, :12] = float("-inf")                       # a masked chunk
    t = torch.randint(0, 96, (2, 3), generator=gen)
    ops = {"logsumexp": lambda v: tk.logsumexp(v, temperature=0.7),
           "log_softmax": lambda v: tk.log_softmax(v, temperature=0.7),
           "token_logprobs": lambda v: tk.token_logprobs(v, t, temperature=0.7),
           "argmax": tk.argmax}
    for name, fn in ops.items():
        want = fn(x)
        with tk.use("invariant", backend="triton"):
            assert_bitwise(fn(x), want, name)
            if name == "token_logprobs":  # the training path: lse_partial + lse_finish + gather
                xg = x.clone().requires_grad_(True)
                assert_bitwise(fn(xg).detach(), want, "token_logprobs under autograd")
    big, tb = randn(64, 1000, gen=gen, scale=4.0), torch.randint(0, 1000, (64,), generator=gen)
    for name, fn in (("logsumexp", tk.logsumexp), ("log_softmax", tk.log_softmax),
                     ("token_logprobs", lambda v: tk.token_logprobs(v, tb))):
        with tk.use("torch"):  # the twin: stock torch's reductions and log give other bits
            stock = fn(big)
        with tk.use("invariant", backend="triton"):
            assert not torch.equal(stock, fn(big)), f"stock {name} gave the same bits"
    x[1, 2, 5] = float("nan")
    with tk.use("invariant", backend="triton"), \
            pytest.raises(ValueError, match=r"tonp.argmax: row 5 holds a NaN logit"):
        tk.argmax(x)


def test_a_fast_kernel_plugs_in_through_the_table(tmp_path, monkeypatch, gen):
    """The op table's `fast` column names the module of tonp_kernels.accel whose function of the
    op's name serves it under numerics="fast"; ops without one (and exact numerics) run the
    exact kernels."""
    import tonp_kernels.accel as accel
    (tmp_path / "fast_probe.py").write_text(
        "import torch\n"
        "calls = []\n"
        "def rms_norm(x, weight, eps):\n"
        "    calls.append(tuple(x.shape))\n"
        "    return torch.zeros_like(x)\n")
    monkeypatch.setattr(accel, "__path__", list(accel.__path__) + [str(tmp_path)])
    monkeypatch.setitem(registry.FAST, "rms_norm", "fast_probe")
    monkeypatch.setattr(registry, "_fast", {})
    x, w = randn(3, 32, gen=gen), randn(32, gen=gen)
    with tk.use("invariant", numerics="fast", backend="triton"):
        assert torch.equal(tk.rms_norm(x, w, 1e-6), torch.zeros_like(x))
        assert_bitwise(tk.silu_mul(x, x), torch.ops.tonp.silu_mul(x, x), "exact where no fast")
    with tk.use("invariant", backend="triton"):
        assert_bitwise(tk.rms_norm(x, w, 1e-6), torch.ops.tonp.rms_norm(x, w, 1e-6), "exact")
    assert sys.modules["tonp_kernels.accel.fast_probe"].calls == [(3, 32)]
    assert set(registry.fast_kernels()) == {"rms_norm", "linear", "attention_varlen",
                                            "attention_paged", "moe_experts"}


def test_numerics_fast_routes_to_the_fast_kernels(gen):
    """The fast_*.py kernels (tensor-core linear, attention, MoE experts) are what
    numerics="fast" runs for those ops, with their bits; exact numerics keep the C++ bits."""
    from tonp_kernels.accel import fast_attention, fast_linear, fast_moe
    assert registry.fast_kernels() == {
        "linear": fast_linear.linear, "attention_varlen": fast_attention.attention_varlen,
        "attention_paged": fast_attention.attention_paged, "moe_experts": fast_moe.moe_experts}
    x, w = randn(5, 64, gen=gen), randn(48, 64, gen=gen)
    before = registry.CALLS["linear"]
    with tk.use("invariant", numerics="fast", backend="triton"):
        got = tk.linear(x, w)
    assert registry.CALLS["linear"] == before + 1
    assert_bitwise(got, fast_linear.linear(x, w, None, 8, None), "fast linear via the dispatch")
    with tk.use("invariant", numerics="exact", backend="triton"):
        assert_bitwise(tk.linear(x, w), torch.ops.tonp.linear(x, w, None, 8, None), "exact")


def test_what_cannot_run_is_refused_clearly(monkeypatch):
    x = torch.empty(2, 8, device="meta")
    with pytest.raises(NotImplementedError, match="invariant kernels run on CPU, CUDA and NPU"):
        tk.linear(x, torch.empty(4, 8, device="meta"))
    with pytest.raises(RuntimeError, match="tensors on several devices: cpu, meta"):
        tk.linear(torch.zeros(2, 8), torch.empty(4, 8, device="meta"))
    assert not _register._triton_runs_on("npu"), "triton-ascend is not installed here"
    monkeypatch.setattr(_launch, "INTERPRETED", False)  # as if the kernels were compiled
    with tk.use("invariant", backend="triton"), pytest.raises(RuntimeError,
                                                               match="TRITON_INTERPRET=1"):
        tk.linear(torch.zeros(2, 8), torch.zeros(4, 8))


def test_tonp_accel_on_cpu_makes_triton_the_default_backend():
    """A fresh process with TONP_ACCEL_ON_CPU=1 (and no TRITON_INTERPRET): CPU tensors run the
    interpreted Triton kernels, with the C++ bits."""
    code = ("import torch, tonp_kernels as tk\n"
            "from tonp_kernels.accel import registry\n"
            "x, w = torch.randn(3, 24), torch.randn(8, 24)\n"
            "assert tk.get_backend() == 'triton'\n"
            "got = tk.linear(x, w)\n"
            "assert registry.CALLS['linear'] == 1\n"
            "assert torch.equal(got, torch.ops.tonp.linear(x, w, None, 8, None))\n"
            "print('ok')\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env={**env, "TONP_ACCEL_ON_CPU": "1"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
