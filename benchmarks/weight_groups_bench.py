"""The bf16 experts' weight column groups (layers/moe.py, kernels.h kGroupCols) in the decode step:
the same 30B-A3B-shaped bf16 model and prompts as decode_bench.py, decoded by tonp with the
engine's weight groups and without (weight_groups=False: every expert read in place), the two
alternated round by round in one process, the read bandwidth probed around each round.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/weight_groups_bench.py       # ~3 min
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/weight_groups_bench.py --smoke

Per batch: each variant's median decode step (best round), their ratio (in place / groups: > 1
is a gain), the probes of the two reported rounds (a ratio of rounds on buses more than 20%
apart is marked *), whether the two variants' logprobs are bitwise equal (torch.equal: they must
be), and the bytes the groups hold. Only the AVX512-BF16 build reads groups; elsewhere both
variants are the in-place kernels and the report says so. Writes
benchmarks/results/weight_groups{,_smoke}.{md,json}.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import roofline  # noqa: E402
from benchlib import RESULTS_DIR, log, machine_meta, md_table, write_results  # noqa: E402
from decode_bench import make_config, tonp_run  # noqa: E402

import tonp_kernels as tk  # noqa: E402
from tonp_models import Qwen3MoeForCausalLM  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=3)
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
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg, dtype=torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    all_prompts = torch.randint(0, cfg.vocab_size, (max(batches), a.prompt_len), generator=g)
    log(f"weight_groups_bench: {meta['cpu']}, isa {meta['isa']}, {meta['threads']} threads")
    tonp_run(model, all_prompts[:1].tolist(), 2)                  # packs the groups once
    held = sum(m.weight_group_bytes() for m in model.modules() if hasattr(m, "weight_group_bytes"))
    rows, results = [], []
    for b in batches:
        prompts = all_prompts[:b].tolist()
        best = {True: None, False: None}
        for _ in range(a.rounds):
            for on in (True, False):
                before = roofline.read_bandwidth_now(mib)
                t = tonp_run(model, prompts, a.new, weight_groups=on)
                t["probes"] = [before, roofline.read_bandwidth_now(mib)]
                if best[on] is None or t["step_s"] < best[on]["step_s"]:
                    best[on] = t
        on, off = best[True], best[False]
        same = torch.equal(on["logprobs0"], off["logprobs0"])
        ratio = off["step_s"] / on["step_s"]
        r = {"batch": b, "groups_step_s": on["step_s"], "in_place_step_s": off["step_s"],
             "ratio": ratio, "groups_probes": on["probes"], "in_place_probes": off["probes"],
             "same_bits": same}
        results.append(r)
        p_on, p_off = max(on["probes"]), max(off["probes"])
        mark = "*" if max(p_on, p_off) > 1.2 * min(p_on, p_off) else ""
        rows.append([str(b), f"{1e3 * off['step_s']:.1f}", f"{1e3 * on['step_s']:.1f}",
                     f"{ratio:.2f}x{mark}",
                     "/".join(f"{x:.0f}" for x in off["probes"]),
                     "/".join(f"{x:.0f}" for x in on["probes"]), "yes" if same else "**NO**"])
        log(f"  batch {b}: in place {1e3 * off['step_s']:.1f} ms, groups "
            f"{1e3 * on['step_s']:.1f} ms, {ratio:.2f}x, same bits {same}")
    reads = tk.isa() == "avx512bf16"
    md = [f"# Weight column groups in the bf16 decode step ({'smoke' if a.smoke else 'full'})", "",
          f"{meta['cpu']}, kernel table **{meta['isa']}**, {meta['threads']} threads; "
          + ("the tiny 1-layer model" if a.smoke else
             f"{a.layers}-layer 30B-A3B-shaped bf16 model") + f", vocab {cfg.vocab_size}, "
          f"{a.prompt_len}-token prompts, {a.new} greedy tokens, best of {a.rounds} rounds "
          f"(the variants alternated). Groups held: {held / 2**20:.2f} MiB."
          + ("" if reads else " This table reads no groups: both columns are the in-place "
             "kernels."), "",
          md_table(["batch", "in place ms/step", "groups ms/step", "in place / groups",
                    "probes in place GB/s", "probes groups GB/s", "same bits"], rows), "",
          "* the two reported rounds' best probes differ by more than 20%."]
    data = {"meta": meta, "config": cfg.__dict__, "held_bytes": held, "results": results}
    write_results(a.out, "weight_groups_smoke" if a.smoke else "weight_groups", "\n".join(md) + "\n",
                  data)
    return data


if __name__ == "__main__":
    main()
