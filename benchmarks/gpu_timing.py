"""The timing sections of benchmarks/gpu_check.py: every number is a ratio against a baseline
measured in the same process (a device copy, torch.matmul, torch mode, SGEMM). Kernel times are
medians of CUDA-event timings by triton.testing.do_bench, which clears the L2 cache before each
run (weights are read from HBM, as in a decode step). A dry run calls each timed function once
and records no number."""
from __future__ import annotations

import statistics

import torch

import tonp_kernels as tk
from gpu_sections import BF16, Inputs, numerics
from tonp_kernels.accel import fast_linear as fl, linear as exact_linear
from tonp_models.engine import PageAllocator, extend

FP32_PEAK_TFLOPS = 67.0  # H100 / H200 SXM datasheet (a lead; SGEMM is measured beside it)
# Decode-shaped linears of the 30B model (K, N): qkv, o_proj, lm_head; and a square one.
DECODE_SHAPES = ((2048, 5120), (4096, 2048), (2048, 151936), (4096, 4096))
GEMM_SHAPES = ((4096, 4096), (2048, 5120), (4096, 2048), (2048, 1536))


def bench(sec, fn) -> float | None:
    """Median milliseconds of fn() on the device (None in a dry run, where fn runs once)."""
    if sec.dry:
        fn()
        return None
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def bench_graph(sec, fn) -> float | None:
    """bench() of fn captured once in a CUDA graph and replayed: the device's time without the
    host's launch overhead (how a decode engine on a GPU runs its steps). None in a dry run."""
    if sec.dry:
        fn()
        return None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles) off the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench(sec, graph.replay)


def _ratio(a, b):
    return None if a is None or b is None else a / b


def decode_linear(sec) -> None:
    """Bytes a decode-shaped fast linear reads and writes per second, over a device-to-device
    copy of as many bytes (counted read + written), both timed here: target >= 0.70."""
    r, dev = Inputs(2), sec.device
    shapes = DECODE_SHAPES if not sec.dry else ((64, 96),)
    for K, N in shapes:
        w = r(N, K, dtype=BF16, scale=K ** -0.5).to(dev)
        for M in ((1, 4, 16) if not sec.dry else (1,)):
            x = r(M, K, dtype=BF16).to(dev)
            nbytes = 2 * (N * K + M * K + M * N)
            src = torch.empty(nbytes // 2, dtype=BF16, device=dev)
            dst = torch.empty_like(src)
            t_copy = bench(sec, lambda: dst.copy_(src))
            t_fast = bench(sec, lambda: fl.linear(x, w, None, 8))
            bw_copy = None if t_copy is None else 2 * nbytes / t_copy / 1e9  # TB/s
            bw_fast = None if t_fast is None else nbytes / t_fast / 1e9
            ratio = _ratio(bw_fast, bw_copy)
            sec.metric(f"fast linear M={M} K={K} N={N}: bandwidth / copy's", ratio, "",
                       ">= 0.70", None if ratio is None else ratio >= 0.70,
                       note=f"eager: {bw_fast and round(bw_fast, 2)} vs "
                            f"{bw_copy and round(bw_copy, 2)} TB/s")
            # the linear replayed from a CUDA graph: the kernels' own bandwidth, no host launch
            # time, over the eager copy's (a copy captured in a graph ran 1.5x slower than
            # eagerly on the first H200, so it is no ceiling)
            g_fast = bench_graph(sec, lambda: fl.linear(x, w, None, 8))
            bw_graph = None if g_fast is None else nbytes / g_fast / 1e9
            ratio = _ratio(bw_graph, bw_copy)
            sec.metric(f"fast linear M={M} K={K} N={N}, CUDA graph: bandwidth / copy's", ratio,
                       "", ">= 0.70", None if ratio is None else ratio >= 0.70,
                       note=f"{g_fast and round(g_fast * 1e3, 1)} us: "
                            f"{bw_graph and round(bw_graph, 2)} TB/s")
            if M == 1:
                t_exact = bench(sec, lambda: exact_linear.linear(x, w, None, 8))
                sec.metric(f"exact linear M=1 K={K} N={N}: time / fast's",
                           _ratio(t_exact, t_fast), "x")
            del src, dst


def gemm_4096(sec) -> None:
    """A training-pass GEMM (4096 rows) in fast numerics over torch.matmul (cuBLAS) in bf16 on
    the same operands: throughput ratio, target >= 0.60."""
    r, dev = Inputs(3), sec.device
    M = 4096 if not sec.dry else 8
    for K, N in (GEMM_SHAPES if not sec.dry else ((64, 40),)):
        x, w = r(M, K, dtype=BF16).to(dev), r(N, K, dtype=BF16, scale=K ** -0.5).to(dev)
        t_torch = bench(sec, lambda: torch.matmul(x, w.t()))
        t_fast = bench(sec, lambda: fl.linear(x, w, None, 8))
        ratio = _ratio(t_torch, t_fast)
        tflops = None if t_fast is None else 2 * M * N * K / t_fast / 1e9
        sec.metric(f"fast GEMM M={M} K={K} N={N}: throughput / torch.matmul's", ratio, "",
                   ">= 0.60", None if ratio is None else ratio >= 0.60,
                   note=f"fast {tflops and round(tflops)} TFLOP/s")


def exact_gemm(sec) -> None:
    """The exact linear (CUDA-core FMA chains, fp32) against SGEMM without TF32 (measured) and
    the fp32 datasheet peak."""
    r, dev = Inputs(4), sec.device
    M, K, N = (1024, 2048, 2048) if not sec.dry else (4, 32, 16)
    x, w = r(M, K).to(dev), r(N, K, scale=K ** -0.5).to(dev)
    flop = 2 * M * N * K
    t_exact = bench(sec, lambda: exact_linear.linear(x, w, None, 8))
    if not sec.dry:
        allow = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
    try:
        t_sgemm = bench(sec, lambda: torch.matmul(x, w.t()))
    finally:
        if not sec.dry:
            torch.backends.cuda.matmul.allow_tf32 = allow
    tf = None if t_exact is None else flop / t_exact / 1e9
    sec.metric(f"exact GEMM M={M} K={K} N={N}", tf, "TFLOP/s")
    sec.metric("exact / fp32 datasheet peak (67 TFLOP/s)", _ratio(tf, FP32_PEAK_TFLOPS))
    sec.metric("exact / SGEMM (no TF32) measured here", _ratio(t_sgemm, t_exact))


def _decode_runner(model, batch: int, prompt: int, steps: int):
    """A prefilled cache of `batch` sequences and a function running one decode step."""
    dev = model.embed_tokens.weight.device
    pages = PageAllocator(model.new_cache(batch, prompt + steps + 2))
    slots = [pages.add_sequence() for _ in range(batch)]
    ids = torch.randint(0, model.config.vocab_size, (batch * prompt,), device=dev)
    cu = torch.arange(0, batch * prompt + 1, prompt, device=dev)
    extend(model, pages, ids, slots, cu, logits_rows=cu[1:] - 1)
    step_ids = torch.randint(0, model.config.vocab_size, (batch,), device=dev)
    step_cu = torch.arange(batch + 1, device=dev)
    return lambda: extend(model, pages, step_ids, slots, step_cu)


def model_decode(sec) -> None:
    """One decode step (a token per sequence, KV cache on, logits of every row) of the
    30B-A3B-shaped model cut to 2 layers, bf16: fast numerics over torch mode, steps interleaved
    one for one, each timed by CUDA events; target <= 1.15x."""
    from tonp_models import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig.preset("qwen3_30b_a3b", num_hidden_layers=2) if not sec.dry else \
        Qwen3MoeConfig.preset("tiny", num_hidden_layers=2)
    torch.manual_seed(0)
    with torch.device(sec.device), torch.no_grad():
        model = Qwen3MoeForCausalLM(cfg, dtype=BF16)
    steps = 12 if not sec.dry else 1
    for batch in ((1, 16) if not sec.dry else (2,)):
        times = {"fast": [], "torch": []}
        with torch.no_grad():
            with numerics(sec, "fast"):
                fast = _decode_runner(model, batch, 128 if not sec.dry else 5, steps + 2)
            with tk.use("torch"):
                stock = _decode_runner(model, batch, 128 if not sec.dry else 5, steps + 2)
            for i in range(steps + 2):
                for name, run in (("fast", fast), ("torch", stock)):
                    ctx = numerics(sec, "fast") if name == "fast" else tk.use("torch")
                    with ctx:
                        times[name].append(_time_once(sec, run))
        if sec.dry:
            sec.metric(f"decode step batch {batch}: fast / torch mode", None, "x", "<= 1.15")
            continue
        med = {k: statistics.median(v[2:]) for k, v in times.items()}  # 2 warm-up steps
        ratio = med["fast"] / med["torch"]
        sec.metric(f"decode step batch {batch}: fast / torch mode", ratio, "x", "<= 1.15",
                   ratio <= 1.15, note=f"{med['fast']:.2f} vs {med['torch']:.2f} ms")


def moe_backward(sec) -> None:
    """The experts' backward of one 30B-A3B layer (128 experts, 256 tokens x 8 slots, bf16) as
    grouped Triton GEMMs (moe_grad.py, the op's device kernel) against the C++ op on the CPU
    (allclose: gradients are correct, not order-locked) and, timed, against device_grads'
    per-expert loop of torch matmuls on the same operands: target < 1x its time."""
    from tonp_kernels import device_grads as dg
    from tonp_kernels.accel import moe_grad
    r, dev = Inputs(6), sec.device
    E, H, I, M, K = (128, 2048, 768, 256, 8) if not sec.dry else (4, 32, 16, 6, 2)
    x, g = r(M, H, dtype=BF16), r(M, K, H, dtype=BF16)
    gu, dn = r(E, 2 * I, H, dtype=BF16, scale=H ** -0.5), r(E, H, I, dtype=BF16, scale=I ** -0.5)
    ids = torch.stack([torch.randperm(E, generator=r.g)[:K] for _ in range(M)])
    gub = torch.ops.tonp.moe_experts_train(x, ids, gu, dn, 0, 8)[1]
    args = [g, x, ids, gu, dn, gub]
    want = torch.ops.tonp.moe_experts_grad(*args, 0, 8, [True] * 3)
    dargs = [t.to(dev) for t in args] + [0, 8, [True] * 3]
    got = moe_grad.moe_experts_grad(*dargs)
    worst = max(float((a.cpu().double() - b.double()).abs().max() / b.double().abs().max())
                for a, b in zip(got, want))
    sec.check("grouped experts' backward vs the CPU op: max |diff| / max |grad| <= 2e-2", worst <= 2e-2,
              f"{worst:.2e}")
    t_grouped = bench(sec, lambda: moe_grad.moe_experts_grad(*dargs))
    t_loop = bench(sec, lambda: dg.moe_experts_grad(*dargs))
    ratio = _ratio(t_grouped, t_loop)
    sec.metric("experts' backward, grouped Triton: time / per-expert loop's", ratio, "x", "< 1",
               None if ratio is None else ratio < 1,
               note=f"{t_grouped and round(t_grouped, 2)} vs {t_loop and round(t_loop, 2)} ms")


def _time_once(sec, fn) -> float | None:
    if sec.dry:
        fn()
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


SWEEP = ((64, 128, 64, 8, 3), (64, 128, 64, 8, 4), (128, 64, 64, 8, 3), (64, 128, 128, 8, 3),
         (64, 64, 64, 4, 3))


def config_sweep(sec) -> None:
    """Other tile configs (BM, BN, BK, warps, stages) for a decode and a 4096-row GEMM, timed
    against the default: data for choosing the table, performance only (another config gives
    other fast-mode bits; any one config keeps every invariance)."""
    r, dev = Inputs(5), sec.device
    K, N = (2048, 5120) if not sec.dry else (64, 40)
    w = r(N, K, dtype=BF16, scale=K ** -0.5).to(dev)
    base = fl.linear_config(N, K, 8, BF16, BF16)
    for M in ((1, 4096) if not sec.dry else (1,)):
        x = r(M, K, dtype=BF16).to(dev)
        out = torch.empty(M, N, dtype=BF16, device=dev)
        ref = None
        for bm, bn, bk, warps, stages in SWEEP:
            if sec.left_s() < 8:
                sec.note("sweep stopped: section budget")
                return
            cfg = fl.LinearConfig(bm, bn, bk, warps, stages, base.levels, base.dot)
            try:
                t = bench(sec, lambda: fl.launch_fast_linear(x, w, None, out, 8, cfg=cfg))
            except Exception as e:  # noqa: BLE001 - a config that does not compile is data too
                sec.metric(f"M={M} {cfg}", None, note=f"{type(e).__name__}: {str(e)[:120]}")
                continue
            ref = ref or t
            sec.metric(f"M={M} BM{bm} BN{bn} BK{bk} w{warps} s{stages}: time / default's",
                       _ratio(t, ref), "x", note=f"{t and round(t * 1e3, 1)} us")
