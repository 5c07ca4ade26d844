"""The exact kernels compile for an H100/H200 (sm_90, no GPU needed) and keep their arithmetic.

What the interpreter cannot show: that the GPU compiler keeps the operations. Every kernel,
in every dtype and mode its launchers use, is compiled through Triton's own pipeline to PTX
(and by ptxas) and its PTX has no approximate division, square root, exp2, log2 or reciprocal,
no flush-to-zero form and no fp32 add/sub/mul that ptxas could contract into an fma (with fp
fusion off Triton writes them `.rn`). The twin: a kernel using `/` and tl.exp fails the lint.
And the kernels call only Triton builtins: a Triton library function (tl.max, tl.zeros, ...)
would stay compiled when triton was imported before TRITON_INTERPRET was set, and would break
the interpreted runs.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

import tonp_kernels

ACCEL = os.path.join(os.path.dirname(tonp_kernels.__file__), "accel")


def _compile_mode_env():
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    return env


def test_every_kernel_compiles_for_sm90_with_only_exact_instructions():
    proc = subprocess.run([sys.executable, "-m", "tonp_kernels.accel.compile_check"],
                          env=_compile_mode_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and " 0 with problems" in proc.stdout, proc.stdout + proc.stderr


def test_the_lint_rejects_approximate_division_and_exp(tmp_path):
    """The twin: plain `/` and tl.exp compile to approximate PTX, which the lint reports."""
    (tmp_path / "toy.py").write_text(textwrap.dedent("""
        import triton, triton.language as tl
        from tonp_kernels.accel import compile_check as cc

        @triton.jit
        def toy(x_ptr, y_ptr):
            x = tl.load(x_ptr + tl.arange(0, 16))
            tl.store(y_ptr + tl.arange(0, 16), tl.exp(x) / (x + 1.0))

        import torch
        x = torch.zeros(16)
        print("\\n".join(cc.lint(cc.compile_ptx(toy, (x, x), {}))))
    """))
    proc = subprocess.run([sys.executable, str(tmp_path / "toy.py")], env=_compile_mode_env(),
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"ex2\.approx", proc.stdout), proc.stdout
    assert re.search(r"div\.(approx|full)", proc.stdout), proc.stdout


def test_kernels_call_only_triton_builtins():
    used = set()
    for name in os.listdir(ACCEL):
        if name.endswith(".py"):
            with open(os.path.join(ACCEL, name)) as f:
                used |= set(re.findall(r"\btl\.([a-z_0-9]+)\b", f.read()))
    library = sorted(n for n in used
                     if isinstance(getattr(tl, n, None), (JITFunction, InterpretedFunction)))
    assert not library, f"Triton library functions in the kernels: {library}"
