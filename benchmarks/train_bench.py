"""The training targets on the 30B-A3B layer shapes: training step / forward, invariant vs stock
torch training, invariant vs stock bf16 prefill, fp32 training against the compute bound.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/train_bench.py [--quick] [--layers 1]

One tonp model per dtype; every contender of a dtype (tonp "invariant" and "torch" kernel modes:
the scoring forward without grad, the training step = that forward + backward of the mean token
log-prob, a prefill = `generate` with one new token; and two fp32 2048^3 GEMMs, MKL's
(torch.mm) and tonp's backward GEMM (a linear_backward weight gradient), the faster one the compute
bound's rate) runs round-robin in one `timeit_interleaved`, so the ratios hold on a shared
machine. The ISA is the kernel table this process runs (`tonp_kernels.isa()`). The backward GEMMs
are also judged against the stock ones: tonp's fp32 against MKL's, tonp's bf16 against stock
torch's bf16 matmul (a training step's backward runs on them).
Writes benchmarks/results/train.{md,json}, or train_<machine> where train.json holds another
machine's run (benchlib.record_stem).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

import tonp_kernels as tk
from tonp_models import Qwen3MoeConfig, Qwen3MoeForCausalLM

import roofline
from benchlib import fmt_ratio, free_memory, log, machine_meta, md_table, timeit_interleaved, write_record
from model_bench import DTYPES, TonpEngine

GEMM_N = roofline.GEMM_N


def contenders(model, ids: torch.Tensor, dtype: str) -> dict:
    """name -> call: forward, training step and prefill in both kernel modes, and the GEMMs: fp32
    (MKL's and tonp's backward GEMM), and in bf16 stock torch's bf16 matmul and tonp's bf16
    backward GEMM (the same weight-gradient call on bf16 operands)."""
    out = {}
    for mode in ("invariant", "torch"):
        e = TonpEngine(model, mode)

        def forward(mode=mode):
            with torch.no_grad(), tk.use(mode):
                model.token_logprobs(list(ids))
        out[f"{mode} forward"] = forward
        out[f"{mode} train"] = lambda e=e: e.train_step(ids)
        out[f"{mode} prefill"] = lambda e=e: e.prefill(ids)
    a, b = torch.randn(GEMM_N, GEMM_N), torch.randn(GEMM_N, GEMM_N)
    out["fp32 GEMM"] = lambda: torch.mm(a, b)
    # tonp's own AVX-512 GEMM outruns MKL's on AMD CPUs (MKL takes its AVX2 path there): a bound
    # below a measured rate is no bound, so the faster of the two sets it.
    out["tonp fp32 GEMM"] = lambda: torch.ops.tonp.linear_backward(a, b, a, [False, True, False],
                                                                   None)
    if dtype == "bf16":
        a16, b16 = a.bfloat16(), b.bfloat16()
        # Stock torch's bf16 matmul in its fast layout (B transposed, as F.linear calls it: on
        # an AVX2-only CPU torch.mm(a16, b16) runs ~60x slower).
        out["bf16 GEMM"] = lambda: torch.mm(a16, b16.t())
        out["tonp bf16 GEMM"] = lambda: torch.ops.tonp.linear_backward(a16, b16, a16, [False, True, False], None)
    return out


def measure(config, dtype: str, shape: tuple, repeat: int, budget_s: float) -> dict:
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config, dtype=DTYPES[dtype])
    ids = torch.randint(0, config.vocab_size, shape, generator=torch.Generator().manual_seed(100))
    t = timeit_interleaved(contenders(model, ids, dtype), repeat=repeat, max_total_s=budget_s,
                           max_call_s=120.0, stat="median")
    model.zero_grad(set_to_none=True)
    del model
    free_memory()
    s = {k: v.seconds for k, v in t.items()}
    tokens = shape[0] * shape[1]
    gflops = 2 * GEMM_N ** 3 / min(s["fp32 GEMM"], s["tonp fp32 GEMM"]) / 1e9
    bound = roofline.compute_bound_tok_s(config, {"gemm_fp32_GFLOPs": gflops}, (shape[1] + 1) / 2,
                                         training=True)
    rate = {k: 2 * GEMM_N ** 3 / s[k] / 1e9 for k in s if k.endswith("GEMM")}
    backward = {"fp32": rate["tonp fp32 GEMM"] / rate["fp32 GEMM"]}
    if "bf16 GEMM" in rate:
        backward["bf16"] = rate["tonp bf16 GEMM"] / rate["bf16 GEMM"]
    return {"seconds": s, "runs": {k: v.runs for k, v in t.items()}, "gemm_GFLOPs": gflops,
            "gemm_rates_GFLOPs": rate, "backward_gemm_vs_stock": backward,
            "train_vs_forward": s["invariant train"] / s["invariant forward"],
            "torch_train_vs_forward": s["torch train"] / s["torch forward"],
            "train_speedup_vs_torch": s["torch train"] / s["invariant train"],
            "prefill_vs_torch": s["torch prefill"] / s["invariant prefill"],
            "train_pct_of_bound": 100 * tokens / s["invariant train"] / bound}


def gemm_cell(r: dict, dt: str, ours: str, stock: str) -> str:
    """'0.87x (136 against 156 GFLOP/s)': tonp's backward GEMM against the stock one."""
    g = r["gemm_rates_GFLOPs"]
    return f"{fmt_ratio(r['backward_gemm_vs_stock'][dt])} ({g[ours]:.0f} against {g[stock]:.0f} GFLOP/s)"


def report(meta: dict, case: str, res: dict) -> str:
    isa = res["isa"]
    rows = []
    for dt in ("fp32", "bf16"):
        r = res[dt]
        s = r["seconds"]
        rows.append([dt, f"{s['invariant forward'] * 1e3:.0f}", f"{s['invariant train'] * 1e3:.0f}",
                     fmt_ratio(r["train_vs_forward"]), f"{s['torch forward'] * 1e3:.0f}",
                     f"{s['torch train'] * 1e3:.0f}", fmt_ratio(r["torch_train_vs_forward"]),
                     fmt_ratio(r["train_speedup_vs_torch"]), f"{s['invariant prefill'] * 1e3:.0f}",
                     f"{s['torch prefill'] * 1e3:.0f}", fmt_ratio(r["prefill_vs_torch"]),
                     f"{r['gemm_GFLOPs']:.0f}", f"{r['train_pct_of_bound']:.0f}%"])
    table = md_table(["dtype", "inv fwd ms", "inv train ms", "train/fwd", "torch fwd ms",
                      "torch train ms", "torch train/fwd", "inv train speed vs torch",
                      "inv prefill ms", "torch prefill ms", "inv prefill speed vs torch",
                      "fp32 GEMM GFLOP/s (best of MKL, tonp)", "inv train % of bound"], rows)

    def status(ok):
        return "met" if ok else "**NOT met**"
    f, b = res["fp32"], res["bf16"]
    targets = md_table(["target", "measured", "status"], [
        ["training step <= 3x invariant forward, fp32", fmt_ratio(f["train_vs_forward"]),
         status(f["train_vs_forward"] <= 3)],
        ["training step <= 3x invariant forward, bf16", fmt_ratio(b["train_vs_forward"]),
         status(b["train_vs_forward"] <= 3)],
        ["invariant training >= stock torch training, fp32",
         fmt_ratio(f["train_speedup_vs_torch"]) + " torch's speed", status(f["train_speedup_vs_torch"] >= 1)],
        ["invariant training >= stock torch training, bf16",
         fmt_ratio(b["train_speedup_vs_torch"]) + " torch's speed", status(b["train_speedup_vs_torch"] >= 1)],
        ["invariant bf16 prefill >= 0.9x stock bf16 prefill" + ("" if "bf16" in isa else
                                                                 " (applies on AVX512-BF16 only)"),
         fmt_ratio(b["prefill_vs_torch"]), status(b["prefill_vs_torch"] >= 0.9)],
        ["fp32 training >= 40% of the compute bound", f"{f['train_pct_of_bound']:.0f}%",
         status(f["train_pct_of_bound"] >= 40)],
        [f"tonp's backward GEMM >= 0.7x MKL's fp32 GEMM ({GEMM_N}^3)",
         gemm_cell(f, "fp32", "tonp fp32 GEMM", "fp32 GEMM"), status(f["backward_gemm_vs_stock"]["fp32"] >= 0.7)],
        [f"tonp's bf16 backward GEMM >= 0.7x stock torch's bf16 matmul ({GEMM_N}^3)",
         gemm_cell(b, "bf16", "tonp bf16 GEMM", "bf16 GEMM"), status(b["backward_gemm_vs_stock"]["bf16"] >= 0.7)]])
    return "\n".join([
        f"# Training speed, {meta['date']}", "",
        f"{meta['cpu']}, kernel table **{isa}**, bf16 backward GEMM on **{res.get('backward_gemm', isa)}** "
        f"(flags: {' '.join(meta['cpu_flags'])}), "
        f"{meta['threads']} threads, torch {meta['torch']}; load average {meta['load_before']:.1f} "
        "before. Every ratio is between calls measured round-robin in this one process (median "
        "of the runs); absolute times move with the machine's load.", "",
        f"Model: {case}. \"torch\" = the same tonp model with stock torch ops "
        "(`tonp_kernels.use(\"torch\")`). Forward = `token_logprobs` without grad; train = forward "
        "+ backward of the mean token log-prob; prefill = `generate` with one new token. The "
        "compute bound: 3x the forward's FLOPs per token (roofline.py) at the faster fp32 GEMM "
        "rate (MKL's torch.mm or tonp's backward GEMM, 2048^3) measured in the same rounds (bf16 is held to the same fp32 bound).", "",
        "## Targets", "", targets, "", "## Measurements", "", table, ""])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model, a check that the code runs")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    a = p.parse_args(argv)
    if a.quick:
        config, shape, stem = Qwen3MoeConfig.preset("tiny", num_hidden_layers=1), (2, 16), "train_quick"
    else:
        config = Qwen3MoeConfig.preset("qwen3_30b_a3b", num_hidden_layers=a.layers, vocab_size=16384,
                                       max_position_embeddings=4096, bos_token_id=None,
                                       eos_token_id=None)
        shape, stem = (2, 128), "train"
    case = (f"30B-A3B layer shapes, {config.num_hidden_layers} layer(s), vocab {config.vocab_size}, "
            f"{shape[0]} sequences x {shape[1]} tokens" if not a.quick else "tiny, 1 layer")
    meta = machine_meta()
    res = {"isa": tk.isa(), "backward_gemm": torch.ops.tonp.backward_gemm(), "case": case, "meta": meta}
    for dt in ("fp32", "bf16"):
        log(f"{case}: {dt}")
        res[dt] = measure(config, dt, shape, 1 if a.quick else a.repeat, 5.0 if a.quick else 600.0)
    md = report(meta, case, res)
    for path in write_record(a.out, stem, md, res):  # per machine: never over another CPU's record
        log(f"wrote {path}")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
