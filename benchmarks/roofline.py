"""The machine's limits and what a Qwen3-MoE step must move or compute, to turn a measured rate
into a fraction of the bound that limits it.

    m = measure_machine("full")        # {"copy_GBs", "read_GBs", "gemm_fp32_GFLOPs", ...}
    b = decode_bytes(config, dtype_bytes=4, batch=1, context=64)      # bytes per decode step
    f = flops_per_token(config, context=256, training=False)          # forward FLOPs per token

Bounds:
  * decode is memory-bound: one step streams the ACTIVE weights once (attention, router, the
    top-k experts of every token, dense MLPs, the final norm and the LM head) plus the KV cache
    it reads; the bound is bytes / read bandwidth, measured by a read-only reduction
    (x.sum() or x.dot(x) over a tensor much larger than the caches). The copy bandwidth (bytes
    read + written by a large copy) is reported too.
  * prefill and training are compute-bound: FLOPs per token (2 per multiply-add of the active
    weights, plus attention over the causal context; training = 3x the forward) over the MKL fp32
    GEMM rate. bf16 is held to the same fp32 bound: CPUs without AVX512-BF16/AMX convert bf16 to
    fp32 and use fp32 FMAs, so bf16 only halves the bytes.
  * a batched decode step (`decode_step_bound`) is both: its ops run one after another, so its
    bound is the sum over op classes (dense linears, experts, attention's KV read, the rest) of
    each class's max(bytes / bandwidth, FLOPs / GEMM rate). At batch 64-128 the dense linears are
    compute-bound while the experts still stream; the max of the step's totals would let one
    hide under the other, which no sequential forward does.
The best (minimum-time) of a few repeats is the machine's limit; run_all measures at the start and
at the end of a run and keeps the best of both (`best_of`). A decode measurement also probes the
read bandwidth between its repeats (`read_bandwidth_now`): model_bench's bound uses the median
probe, decode_bench's the best one (a neighbour's load moves it by tens of percent).
"""
from __future__ import annotations

import torch

from benchlib import timeit

GEMM_N = 2048


SIZES = {  # MiB of the bandwidth tensors, GEMM size N, repeats
    "full": (512, GEMM_N, 7), "quick": (64, 1024, 3), "smoke": (16, 256, 1)}


def measure_machine(size: str = "full") -> dict:
    """Memory bandwidth (copy, read-only) and fp32 GEMM GFLOP/s of this process's threads: the
    faster of MKL's torch.mm and tonp's own backward GEMM (a linear_backward weight gradient; on
    AMD CPUs MKL takes its AVX2 path and tonp's AVX-512 GEMM outruns it, and a compute bound
    below a measured rate is no bound). size: "full" (512 MiB tensors, far beyond any CPU cache;
    2048^3 GEMM), "quick", "smoke"."""
    mib, N, repeat = SIZES[size]
    n = mib * 2 ** 20 // 4  # fp32 elements
    kw = dict(repeat=repeat, max_total_s=10 if size == "full" else 2, stat="min")
    t_copy, t_read = _bandwidth_times(n, kw)
    a, b = torch.randn(N, N), torch.randn(N, N)
    mkl = 2 * N ** 3 / timeit(lambda: torch.mm(a, b), **kw).seconds / 1e9
    import tonp_kernels  # noqa: F401  (registers torch.ops.tonp)
    own = 2 * N ** 3 / timeit(lambda: torch.ops.tonp.linear_backward(a, b, a, [False, True, False],
                                                                     None), **kw).seconds / 1e9
    return {"copy_GBs": 2 * n * 4 / t_copy / 1e9, "read_GBs": n * 4 / t_read / 1e9,
            "gemm_fp32_GFLOPs": max(mkl, own), "gemm_mkl_GFLOPs": mkl, "gemm_tonp_GFLOPs": own,
            "gemm_n": N, "bandwidth_bytes": n * 4}


def _bandwidth_times(n: int, kw: dict):
    """Seconds of a copy of n fp32 elements and of the faster read-only pass over them (a
    reduction or a dot product: both stream the tensor once)."""
    src, dst = torch.randn(n), torch.empty(n)
    t_copy = timeit(lambda: dst.copy_(src), **kw).seconds
    t_read = min(timeit(lambda: src.sum(), **kw).seconds,
                 timeit(lambda: torch.dot(src, src), **kw).seconds)
    return t_copy, t_read


_PROBE: dict = {}


def read_bandwidth_now(mib: int = 256) -> float:
    """GB/s of one read-only pass (x.sum()) over `mib` MiB, the better of two: a probe taken
    between the repeats of a decode measurement, so its bound sees the memory bus as the decode
    steps saw it (on a shared machine the bandwidth moves by tens of percent within a run)."""
    if _PROBE.get("mib") != mib:
        _PROBE.update(mib=mib, x=torch.ones(mib * 2 ** 20 // 4))
    x = _PROBE["x"]
    return x.numel() * 4 / timeit(lambda: x.sum(), repeat=2, stat="min").seconds / 1e9


def best_of(*measurements: dict) -> dict:
    """The machine's limit is the best it showed: the max of each rate over several measurements
    (a measurement taken while another process used the memory bus reads low)."""
    out = dict(measurements[0])
    for m in measurements[1:]:
        for k in ("copy_GBs", "read_GBs", "gemm_fp32_GFLOPs"):
            out[k] = max(out[k], m[k])
    out["measurements"] = [{k: m[k] for k in ("copy_GBs", "read_GBs", "gemm_fp32_GFLOPs")}
                           for m in measurements]
    return out


def _layer_counts(config):
    """Weights (elements) of one layer's attention, router and one expert; dense MLP per layer."""
    c = config
    H, D = c.hidden_size, c.head_dim
    attn = H * c.num_attention_heads * D * 2 + H * c.num_key_value_heads * D * 2 + 2 * D + 2 * H
    router = c.num_experts * H
    expert = 3 * c.moe_intermediate_size * H
    dense = 3 * c.intermediate_size * H
    return attn, router, expert, dense


def expected_distinct_experts(config, batch: int) -> float:
    """Experts a batch of `batch` tokens touches in one layer, if routing were uniform:
    E * (1 - (1 - k/E)^batch). Exactly k at batch 1."""
    E, k = config.num_experts, config.num_experts_per_tok
    if batch == 1:
        return float(k)
    return E * (1.0 - (1.0 - k / E) ** batch)


def active_weight_bytes(config, dtype_bytes: int, batch: int = 1) -> float:
    """Bytes of weights one decode step of `batch` sequences reads (each once): attention and
    norms, router + the touched experts (batch > 1: uniform-routing expectation) or the dense
    MLP per layer, the final norm, the LM head and `batch` embedding rows."""
    c = config
    attn, router, expert, dense = _layer_counts(c)
    total = 0.0
    for layer in range(c.num_hidden_layers):
        total += attn
        if c.is_sparse_layer(layer):
            total += router + expected_distinct_experts(c, batch) * expert
        else:
            total += dense
    total += c.hidden_size * (1 + c.vocab_size + batch)
    return total * dtype_bytes


def kv_bytes(config, dtype_bytes: int, batch: int, context: float) -> float:
    """Bytes of K and V a decode step reads: every layer, `batch` sequences of `context` keys."""
    c = config
    return 2 * c.num_hidden_layers * batch * context * c.num_key_value_heads * c.head_dim \
        * dtype_bytes


def decode_bytes(config, dtype_bytes: int, batch: int, context: float) -> float:
    return active_weight_bytes(config, dtype_bytes, batch) + kv_bytes(config, dtype_bytes,
                                                                       batch, context)


def decode_step_bound(config, dtype_bytes: int, batch: int, context: float, read_GBs: float,
                      gemm_GFLOPs: float, distinct_experts: float | None = None) -> dict:
    """A decode step's roofline, op class by op class. The step runs its ops one after another,
    so its bound is the sum of each class's own bound, max(bytes / read bandwidth, FLOPs / GEMM
    rate), not the max of the step's totals (which would let the experts' stream hide under the
    dense linears' arithmetic, as no sequential forward can). Classes (every layer):
      dense      attention q/k/v/o, the router, the LM head: each weight read once, 2 FLOPs per
                 weight per token (at one batch size every dense linear has the same intensity,
                 so one max over their sum is the sum of their maxes);
      experts    the touched experts' weights (distinct_experts per layer, measured; default the
                 uniform-routing expectation), 2 FLOPs per weight per routed row;
      attention  the KV read, 4 Hq D context FLOPs per token;
      other      norms, the embedding rows (bytes only).
    Returns {"parts": {class: {"bytes", "flops", "mem_s", "compute_s", "kind"}}, "bound_s",
    "kind" ("memory" / "compute" when every costly class agrees, else "mixed"),
    "coarse_bound_s" (max of the totals: the bound the table used before)}."""
    c = config
    attn, router, expert, dense = _layer_counts(c)
    H, D, L = c.hidden_size, c.head_dim, c.num_hidden_layers
    qkvo = H * c.num_attention_heads * D * 2 + H * c.num_key_value_heads * D * 2
    sparse = [c.is_sparse_layer(i) for i in range(L)]
    ns = sum(sparse)
    dense_w = L * qkvo + ns * router + (L - ns) * dense + c.vocab_size * H
    n_exp = expected_distinct_experts(c, batch) if distinct_experts is None else distinct_experts
    exp_w = ns * n_exp * expert
    parts = {
        "dense": (dense_w * dtype_bytes, 2.0 * batch * dense_w),
        "experts": (exp_w * dtype_bytes,
                    2.0 * batch * ns * c.num_experts_per_tok * expert),
        "attention": (kv_bytes(c, dtype_bytes, batch, context),
                      4.0 * batch * L * c.num_attention_heads * D * context),
        "other": ((L * (attn - qkvo) + H * (1 + batch)) * dtype_bytes, 0.0),
    }
    out, total = {}, 0.0
    for name, (nbytes, flops) in parts.items():
        mem_s, cmp_s = nbytes / (read_GBs * 1e9), flops / (gemm_GFLOPs * 1e9)
        out[name] = {"bytes": nbytes, "flops": flops, "mem_s": mem_s, "compute_s": cmp_s,
                     "kind": "memory" if mem_s >= cmp_s else "compute"}
        total += max(mem_s, cmp_s)
    kinds = {p["kind"] for n, p in out.items() if n in ("dense", "experts") and p["bytes"]}
    mem_all = sum(p["mem_s"] for p in out.values())
    cmp_all = sum(p["compute_s"] for p in out.values())
    return {"parts": out, "bound_s": total, "kind": kinds.pop() if len(kinds) == 1 else "mixed",
            "distinct_experts": n_exp, "coarse_bound_s": max(mem_all, cmp_all)}


def flops_per_token(config, context: float, training: bool = False) -> float:
    """FLOPs per token: 2 x the active matmul weights (q/k/v/o, router, top-k experts or the
    dense MLP, LM head) + attention 4 * Hq * D * context per layer (QK^T and PV; context = the
    mean number of keys a query sees, (L + 1) / 2 for a causal sequence of L). Training = 3x."""
    c = config
    H, D = c.hidden_size, c.head_dim
    attn_w = H * c.num_attention_heads * D * 2 + H * c.num_key_value_heads * D * 2
    per_layer = 0.0
    for layer in range(c.num_hidden_layers):
        mm = attn_w
        if c.is_sparse_layer(layer):
            mm += c.num_experts * H + c.num_experts_per_tok * 3 * c.moe_intermediate_size * H
        else:
            mm += 3 * c.intermediate_size * H
        per_layer += 2 * mm + 4 * c.num_attention_heads * D * context
    fwd = per_layer + 2 * c.vocab_size * H
    return 3 * fwd if training else fwd


def decode_bound_tok_s(config, read_GBs: float, dtype_bytes: int, batch: int,
                       context: float) -> float:
    """Decode tokens/s if a step took exactly its bytes over the read bandwidth."""
    step_s = decode_bytes(config, dtype_bytes, batch, context) / (read_GBs * 1e9)
    return batch / step_s


def compute_bound_tok_s(config, machine: dict, context: float, training: bool) -> float:
    """Tokens/s if every FLOP ran at the measured MKL fp32 GEMM rate."""
    return machine["gemm_fp32_GFLOPs"] * 1e9 / flops_per_token(config, context, training)


if __name__ == "__main__":
    import json
    print(json.dumps(measure_machine("quick"), indent=1))
