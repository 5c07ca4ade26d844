"""The bf16 x bf16 linear on this CPU: vdpbf16ps pair chains against fp32 FMAs, and tonp against
stock torch. Measurements behind the bf16 decision (docs/history/performance-training.md).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bf16dot.py [--repeats 9]

1. The C++ microbenchmark (bf16dot_bench.cpp, built here with the extension's flags): the kernel
   tables called directly, candidates sampled in turn within every repeat (fp32fma: the fp32-FMA
   kernel with bf16 weights widened as loaded; hw: vdpbf16ps; emu: the AVX2 emulation).
2. The ops in this process, in turn: tonp.linear bf16 (pair chains), tonp.linear with fp32 x
   (fp32 FMAs), stock F.linear bf16 (oneDNN).
Every ratio is taken within one repeat (neighbouring samples); the table gives median and range
over repeats. Writes benchmarks/results/bf16dot.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings, when run as a script
import tonp_kernels as tk  # noqa: E402
from benchlib import RESULTS_DIR, build_kernel_bench, machine_meta, md_table  # noqa: E402

OP_SHAPES = [("q_proj", 256, 2048, 4096), ("o_proj", 256, 4096, 2048), ("lm_head", 256, 2048, 16384),
             ("expert gate_up", 16, 2048, 1536), ("expert down", 16, 768, 2048),
             ("q_proj", 1, 2048, 4096)]


def kernel_table(exe: Path, repeats: int, threads: int) -> tuple[str, list]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run([str(exe), str(repeats), "0.05"], capture_output=True, text=True, env=env,
                         check=True).stdout.splitlines()
    head, rows = out[0], {}
    for line in out[1:]:
        shape, cand, *g = line.split("|")
        rows.setdefault(shape, {})[cand] = [float(v) for v in g]
    table = []
    for shape, c in rows.items():
        base = c["fp32fma"]
        for cand, g in c.items():
            ratio = [a / b for a, b in zip(g, base)]
            table.append([shape, cand, f"{statistics.median(g):.0f}", f"{min(g):.0f}-{max(g):.0f}",
                          "" if cand == "fp32fma" else
                          f"{statistics.median(ratio):.2f}x ({min(ratio):.2f}-{max(ratio):.2f})"])
    return head, table


def op_table(repeats: int) -> list:
    torch.manual_seed(0)
    rows = []
    for name, M, K, N in OP_SHAPES:
        x = torch.randn(M, K).bfloat16()
        w = (torch.randn(N, K) * K ** -0.5).bfloat16()
        xf = x.float()
        fns = {"tonp pairs": lambda: tk.linear(x, w), "tonp fp32fma": lambda: tk.linear(xf, w),
               "stock bf16": lambda: F.linear(x, w)}
        gf = {k: [] for k in fns}
        for f in fns.values():
            f()
        for _ in range(repeats):
            for k, f in fns.items():
                n, t = 0, 0.0
                while t < 0.05:
                    t0 = time.perf_counter()
                    f()
                    t += time.perf_counter() - t0
                    n += 1
                gf[k].append(2 * M * K * N * n / t / 1e9)
        for k, g in gf.items():
            r = [a / b for a, b in zip(gf["tonp pairs"], g)]
            rows.append([f"{name} M={M}", k, f"{statistics.median(g):.0f}", f"{min(g):.0f}-{max(g):.0f}",
                         "" if k == "tonp pairs" else
                         f"{statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})"])
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "bf16dot.md")
    args = ap.parse_args(argv)
    meta = machine_meta()
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        exe = build_kernel_bench("bf16dot_bench", Path(tmp))
        head1, ktab1 = kernel_table(exe, args.repeats, 1)
        head, ktab = kernel_table(exe, args.repeats, threads)
    otab = op_table(args.repeats)
    md = [f"# bf16 x bf16 linear: vdpbf16ps pair chains vs fp32 FMAs ({meta['date']})", "",
          f"{meta['cpu']} ({', '.join(meta['cpu_flags'])}), {threads} threads, load average "
          f"{meta['load_before']:.1f} before, {os.getloadavg()[0]:.1f} after; {head}.", "",
          "## Kernels, one thread (bf16dot_bench.cpp: GFLOP/s, median and range over repeats; "
          "ratio to fp32fma within each repeat)", "",
          md_table(["shape (30B-A3B)", "kernel", "GFLOP/s", "range", "vs fp32fma"], ktab1), "",
          f"## Kernels, {threads} threads (small shapes: a parallel region's wake-up, which a "
          "neighbour's load on the other core stretches, dominates)", "",
          md_table(["shape (30B-A3B)", "kernel", "GFLOP/s", "range", "vs fp32fma"], ktab), "",
          "## Ops (GFLOP/s; ratio: tonp pairs over the row's op, within each repeat)", "",
          md_table(["shape", "op", "GFLOP/s", "range", "tonp pairs / this"], otab), ""]
    args.out.write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
