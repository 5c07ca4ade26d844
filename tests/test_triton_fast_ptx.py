"""The fast kernels compile for an H100/H200 (sm_90, no GPU needed) as the design says.

What the interpreter cannot show about the compiled kernels: `fast_compile_check` computes the
specialization key Triton's launcher computes for a one-row and a 4096-row linear (a decode
query and a packed prefill; a 3-row and a 1000-row MoE call) and requires one key, i.e. one
compiled kernel, for both; then it compiles every kernel through Triton's pipeline to PTX and
ptxas and requires Hopper tensor-core instructions (wgmma) and no spills. The twin: a kernel
whose row count is specialized as Triton does by default gets two keys for 1 and 4096 rows.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

from test_triton_ptx import _compile_mode_env  # the environment without TRITON_INTERPRET


def test_fast_kernels_compile_to_one_tensor_core_kernel_for_any_row_count():
    proc = subprocess.run([sys.executable, "-m", "tonp_kernels.accel.fast_compile_check"],
                          env=_compile_mode_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and " 0 problems" in proc.stdout, proc.stdout + proc.stderr
    assert "m64n64k16" in proc.stdout  # the bf16 linear's wgmma shape, for every row count
    assert "moe_experts_grad bf16  _weight_kernel" in proc.stdout  # the experts' backward too


def test_a_row_specialized_kernel_gets_two_keys(tmp_path):
    """The twin: without do_not_specialize, Triton compiles M == 1 as a constant and marks
    M = 4096 divisible by 16, so a 1-row and a 4096-row call would be two kernels."""
    (tmp_path / "toy.py").write_text(textwrap.dedent("""
        import torch, triton, triton.language as tl
        from tonp_kernels.accel.fast_compile_check import spec_key

        @triton.jit
        def toy(x_ptr, M, BLOCK: tl.constexpr):
            tl.store(x_ptr + tl.arange(0, BLOCK), tl.full([BLOCK], M, tl.float32))

        @triton.jit(do_not_specialize=["M"])
        def fixed(x_ptr, M, BLOCK: tl.constexpr):
            tl.store(x_ptr + tl.arange(0, BLOCK), tl.full([BLOCK], M, tl.float32))

        x = torch.zeros(16)
        meta = dict(BLOCK=16, num_warps=4, num_stages=1)
        print(spec_key(toy, (x, 1), meta) != spec_key(toy, (x, 4096), meta),
              spec_key(fixed, (x, 1), meta) == spec_key(fixed, (x, 4096), meta))
    """))
    proc = subprocess.run([sys.executable, str(tmp_path / "toy.py")], env=_compile_mode_env(),
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True"], proc.stdout
