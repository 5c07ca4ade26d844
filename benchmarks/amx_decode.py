"""What contract version 2 (CONTRACT.md, "Proposed version 2") would gain in batched decode, measured
with its AMX prototype on this CPU: speed only; the bits in force stay version 1's.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/amx_decode.py           # ~7 min; needs AMX-BF16
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/amx_decode.py --quick   # ~3 min
    .venv/bin/python benchmarks/amx_decode.py --smoke                     # tiny, checks the code runs

The GEMM table of amx_bench.py says what version 2 does to one linear; a decode step also streams
the experts' weights, which no arithmetic order changes. Three arms, in turn within each round:
  * v1 fused: the model as it runs (moe_experts on weight groups; every linear tonp's pair chains);
  * v1 per expert: the model's per-expert path (`fused_experts = False`: the same bits, a
    linear / silu_mul / linear call per expert in Python);
  * v2 AMX per expert: the same path with every bf16 x bf16 linear (attention projections,
    router, experts, LM head) on `amx_linear_blocks`, its weights packed once before the run.
v2 against v1 per expert compares the kernels under one loop; v2 against v1 fused is a floor for
what a fused version-2 op would give (it would drop the loop's overhead, which v1 per expert
against v1 fused shows).
1. The experts' stage: 128 cold experts of 30B-A3B shapes, 2-16 rows each (top-8 of random
   routing), each arm's time and the memory bound (the weights' bytes over the read bandwidth
   probed after the round).
2. The decode step: a 2-layer 30B-A3B-shaped bf16 model (vocab 16384), 64-token prompts, greedy:
   (generate of 17 tokens less generate of 1) over 16 steps, best of the rounds; tokens equal
   between the v1 arms (bit for bit: the per-expert path is the same arithmetic), and how many
   of batch row 0's logprobs v2 changes (its bits are new: a checkpoint's run record would have to
   carry the version).
Writes benchmarks/results/amx_decode{,_quick,_smoke}.{md,json}; on a CPU without AMX-BF16 says so and
writes nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tonp_kernels as tk  # noqa: E402
import tonp_kernels.amx as amx  # noqa: E402
from benchlib import RESULTS_DIR, busy_warning, fmt, fmt_ratio, log, machine_meta, md_table, write_record  # noqa: E402
from roofline import read_bandwidth_now  # noqa: E402
from tonp_models import Qwen3MoeConfig, Qwen3MoeForCausalLM, generate  # noqa: E402

CHUNKS = 8
ARMS = ("v1 fused", "v1 per expert", "v2 AMX per expert")


class V2Linears:
    """Every bf16 x bf16 `tk.linear` of the given weights on the AMX prototype while `on`: the
    weights packed once here (amx_pack_blocks), keyed by storage and shape. Others run as before."""

    def __init__(self, weights: List[torch.Tensor]):
        self.packed = {self._key(w): torch.ops.tonp.amx_pack_blocks(w, CHUNKS)
                       for w in weights if w.dtype == torch.bfloat16 and w.dim() == 2}
        self.on = False
        self.calls = 0  # linears run on the prototype
        self._linear = tk.linear

    @staticmethod
    def _key(w: torch.Tensor):
        return w.data_ptr(), tuple(w.shape), tuple(w.stride())

    def linear(self, x, w, b=None, *, chunks=tk.DEFAULT_CHUNKS, out_dtype=None, weight_groups=None):
        p = self.packed.get(self._key(w)) if self.on and b is None and chunks == CHUNKS else None
        if p is None or x.dtype != torch.bfloat16:
            return self._linear(x, w, b, chunks=chunks, out_dtype=out_dtype, weight_groups=weight_groups)
        self.calls += 1
        y = torch.ops.tonp.amx_linear_blocks(x.reshape(-1, x.shape[-1]), w, CHUNKS, p)
        return y.to(out_dtype or x.dtype).reshape(*x.shape[:-1], w.shape[0])

    @contextlib.contextmanager
    def installed(self):
        tk.linear = self.linear
        try:
            yield self
        finally:
            tk.linear = self._linear


def experts_stage(rows_list: List[int], rounds: int, gen: torch.Generator, E: int = 128) -> List[dict]:
    H, I, K = 2048, 768, 8
    gu = (torch.randn(E, 2 * I, H, generator=gen) * 0.02).bfloat16()
    dn = (torch.randn(E, H, I, generator=gen) * 0.02).bfloat16()
    gug, dng = tk.pack_weight_groups(gu, CHUNKS), tk.pack_weight_groups(dn, CHUNKS)
    gus, dns = gu.unbind(0), dn.unbind(0)
    pg = [torch.ops.tonp.amx_pack_blocks(w, CHUNKS) for w in gus]
    pd = [torch.ops.tonp.amx_pack_blocks(w, CHUNKS) for w in dns]
    weight_bytes = 3 * E * H * I * 2
    out = []
    for r in rows_list:
        M = max(1, r * E // K)
        x = torch.randn(M, H, generator=gen).bfloat16()
        ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(M)])
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True) // K
        counts = torch.bincount(flat, minlength=E).tolist()
        starts = [sum(counts[:e]) for e in range(E)]
        xs = [x.index_select(0, order[s:s + n]) for s, n in zip(starts, counts)]

        def loop(lin_gu: Callable, lin_dn: Callable):
            for e in range(E):
                if counts[e]:
                    g = lin_gu(e)
                    lin_dn(e, tk.silu_mul(g[:, :I].contiguous(), g[:, I:].contiguous()))

        fns = {
            "v1 fused": lambda: tk.moe_experts(x, ids, gu, dn, chunks=CHUNKS, gate_up_groups=gug, down_groups=dng),
            "v1 per expert": lambda: loop(lambda e: tk.linear(xs[e], gus[e], chunks=CHUNKS),
                                          lambda e, h: tk.linear(h, dns[e], chunks=CHUNKS)),
            "v2 AMX per expert": lambda: loop(
                lambda e: torch.ops.tonp.amx_linear_blocks(xs[e], gus[e], CHUNKS, pg[e]).bfloat16(),
                lambda e, h: torch.ops.tonp.amx_linear_blocks(h, dns[e], CHUNKS, pd[e])),
        }
        times: Dict[str, List[float]] = {a: [] for a in ARMS}
        bws = []
        with tk.use("invariant"):
            for f in fns.values():
                f()
            for _ in range(rounds):
                for a, f in fns.items():
                    t0 = time.perf_counter()
                    f()
                    times[a].append(time.perf_counter() - t0)
                bws.append(read_bandwidth_now())
        flop = M * K * 2 * 3 * H * I
        best = {a: min(v) for a, v in times.items()}
        bw = max(bws)
        out.append({"rows_per_expert": M * K / E, "tokens": M, "experts": E, "read_GBs": bw,
                    "bound_ms": weight_bytes / bw / 1e6,
                    "ms": {a: best[a] * 1e3 for a in ARMS},
                    "GFLOPs": {a: flop / best[a] / 1e9 for a in ARMS}})
        log(f"amx_decode: experts {r} rows: " + ", ".join(f"{a} {best[a] * 1e3:.1f} ms" for a in ARMS))
    return out


def same_tokens(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(torch.as_tensor(x), torch.as_tensor(y)) for x, y in zip(a, b))


def decode_steps(batches: List[int], rounds: int, layers: int, vocab: int, prompt_len: int,
                 gen: torch.Generator, tiny: bool) -> List[dict]:
    if tiny:
        cfg = Qwen3MoeConfig.preset("tiny", num_hidden_layers=1, bos_token_id=None, eos_token_id=None)
    else:
        cfg = Qwen3MoeConfig.preset("qwen3_30b_a3b", num_hidden_layers=layers, vocab_size=vocab,
                                    max_position_embeddings=4096, bos_token_id=None, eos_token_id=None)
    model = Qwen3MoeForCausalLM(cfg, dtype=torch.bfloat16).eval()
    weights = []
    for p in model.parameters():
        if p.dim() == 2:
            weights.append(p.detach())
        elif p.dim() == 3:  # experts: the per-expert path reads them unbound
            weights.extend(p.detach().unbind(0))
    v2 = V2Linears(weights)
    moes = [m for m in model.modules() if hasattr(m, "fused_experts")]
    new = 3 if tiny else 17

    def run(arm: str, prompts, n: int):
        v2.on = arm.startswith("v2")
        for m in moes:
            m.fused_experts = arm == "v1 fused"
        t0 = time.perf_counter()
        with tk.use("invariant"):
            res = generate(model, prompts, n, max_batch_size=len(prompts), weight_groups=True,
                           max_step_tokens=4096)
        return time.perf_counter() - t0, res

    out = []
    with v2.installed():
        for B in batches:
            prompts = [torch.randint(0, cfg.vocab_size, (prompt_len,), generator=gen).tolist()
                       for _ in range(B)]
            steps: Dict[str, List[float]] = {a: [] for a in ARMS}
            results = {}
            for a in ARMS:
                run(a, prompts, 2)
            v2.calls = 0
            run("v2 AMX per expert", prompts, 1)
            on_amx = v2.calls
            for _ in range(rounds):
                for a in ARMS:
                    t1, _ = run(a, prompts, 1)
                    tn, res = run(a, prompts, new)
                    steps[a].append((tn - t1) / (new - 1))
                    results[a] = res
            lp = {a: results[a].logprobs[0] for a in ARMS}
            best = {a: min(v) for a, v in steps.items()}
            out.append({"batch": B, "step_ms": {a: best[a] * 1e3 for a in ARMS},
                        "v1_arms_same_tokens": same_tokens(results["v1 fused"].completions,
                                                           results["v1 per expert"].completions),
                        "v1_arms_same_logprob_bits": bool(torch.equal(lp["v1 fused"].view(torch.int32),
                                                                      lp["v1 per expert"].view(torch.int32))),
                        "v2_logprobs_changed": int((lp["v2 AMX per expert"].view(torch.int32)
                                                    != lp["v1 fused"].view(torch.int32)).sum()),
                        "logprobs": len(lp["v1 fused"]), "v2_linears_in_prefill": on_amx,
                        "read_GBs": read_bandwidth_now()})
            log(f"amx_decode: batch {B}: " + ", ".join(f"{a} {best[a] * 1e3:.1f} ms" for a in ARMS))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds of a full run (--quick: 2, --smoke: 1)")
    ap.add_argument("--quick", action="store_true", help="rows 4, 8; batches 16, 64; 2 rounds")
    ap.add_argument("--smoke", action="store_true", help="tiny model, one round: checks the code runs")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {a.rounds}")
    meta = machine_meta()
    if not amx.available():
        print(f"amx_decode: this CPU ({meta['cpu']}) has no AMX-BF16 (or the process may not use it); "
              "nothing to measure")
        return 0
    gen = torch.Generator().manual_seed(0)
    rows = [2] if a.smoke else [4, 8] if a.quick else [2, 4, 8, 16]
    batches = [2] if a.smoke else [16, 64] if a.quick else [16, 64, 128]
    rounds = 1 if a.smoke else 2 if a.quick else a.rounds
    log("amx_decode: the experts' stage")
    exp = experts_stage(rows, rounds, gen, 16 if a.smoke else 128)
    log("amx_decode: decode steps")
    dec = decode_steps(batches, rounds, 2, 16384, 8 if a.smoke else 64, gen, a.smoke)
    exp_md = md_table(
        ["rows / expert", "memory bound", *[f"{x} ms" for x in ARMS], "v2 / v1 per expert", "v2 / v1 fused"],
        [[fmt(e["rows_per_expert"]), f"{fmt(e['bound_ms'])} ms ({fmt(e['read_GBs'])} GB/s)",
          *[f"{fmt(e['ms'][x])} ({fmt(e['GFLOPs'][x], 0)} GFLOP/s)" for x in ARMS],
          fmt_ratio(e["ms"]["v1 per expert"] / e["ms"]["v2 AMX per expert"]),
          fmt_ratio(e["ms"]["v1 fused"] / e["ms"]["v2 AMX per expert"])] for e in exp])
    dec_md = md_table(
        ["batch", *[f"{x} ms / step" for x in ARMS], "v2 / v1 per expert", "v2 / v1 fused",
         "v1 arms: same bits", "row 0 logprobs v2 changes", "linears on AMX (v2 prefill)"],
        [[d["batch"], *[fmt(d["step_ms"][x]) for x in ARMS],
          fmt_ratio(d["step_ms"]["v1 per expert"] / d["step_ms"]["v2 AMX per expert"]),
          fmt_ratio(d["step_ms"]["v1 fused"] / d["step_ms"]["v2 AMX per expert"]),
          "yes" if d["v1_arms_same_tokens"] and d["v1_arms_same_logprob_bits"] else "**no**",
          f"{d['v2_logprobs_changed']} of {d['logprobs']}", d["v2_linears_in_prefill"]] for d in dec])
    md = "\n\n".join(x for x in (
        f"# Version 2 in batched decode: the AMX prototype against version 1\n\n{meta['date']}; {meta['cpu']}; "
        f"kernel table **{meta['isa']}**; {meta['threads']} threads; torch {meta['torch']}."
        + (" Smoke run (tiny model)." if a.smoke else ""),
        busy_warning(meta),
        "Speed only: the contract in force is version 1; the prototype (`amx_linear_blocks`, "
        "weights pre-packed, no prefetching) gives version 2's bits (tests/test_amx.py). Arms in "
        "turn within each round, best of the rounds. 'v1 fused': the model as it runs; 'v1 per "
        "expert': its per-expert path (the same bits); 'v2 AMX per expert': that path with every "
        "bf16 x bf16 linear on the prototype. Ratios are speed (time of the first over the second).",
        f"## The experts' stage ({exp[0]['experts']} cold experts, 30B-A3B shapes, top-8 of random "
        "routing)\n\n" + exp_md,
        f"Memory bound: the {exp[0]['experts']} experts' weights over the read bandwidth probed after each round (the "
        "best probe).",
        "## The decode step (2 layers, vocab 16384, 64-token prompts, greedy)\n\n" + dec_md,
        "Step: (generate of 17 tokens less generate of 1) over 16 steps. 'same bits': tokens and "
        "row 0's logprobs of the two version-1 arms, bit for bit.",
    ) if x)
    stem = "amx_decode_smoke" if a.smoke else "amx_decode_quick" if a.quick else "amx_decode"
    paths = write_record(a.out, stem, md + "\n", {"meta": meta, "experts": exp, "decode": dec})
    print(md)
    log("amx_decode: wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
