"""AMX-BF16 on this CPU: what `tdpbf16ps` computes, and what a linear in its order would gain.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/amx_bench.py          # ~3 min; needs AMX-BF16
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/amx_bench.py --quick  # ~1 min (amx_quick.md)

1. Numerics. The instruction (torch.ops.tonp.amx_tdpbf16ps) on random operands of two kinds,
   ordinary (normal values, cancellation) and hostile (any bit pattern, tiny normals whose
   products fall below FLT_MIN, accumulators near FLT_MIN and subnormal), against three readings
   of it (tonp_kernels.amx): the measured model (two step chains, then C + (E + O)), the
   contract's pair chains from C, and Intel's documented order. The share of outputs each gives
   bit for bit (NaN by position).
2. Throughput of a bf16 x bf16 linear on 30B-A3B shapes, the contenders in turn within each
   repeat: stock torch's bf16 matmul (oneDNN, AMX here), tonp's linear (the contract's pair
   chains on vdpbf16ps), the AMX prototype of the proposed block chains (amx_linear_blocks;
   weights packed in the call, and pre-packed), the same bits on AVX-512 FMAs without AMX
   (fma_linear_blocks: what the proposal costs a CPU that lacks it), MKL's fp32 GEMM and tonp's
   fp32 linear. GFLOP/s and the
   ratio to stock bf16.
3. The bf16 backward GEMM (on AMX: kernels/csrc/gemm_amx.h) against stock torch's bf16 matmul at a
   square shape and the 30B-A3B training step's: an input and a weight gradient, round-robin.
On a CPU with AVX-512F but no AMX (AMD EPYC) only part 2 runs, without the AMX contenders: the
proposal's cost there. Writes benchmarks/results/amx{,_quick}.{md,json}, or amx_<machine>... where
that file holds another machine's run (benchlib.record_stem: amx.md is the Intel Xeon's record);
`make bench` runs it
where the CPU has AMX-BF16 or AVX-512F. CONTRACT.md ("AMX and the pair chains") reads them.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tonp_kernels as tk  # noqa: E402
import tonp_kernels.amx as amx  # noqa: E402
from benchlib import (RESULTS_DIR, busy_warning, fmt, fmt_ratio, log, machine_meta, md_table,  # noqa: E402
                      timeit_interleaved, write_record)

SHAPES = [("gate_up / q_proj, prefill", 512, 2048, 6144), ("q_proj, batch 128", 128, 2048, 4096),
          ("expert gate_up, 16 rows", 16, 2048, 1536), ("expert down, 16 rows", 16, 768, 2048),
          ("q_proj, batch 1", 1, 2048, 4096)]
CHUNKS = 8


def _bf16(v):
    return v.to(torch.int32).to(torch.int16).view(torch.bfloat16)


def operands(kind, M, N, K, gen):
    if kind == "ordinary":
        return (torch.randn(M, N, generator=gen), torch.randn(M, K, 2, generator=gen).bfloat16(),
                torch.randn(K, N, 2, generator=gen).bfloat16())

    def elems(shape):
        n = int(torch.Size(shape).numel())
        k = torch.randint(0, 3, (n,), generator=gen)
        raw = torch.randint(0, 1 << 16, (n,), generator=gen)
        e = torch.where(k == 1, 40 + torch.randint(0, 60, (n,), generator=gen),
                        120 + torch.randint(0, 16, (n,), generator=gen))
        return _bf16(torch.where(k == 0, raw, (raw & 0x8000) | (e << 7) | (raw & 0x7F))).reshape(shape)

    n = M * N
    k = torch.randint(0, 3, (n,), generator=gen)
    r = torch.randint(0, 1 << 31, (n,), generator=gen)
    c = torch.where(k == 0, 0x00800000 + r % 64 - 32, torch.where(k == 1, r % 0x00800000, r))
    c = c | (torch.randint(0, 2, (n,), generator=gen) << 31)
    c = torch.where(c >= 1 << 31, c - (1 << 32), c).to(torch.int32).view(torch.float32).reshape(M, N)
    return c, elems((M, K, 2)), elems((K, N, 2))


def _bits(t):
    b = t.contiguous().view(torch.int32).clone()
    b[t.isnan()] = 0x7FC00000
    return b


def numerics(samples):
    gen = torch.Generator().manual_seed(0)
    readings = {"measured model": amx.tdpbf16ps_model, "pair chains from C (contract)": amx.pair_chain_order,
                "documented order (SDM)": amx.documented_order}
    rows, data = [], []
    for kind in ("ordinary", "hostile"):
        for (M, N, K) in ((16, 1, 1), (16, 1, 2), (16, 16, 16)):
            agree = {r: 0 for r in readings}
            total = 0
            while total < samples:
                c, a, b = operands(kind, M, N, K, gen)
                hw = _bits(torch.ops.tonp.amx_tdpbf16ps(c, a, b))
                for name, f in readings.items():
                    agree[name] += int((_bits(f(c, a, b)) == hw).sum())
                total += hw.numel()
            row = {"inputs": kind, "shape": f"M={M} N={N} K={K} pairs", "outputs": total,
                   **{n: agree[n] / total for n in readings}}
            data.append(row)
            rows.append([kind, row["shape"], total] + [f"{100 * agree[n] / total:.2f}%" for n in readings])
    return md_table(["inputs", "instruction", "outputs"] + list(readings), rows), data


def _has_avx512f():
    try:
        with open("/proc/cpuinfo") as f:
            return "avx512f" in f.read().split()
    except OSError:
        return False


def throughput(repeat, max_s, with_amx):
    gen = torch.Generator().manual_seed(1)
    rows, data = [], []
    for name, M, K, N in SHAPES:
        x = torch.randn(M, K, generator=gen).bfloat16()
        w = (torch.randn(N, K, generator=gen) * 0.05).bfloat16()
        xf, wf = x.float(), w.float()
        packed = torch.ops.tonp.amx_pack_blocks(w, CHUNKS)
        fns = {
            "stock bf16 matmul": lambda: torch.nn.functional.linear(x, w),
            "tonp linear (pair chains)": lambda: tk.linear(x, w, chunks=CHUNKS),
        }
        if with_amx:
            fns["AMX block chains"] = lambda: torch.ops.tonp.amx_linear_blocks(x, w, CHUNKS)
            fns["AMX block chains, pre-packed"] = lambda: torch.ops.tonp.amx_linear_blocks(x, w, CHUNKS, packed)
        fns.update({
            "AVX-512 FMA block chains, pre-packed": lambda: torch.ops.tonp.fma_linear_blocks(x, w, CHUNKS, packed),
            "MKL fp32": lambda: torch.nn.functional.linear(xf, wf),
            "tonp linear fp32": lambda: tk.linear(xf, wf, chunks=CHUNKS),
        })
        t = timeit_interleaved(fns, repeat=repeat, max_total_s=max_s)
        flops = 2 * M * K * N
        base, mkl = t["stock bf16 matmul"].seconds, t["MKL fp32"].seconds
        for c, tm in t.items():
            rows.append([name, f"{M}x{K}x{N}", c, fmt(flops / tm.seconds / 1e9), fmt_ratio(base / tm.seconds),
                         fmt_ratio(mkl / tm.seconds)])
            data.append({"shape": name, "M": M, "K": K, "N": N, "contender": c, "gflops": flops / tm.seconds / 1e9,
                         "vs_stock_bf16": base / tm.seconds, "vs_mkl_fp32": mkl / tm.seconds, "timing": tm})
    return md_table(["shape", "M x K x N", "contender", "GFLOP/s", "vs stock bf16", "vs MKL fp32"], rows), data


# The bf16 backward GEMM's shapes: a square one, and the 30B-A3B training step's (k = 256 tokens,
# or 256 rows against K = 2048-4096), as m x k x n of C[m, n] = A[m, k] B[k, n].
BACKWARD_SHAPES = [(2048, 2048, 2048), (4096, 256, 2048), (2048, 256, 4096), (256, 4096, 2048),
                   (256, 2048, 4096), (768, 256, 2048)]


def backward_gemm(repeat, max_s):
    """tonp's bf16 backward GEMM (on AMX where the process may use it: gemm_amx.h) as
    linear_backward runs it, an input gradient (A row-major) and a weight gradient (A the output
    gradient transposed, column-major), against stock torch's bf16 matmul of the same m x k x n,
    round-robin."""
    gen = torch.Generator().manual_seed(2)
    rows, data = [], []
    for m, k, n in BACKWARD_SHAPES:
        a = torch.randn(m, k, generator=gen).bfloat16()
        bt = torch.randn(n, k, generator=gen).bfloat16()     # B^T, as F.linear reads a weight
        w, x = bt.t().contiguous(), torch.randn(m, n, generator=gen).bfloat16()  # dx = g [m, k] @ w [k, n]
        g, xt = torch.randn(k, m, generator=gen).bfloat16(), torch.randn(k, n, generator=gen).bfloat16()
        wt = torch.empty(m, n, dtype=torch.bfloat16)          # dW = g^T [m, k] @ x [k, n]
        fns = {"stock bf16 matmul": lambda: torch.nn.functional.linear(a, bt),
               "tonp dx": lambda: torch.ops.tonp.linear_backward(a, x, w, [True, False, False], None),
               "tonp dW": lambda: torch.ops.tonp.linear_backward(g, xt, wt, [False, True, False], None)}
        t = timeit_interleaved(fns, repeat=repeat, max_total_s=max_s)
        flops, base = 2 * m * k * n, t["stock bf16 matmul"].seconds
        for c, tm in t.items():
            rows.append([f"{m}x{k}x{n}", c, fmt(flops / tm.seconds / 1e9), fmt_ratio(base / tm.seconds)])
            data.append({"m": m, "k": k, "n": n, "contender": c, "gflops": flops / tm.seconds / 1e9,
                         "vs_stock_bf16": base / tm.seconds, "timing": tm})
    return md_table(["m x k x n", "contender", "GFLOP/s", "vs stock bf16"], rows), data


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=200_000, help="outputs per numerics row")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--max-s", type=float, default=20.0, help="time budget per shape")
    ap.add_argument("--quick", action="store_true", help="20k outputs per row, 3 repeats: amx_quick.md")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    a = ap.parse_args(argv)
    if a.quick:
        a.samples, a.repeat, a.max_s = 20_000, 3, 8.0
    meta = machine_meta()
    has_amx = amx.available()
    if not has_amx and not _has_avx512f():
        print(f"amx_bench: this CPU ({meta['cpu']}) has no AMX-BF16 and no AVX-512F; nothing to measure")
        return 0
    meta["amx"] = has_amx
    num_md, num = "", []
    if has_amx:
        log("amx_bench: numerics")
        num_md, num = numerics(a.samples)
    log("amx_bench: throughput")
    thr_md, thr = throughput(a.repeat, a.max_s, has_amx)
    bwd_md, bwd = "", []
    if has_amx:
        log("amx_bench: the backward GEMM")
        bwd_md, bwd = backward_gemm(a.repeat, a.max_s)
    flags = ", ".join(meta["cpu_flags"])
    md = "\n\n".join(x for x in (
        f"# AMX-BF16: what tdpbf16ps computes, and a linear in its order\n\n{meta['date']}; {meta['cpu']} ({flags}); "
        f"kernel table **{meta['isa']}**; {meta['threads']} threads; torch {meta['torch']}.",
        busy_warning(meta),
        "This CPU has no AMX-BF16: no numerics, and the block chains only on AVX-512 FMAs (what the "
        "proposal would cost it)." if not has_amx else "",
        "## Numerics: share of outputs each reading gives bit for bit (NaN by position)\n\n" + num_md
        if has_amx else "",
        "Ordinary: normal fp32 accumulators, bf16 operands from a normal distribution. Hostile: per "
        "element any bit pattern (infinities, NaN, subnormals), a tiny normal (products below FLT_MIN) "
        "or a value near 1; accumulators within 32 ulps of FLT_MIN, subnormal or any bit pattern. "
        "The measured model: E and O, step chains over the even and odd elements from +0; then "
        "C + (E + O) (`tonp_kernels.amx.tdpbf16ps_model`)." if has_amx else "",
        f"## Throughput: bf16 x bf16 linear, {CHUNKS} chunks, fp32 out for the AMX prototype\n\n" + thr_md,
        "Contenders in turn within each repeat, median of the repeats; ratios to stock torch's bf16 "
        "matmul and to MKL's fp32 GEMM in the same run. 'AMX block chains' packs the weights into B tiles in the call; "
        "'pre-packed' is the kernel alone, as a model that packs its weights once at load would run it. "
        "The prototypes, with no prefetching: AMX 2 x 2 tiles in tiles of 64 rows x 128 columns, the "
        "chunks outermost (x packed into tile order in the call); FMA 4 rows x 32 columns; both close "
        "the chunk tree in AVX-512 adds and give the reference's bits (tests/test_amx.py).",
        "## The bf16 backward GEMM on AMX against stock torch's bf16 matmul\n\n" + bwd_md if has_amx else "",
        "C[m, n] = A[m, k] B[k, n] in bf16, rounded once: tonp's as `linear_backward` runs it (dx: A row-major; "
        "dW: A the output gradient transposed, column-major; both operands packed once into tile order, "
        "`csrc/gemm_amx.h`), stock torch's as `F.linear`; round-robin, median of the repeats. Gradients are "
        "not order-locked (CONTRACT.md, \"Gradients\"); tests/test_backward.py holds tonp's to the "
        "instruction's measured model bit for bit." if has_amx else "",
    ) if x)
    paths = write_record(a.out, "amx_quick" if a.quick else "amx", md + "\n",
                         {"meta": meta, "numerics": num, "throughput": thr, "backward_gemm": bwd})
    print(md)
    log("amx_bench: wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
