"""Compile every exact kernel for an NVIDIA target without a GPU, and lint its PTX.

    python -m tonp_kernels.accel.compile_check [--arch 90]

The interpreter proves the arithmetic; it cannot prove that the GPU compiler keeps it. This
records the launches the public launchers make on small inputs (all dtype and mode variants),
compiles each kernel with Triton's own pipeline (TTIR -> PTX -> ptxas) for the target, and fails
on any PTX instruction that would change the bits: an approximate division, square root, exp2,
log2 or reciprocal, a flush-to-zero form, or an fp32 add/sub/mul without `.rn` (which ptxas may
contract into an fma). Run it without TRITON_INTERPRET (the kernels must be JIT functions).
"""
from __future__ import annotations

import argparse
import re
import sys
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import _launch
from .._library import FLOAT_DTYPES

_PTR = {torch.float32: "*fp32", torch.int8: "*i8", torch.int16: "*i16", torch.int32: "*i32",
        torch.int64: "*i64"}
# Instructions whose results are not the correctly rounded IEEE ones (or flush denormals).
_FORBIDDEN = re.compile(r"\.approx|\.ftz|\bdiv\.full|\b(?:add|sub|mul)\.f32\b")


def record_launches() -> list:
    """(kernel, args, meta) of every launch the launchers make on small CPU inputs."""
    from . import attention, linear, moe, rowwise, sample, vocab

    _launch.recorder = calls = []
    try:
        g = torch.Generator().manual_seed(0)
        for dt in FLOAT_DTYPES:
            x = torch.randn(3, 32, generator=g).to(dt)
            for pairs in (False, True):  # bf16 x bf16: FMA lanes or the pair chains
                linear.linear(x, torch.randn(16, 32).to(dt), torch.randn(16), 2, pairs=pairs)
            linear.linear(x, torch.randn(16, 32), None, 2 if dt == torch.bfloat16 else 8,
                          torch.float32)
            rowwise.rms_norm(x, torch.randn(32), 1e-6)
            rowwise.silu_mul(x, x)
            rowwise.rope(x.view(3, 2, 16), torch.randn(4, 16), torch.randn(4, 16),
                         torch.tensor([0, 1, 3]))
            rowwise.moe_combine(torch.rand(3, 2), x.view(3, 2, 16))
            q = torch.randn(5, 4, 16).to(dt)
            attention.attention_varlen(q, q[:, :2], q[:, :2], torch.tensor([0, 2, 5]), 0.25, 4)
            kc = torch.randn(4, 4, 2, 16).to(dt)
            attention.attention_paged(q, kc, kc, torch.tensor([[0, 1], [2, 3]]),
                                      torch.tensor([0, 0, 1, 1, 1]), torch.tensor([0, 5, 1, 2, 7]),
                                      0.25)
            moe.moe_route(x[:, :8], 2, True)
            moe.moe_experts(x, torch.tensor([[0, 1], [1, 2], [2, 0]]),
                            torch.randn(3, 16, 32).to(dt), torch.randn(3, 32, 8).to(dt), 0, 2,
                            pairs=dt == torch.bfloat16)
            for T in (1.0, 0.7):
                vocab.lse_partial(x, T, 2)
                vocab.token_logprobs(x, torch.tensor([0, 5, 31]), T, 2)
            vocab.max_with_index(x)
            ids = torch.tensor([0, 5, 9])
            for T, k, p in ((0.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 3, 1.0), (0.7, 0, 0.9),
                            (1.0, 3, 0.9)):
                sample.sample(x, T, k, p, 2 ** 63 + 5, ids, ids)
        vocab.lse_finish(torch.randn(2, 3), torch.rand(2, 3))
    finally:
        _launch.recorder = None
    return calls


def _signature(kernel, args, meta):
    sig, names = {}, kernel.arg_names
    for name, a in zip(names, args):
        if isinstance(a, torch.Tensor):
            sig[name] = _PTR[a.dtype]
        elif isinstance(a, bool):
            sig[name] = "i1"
        elif isinstance(a, int):
            sig[name] = "i32" if -2**31 <= a < 2**31 else "i64"
        else:
            sig[name] = "fp32"
    sig.update({k: "constexpr" for k in meta})
    return sig


def compile_ptx(kernel, args, meta, arch: int = 90) -> str:
    src = ASTSource(kernel, _signature(kernel, args, meta), constexprs=dict(meta))
    out = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                         options={"enable_fp_fusion": False})
    return out.asm["ptx"]


def lint(ptx: str) -> list:
    """The PTX lines that would change an exact kernel's bits."""
    return [ln.strip() for ln in ptx.splitlines() if _FORBIDDEN.search(ln)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90)
    arch = ap.parse_args(argv).arch
    if _launch.INTERPRETED:
        print("compile_check: unset TRITON_INTERPRET (the kernels must be JIT functions)")
        return 2
    seen, bad = set(), 0
    for kernel, args, meta in record_launches():
        key = (kernel.__name__, tuple(sorted(meta.items())),
               tuple(_signature(kernel, args, meta).values()))
        if key in seen:
            continue
        seen.add(key)
        t = time.time()
        ptx = compile_ptx(kernel, args, meta, arch)
        problems = lint(ptx)
        bad += bool(problems)
        fma = len(re.findall(r"\bfma\.rn\.f32\b", ptx))
        print(f"{kernel.__name__:24s} {time.time() - t:5.1f}s fma.rn {fma:5d}  "
              f"{'OK' if not problems else 'BAD: ' + '; '.join(problems[:3])}  {dict(meta)}")
    print(f"triton {triton.__version__}, sm_{arch}: {len(seen)} kernels compiled, "
          f"{bad} with problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
