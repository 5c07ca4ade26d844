"""The experts' weight column groups (layers/moe.py, kernels.h) in the decode step: the
same 30B-A3B-shaped model (bf16 and fp32) and prompts as decode_bench.py, decoded by tonp with the
engine's weight groups and without (weight_groups=False: every expert read in place), the two
alternated round by round in one process, the read bandwidth probed around each round.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/weight_groups_bench.py       # ~12 min
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/weight_groups_bench.py --smoke

Per dtype, batch and bus state (rounds grouped by the read probes around them): the ratio of the two
variants' median decode steps round by round (in place / groups: > 1 is a gain), whether their
logprobs are bitwise equal (torch.equal: they must be), and the bytes the groups hold. Only the AVX512-BF16 build reads groups; elsewhere both
variants are the in-place kernels and the report says so. Writes
benchmarks/results/weight_groups{,_smoke}.{md,json}.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import roofline  # noqa: E402
from benchlib import RESULTS_DIR, log, machine_meta, md_table, write_results  # noqa: E402
from decode_bench import DTYPES, make_config, tonp_run  # noqa: E402

import tonp_kernels as tk  # noqa: E402
from tonp_models import Qwen3MoeForCausalLM  # noqa: E402


FAST = 45.0   # GB/s: a probe at or above it saw this VM's fast bus state


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    a = parse_args(argv)
    batches = [int(b) for b in a.batches.split(",")]
    if a.smoke:
        batches, a.new, a.prompt_len, a.rounds = [1, 4], 4, 8, 1
    cfg = make_config(a)
    meta = machine_meta()
    mib = 64 if a.smoke else 256
    g = torch.Generator().manual_seed(0)
    all_prompts = torch.randint(0, cfg.vocab_size, (max(batches), a.prompt_len), generator=g)
    log(f"weight_groups_bench: {meta['cpu']}, isa {meta['isa']}, {meta['threads']} threads")
    rows, results, held = [], [], {}
    for dname, b in [(d, b) for d in a.dtypes.split(",") for b in batches]:
        if b == batches[0]:
            model = None
            torch.manual_seed(0)
            model = Qwen3MoeForCausalLM(cfg, dtype=DTYPES[dname]).eval()
            tonp_run(model, all_prompts[:1].tolist(), 2)                  # packs the groups once
            held[dname] = sum(m.weight_group_bytes() for m in model.modules()
                              if hasattr(m, "weight_group_bytes"))
        prompts = all_prompts[:b].tolist()
        pairs = []   # one round: both variants back to back (order alternating), their probes
        for k in range(a.rounds):
            rnd = {}
            for on in ((True, False) if k % 2 == 0 else (False, True)):
                before = roofline.read_bandwidth_now(mib)
                t = tonp_run(model, prompts, a.new, weight_groups=on)
                t["probes"] = [before, roofline.read_bandwidth_now(mib)]
                rnd[on] = t
            pairs.append(rnd)
        same = all(torch.equal(p[True]["logprobs0"], p[False]["logprobs0"]) for p in pairs)
        r = {"dtype": dname, "batch": b, "same_bits": same, "rounds": [
            {"groups_step_s": p[True]["step_s"], "in_place_step_s": p[False]["step_s"],
             "ratio": p[False]["step_s"] / p[True]["step_s"],
             "probes": p[True]["probes"] + p[False]["probes"]} for p in pairs]}
        results.append(r)
        for state, sel in (("fast", lambda v: min(v) >= FAST), ("slow", lambda v: max(v) < FAST),
                           ("mixed", lambda v: min(v) < FAST <= max(v))):
            rs = [x for x in r["rounds"] if sel(x["probes"])]
            if not rs:
                continue
            ratios = sorted(x["ratio"] for x in rs)
            rows.append([dname, str(b), state, str(len(rs)),
                         f"{1e3 * min(x['in_place_step_s'] for x in rs):.1f}",
                         f"{1e3 * min(x['groups_step_s'] for x in rs):.1f}",
                         f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})",
                         "/".join(f"{v:.0f}" for v in (min(min(x['probes']) for x in rs),
                                                       max(max(x['probes']) for x in rs))),
                         "yes" if same else "**NO**"])
            log(f"  {dname} batch {b}, {state} bus: {len(rs)} rounds, in place / groups "
                f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})")
        log(f"  {dname} batch {b}: same bits {same}")
    reads = tk.isa() == "avx512bf16"
    md = [f"# Weight column groups in the decode step ({'smoke' if a.smoke else 'full'})", "",
          f"{meta['cpu']}, kernel table **{meta['isa']}**, {meta['threads']} threads; "
          + ("the tiny 1-layer model" if a.smoke else
             f"{a.layers}-layer 30B-A3B-shaped model") + f", vocab {cfg.vocab_size}, "
          f"{a.prompt_len}-token prompts, {a.new} greedy tokens, {a.rounds} rounds. Groups held: "
          + ", ".join(f"{d} {v / 2**20:.2f} MiB" for d, v in held.items()) + "."
          + ("" if reads else " This table reads no groups: both columns are the in-place "
             "kernels."), "",
          md_table(["dtype", "batch", "bus", "rounds", "in place ms/step (best)", "groups ms/step (best)",
                    "in place / groups: median (range)", "probes GB/s (min/max)", "same bits"],
                   rows), "",
          f"A round runs both variants back to back (their order alternating) with the read "
          f"bandwidth probed before and after each; its ratio is of its two median decode steps. "
          f"Rounds are grouped by the bus they saw: fast where all four probes read >= {FAST} "
          f"GB/s, slow where all read less, mixed otherwise (this VM's bus moves between about "
          f"33 and 65 GB/s)."]
    data = {"meta": meta, "config": cfg.__dict__, "held_bytes": held, "results": results}
    write_results(a.out, "weight_groups_smoke" if a.smoke else "weight_groups", "\n".join(md) + "\n",
                  data)
    return data


if __name__ == "__main__":
    main()
