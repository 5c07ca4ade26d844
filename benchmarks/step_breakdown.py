"""Where a decode step's time goes, op class by op class (decode_bench.py's second table): one
profiled generate less a 1-token generate of the same prompts, so the prefill cancels, over the
steps after the first token. The classes are roofline.decode_step_bound's, each against its own
bound (the caller's), with the rates it reached."""
from __future__ import annotations

from typing import Callable, List, Optional

import roofline
from benchlib import md_table

# The tonp ops of each op class of roofline.decode_step_bound (the router and the LM head are
# tonp::linear calls, dense like the attention projections); everything else in the forward
# (norms, RoPE, routing, combine, embedding, sampling, torch glue) is "rest".
CLASS_OPS = {"tonp::moe_experts": "experts", "tonp::linear": "dense", "tonp::attention_paged": "attention"}


def _class_times(fn):
    """fn()'s result and the wall time (s) its calls of each class's ops took (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()
    got = dict.fromkeys(CLASS_OPS.values(), 0.0)
    for e in prof.key_averages():
        if e.key in CLASS_OPS:
            got[CLASS_OPS[e.key]] += e.cpu_time_total / 1e6
    return out, got


def step_breakdown(run: Callable[[int], dict], new: int, mib: int) -> dict:
    """run(n): one generate of n new tokens, returning its "wall_s" and "overhead_s" (the
    engine's median time a step outside the forward; decode_bench.tonp_run). The classes' time a
    step: run(new)'s less run(1)'s, over the new - 1 steps after the first token. 'rest' is the
    step's forward less the classes' ops; the engine's time outside the forward is apart. The
    read bandwidth is probed just before and just after, for each class's own bound.
    "profiled_s": each class's total in run(new), which any profiled op makes positive. (The
    profiler adds ~1-2 us an op.)"""
    before = roofline.read_bandwidth_now(mib)
    full, t_full = _class_times(lambda: run(new))
    one, t_one = _class_times(lambda: run(1))
    after = roofline.read_bandwidth_now(mib)
    steps = new - 1
    step_s = (full["wall_s"] - one["wall_s"]) / steps
    classes = {c: (t_full[c] - t_one[c]) / steps for c in t_full}
    classes["rest"] = step_s - full["overhead_s"] - sum(classes.values())
    return {"step_s": step_s, "classes_s": classes, "overhead_s": full["overhead_s"],
            "read_GBs": [before, after], "profiled_s": t_full}


def breakdown_cell(measured_s: float, part: Optional[dict]) -> str:
    """'12.3 ms, 81% of memory bound (24 GB/s, 130 GFLOP/s)' for one class of one step (part:
    its roofline; None: the time alone)."""
    if part is None or not (part["bytes"] or part["flops"]) or measured_s <= 0:
        return f"{1e3 * measured_s:.1f} ms"
    own = max(part["mem_s"], part["compute_s"])
    rates = [f"{part['bytes'] / measured_s / 1e9:.0f} GB/s"]
    if part["flops"]:
        rates.append(f"{part['flops'] / measured_s / 1e9:.0f} GFLOP/s")
    return (f"{1e3 * measured_s:.1f} ms, {100 * own / measured_s:.0f}% of {part['kind']} bound "
            f"({', '.join(rates)})")


def breakdown_section(rows: List[list]) -> str:
    """The report's section: one row per (dtype, batch) of breakdown cells."""
    return ("\n## Where a decode step's time goes\n\nOne profiled generate of each batch after "
            "its timed rounds, less a 1-token generate of the same prompts, over the steps after "
            "the first token (torch.profiler's wall time of each class's ops: `tonp::moe_experts`; "
            "`tonp::linear`, the attention projections, routers and LM head; "
            "`tonp::attention_paged`). Each class against its own bound (the larger of its "
            "bytes over the read bandwidth probed around this pass and its FLOPs over the "
            "dtype's GEMM rate), and the rates it reached. 'rest': the forward's other ops "
            "(norms, RoPE, routing, combine, sampling, torch glue); 'engine': the step outside "
            "the forward.\n\n"
            + md_table(["dtype", "batch", "step", "experts", "dense linears", "attention",
                        "rest", "engine", "read GB/s before / after"], rows) + "\n")
