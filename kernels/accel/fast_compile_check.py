"""Compile the fast kernels for an NVIDIA target without a GPU, and check what the design promises.

    python -m tonp_kernels.accel.fast_compile_check [--arch 90]

For each case, the launches of a small call (one row, one decode query) and of a large one (4096
rows, a packed prefill) are recorded, not run; each launch's specialization key is computed as
Triton's launcher computes it (argument types, 16-byte divisibility, constexprs, warps, stages);
the two calls must give the same key for the matmul kernel: one compiled kernel, so one
instruction sequence, for a decode step and a training pass. Each kernel is then compiled through
Triton's own pipeline (PTX, ptxas) and must use the Hopper tensor cores (`wgmma.mma_async`; the
instruction shapes are printed) and spill nothing to local memory (cuobjdump's resource usage).
Run it without TRITON_INTERPRET (the kernels must be JIT functions).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource

from . import _launch

OPTIONS = ("num_warps", "num_stages")
MATMUL = ("_fast_linear_kernel", "_fast_attention_kernel")
GRADS = ("_rows_kernel", "_weight_kernel")  # the experts' backward (moe_grad.py)
FAST = MATMUL + GRADS + ("_finish_kernel",)  # the exact kernels the fast ops call: compile_check.py
_WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)")


def record(fn) -> list:
    """(kernel, args, meta) of every launch fn() makes; nothing runs."""
    _launch.recorder = calls = []
    try:
        fn()
    finally:
        _launch.recorder = None
    return calls


def _cases():
    """name -> (small call, large call): the calls whose matmul kernels must be one kernel."""
    from . import fast_attention as fa, fast_linear as fl, fast_moe as fm, moe_grad as mg

    g = torch.Generator().manual_seed(0)

    def linear(rows, dt):
        w = torch.randn(2048, 2048, generator=g).to(dt)
        return lambda: fl.linear(torch.randn(rows, 2048, generator=g).to(dt), w, None, 8)

    def moe(rows):
        gu = torch.randn(8, 256, 512, generator=g).bfloat16()
        dn = torch.randn(8, 512, 128, generator=g).bfloat16()
        ids = torch.randint(0, 8, (rows, 2), generator=g)
        return lambda: fm.moe_experts(torch.randn(rows, 512, generator=g).bfloat16(), ids, gu,
                                      dn, 0, 8)

    def attention(prefill, dt):
        Hq, Hkv, D, B = 32, 4, 128, 64
        kc = torch.randn(8, B, Hkv, D, generator=g).to(dt)
        table = torch.arange(8, dtype=torch.int32)[None]
        if prefill:
            q = torch.randn(300, Hq, D, generator=g).to(dt)
            kv = torch.randn(300, Hkv, D, generator=g).to(dt)
            return lambda: fa.attention_varlen(q, kv, kv, torch.tensor([0, 300]), D ** -0.5, B)
        q = torch.randn(1, Hq, D, generator=g).to(dt)
        return lambda: fa.attention_paged(q, kc, kc, table, torch.tensor([0]), torch.tensor([299]),
                                          D ** -0.5)

    def moe_grad(rows, dt):  # gate_up_out given: only the backward's own launches recorded
        gu = torch.randn(8, 256, 512, generator=g).to(dt)
        dn = torch.randn(8, 512, 128, generator=g).to(dt)
        ids = torch.randint(0, 8, (rows, 2), generator=g)
        grad, x = torch.randn(rows, 2, 512, generator=g), torch.randn(rows, 512, generator=g)
        gub = torch.randn(2 * rows, 256, generator=g).to(dt)
        return lambda: mg.moe_experts_grad(grad.to(dt), x.to(dt), ids, gu, dn, gub, 0, 8, [True] * 3)

    return {"linear bf16": (linear(1, torch.bfloat16), linear(4096, torch.bfloat16)),
            "linear fp32 (tf32)": (linear(1, torch.float32), linear(4096, torch.float32)),
            "moe_experts bf16": (moe(3), moe(1000)),
            "attention bf16": (attention(False, torch.bfloat16), attention(True, torch.bfloat16)),
            "attention fp32 (tf32)": (attention(False, torch.float32),
                                      attention(True, torch.float32)),
            "moe_experts_grad bf16": (moe_grad(3, torch.bfloat16), moe_grad(1000, torch.bfloat16)),
            "moe_experts_grad fp32": (moe_grad(3, torch.float32), moe_grad(1000, torch.float32))}


def spec_key(kernel, args, meta) -> tuple:
    """The specialization Triton's launcher computes for these arguments: per parameter its type
    and attributes (or constexpr value), then the compile options."""
    out = []
    for p, a in zip(kernel.params, list(args) + [meta[p.name] for p in kernel.params[len(args):]]):
        if p.is_constexpr:
            out.append((p.name, "constexpr", a))
            continue
        specialize = not getattr(p, "do_not_specialize", False)
        align = not getattr(p, "do_not_specialize_on_alignment", False)
        out.append((p.name,) + tuple(native_specialize_impl(CUDABackend, a, p.is_const,
                                                            specialize, align)))
    return tuple(out) + tuple((k, meta[k]) for k in OPTIONS)


def compile_key(kernel, key, arch: int = 90):
    """Compile one specialization for sm_<arch>; returns Triton's compiled kernel."""
    params = key[:len(kernel.params)]
    sig = {name: kind for name, kind, _ in params}
    consts = {name: v for name, kind, v in params if kind == "constexpr"}
    attrs = {(i,): CUDABackend.parse_attr(v) for i, (_, kind, v) in enumerate(params)
             if kind != "constexpr" and isinstance(v, str)}
    options = dict(key[len(kernel.params):], enable_fp_fusion=False)
    return triton.compile(ASTSource(kernel, sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options=options)


def resources(cubin: bytes) -> dict:
    """Registers, stack and local memory per thread, from cuobjdump -res-usage."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", text)}


def check(arch: int = 90, verbose=print) -> list:
    """Every problem found (an empty list: all promises hold)."""
    problems, compiled = [], {}
    for name, (small, large) in _cases().items():
        keys = [[(k, spec_key(k, a, m)) for k, a, m in record(fn) if k.__name__ in FAST]
                for fn in (small, large)]
        mm = [[key for k, key in ks if k.__name__ in MATMUL] for ks in keys]
        if mm[0] != mm[1]:
            problems.append(f"{name}: the small and the large call compile different kernels")
        for kernel, key in keys[0] + keys[1]:
            if (kernel.__name__, key) in compiled:
                continue
            t = time.time()
            ck = compile_key(kernel, key, arch)
            res = resources(ck.asm["cubin"])
            mma = sorted(set(_WGMMA.findall(ck.asm["ptx"])))
            compiled[(kernel.__name__, key)] = mma
            tensor_cores = kernel.__name__ in MATMUL or kernel.__name__ in GRADS and "bf16" in name
            if tensor_cores and not mma:
                problems.append(f"{name}: {kernel.__name__} uses no wgmma (tensor cores)")
            if res.get("STACK", 0) or res.get("LOCAL", 0):
                problems.append(f"{name}: {kernel.__name__} spills ({res})")
            verbose(f"{name:22s} {kernel.__name__:24s} {time.time() - t:5.1f}s {res} "
                    f"{' '.join(mma) or '-'}")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90)
    arch = ap.parse_args(argv).arch
    problems = check(arch) if not _launch.INTERPRETED else \
        ["unset TRITON_INTERPRET: the kernels must be JIT functions to compile"]
    print("".join(f"PROBLEM: {p}\n" for p in problems) +
          f"triton {triton.__version__}, sm_{arch}: {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
