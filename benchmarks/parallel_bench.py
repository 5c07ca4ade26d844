"""Pipeline and context parallelism against PP = 1 / CP = 1 at the same world size.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/parallel_bench.py [--quick | --smoke]

Spawns one gloo world of 2 CPU ranks (one thread each) and times, in the same run, contenders
taking turns within every repeat (a burst of load hits them alike; each time is the slowest
rank's, after a barrier):
* training step (forward_backward + nothing else) of one global batch: PP 2 with the 1F1B
  schedule over M micro-batches against PP 1 x DP 2 (each rank half the batch, one
  micro-batch, the DP gradient average); the bubble is the fraction of the step a rank waits
  for its neighbour (measured) next to 1F1B's (P - 1) / (M + P - 1);
* rollout (generate): PP 2 with 2 micro-batches in flight against PP 2 with 1 (the stages
  take turns) and against PP 1 x DP 2;
* forward of one long sequence (token_logprobs): CP 2 against CP 1 (each rank the whole).
Writes benchmarks/results/parallel.md and .json; `make bench` runs it (run_all.py).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings, when run as a script

from benchlib import RESULTS_DIR, fmt_ratio, log, md_table, write_results  # noqa: E402

SIZES = {"smoke": dict(hidden=64, layers=2, seqs=4, seq_len=16, cp_len=64, repeat=1,
                       micro=(2,), new_tokens=2, prompts=4),
         "quick": dict(hidden=128, layers=4, seqs=8, seq_len=64, cp_len=2048, repeat=3,
                       micro=(2, 4, 8), new_tokens=8, prompts=64),
         "full": dict(hidden=256, layers=8, seqs=16, seq_len=128, cp_len=4096, repeat=5,
                      micro=(2, 4, 8, 16), new_tokens=16, prompts=128)}


def _config(size):
    from tonp_models import Qwen3MoeConfig
    h = size["hidden"]
    return Qwen3MoeConfig.preset("tiny", hidden_size=h, num_hidden_layers=size["layers"],
                                 intermediate_size=2 * h, moe_intermediate_size=h // 2,
                                 num_attention_heads=4, head_dim=h // 4,
                                 max_position_embeddings=max(4096, size["cp_len"]))


def _model(size, **layout):
    import tonp_parallel as tpar
    from tonp_models import Qwen3MoeForCausalLM
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(_config(size), groups=tpar.init_parallel(**layout, timeout=600))


def _timed(fns, repeat):
    """{name: (median slowest-rank seconds, its samples, extra)} with the contenders in turn."""
    samples = {n: [] for n in fns}
    extra = {n: [] for n in fns}
    for n, fn in fns.items():                                  # warm-up
        fn()
    for _ in range(repeat):
        for n, fn in fns.items():
            dist.barrier()
            t0 = time.perf_counter()
            x = fn()
            t = torch.tensor([time.perf_counter() - t0, float(x or 0)], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            samples[n].append(float(t[0]))
            extra[n].append(float(t[1]))
    return {n: (statistics.median(s), s, statistics.median(extra[n])) for n, s in samples.items()}


def _bench_rank(size):
    g = torch.Generator().manual_seed(0)
    V = 320
    seqs = [torch.randint(0, V, (size["seq_len"],), generator=g) for _ in range(size["seqs"])]
    n = sum(len(s) - 1 for s in seqs)
    pp, dp = _model(size, pp=2), _model(size)
    rank = dist.get_rank()

    def loss(lps, index):
        return -torch.cat(lps).sum() / n

    def step_pp(m):
        def run():
            pp.zero_grad(set_to_none=True)
            return pp.forward_backward(seqs, loss, micro_batches=m).wait_s
        return run

    def step_dp():
        dp.zero_grad(set_to_none=True)
        mine = seqs[rank::2]
        dp.forward_backward(mine, loss, micro_batches=1)
        grads = [p.grad for p in dp.parameters() if p.grad is not None]
        flat = torch.cat([gr.reshape(-1) for gr in grads])      # the DP gradient sum, once
        dist.all_reduce(flat)
        return 0.0

    fns = {f"PP 2, 1F1B, M={m}": step_pp(m) for m in size["micro"]}
    fns["PP 1 x DP 2"] = step_dp
    train = _timed(fns, size["repeat"])

    from tonp_models import generate
    prompts = [torch.randint(0, V, (16,), generator=g) for _ in range(size["prompts"])]

    def roll(model, chunks, mine):
        def run():
            model.pipeline_micro_batches = chunks
            generate(model, mine, size["new_tokens"])
        return run
    decode = _timed({"PP 2, 2 micro-batches in flight": roll(pp, 2, prompts),
                     "PP 2, 1 micro-batch": roll(pp, 1, prompts),
                     "PP 1 x DP 2": roll(dp, 1, prompts[rank::2])}, size["repeat"])
    del pp
    cp = _model(size, cp=2)
    long = [torch.randint(0, V, (size["cp_len"],), generator=g)]

    def score(model):
        def run():
            with torch.no_grad():
                model.token_logprobs(long)
        return run
    context = _timed({"CP 2": score(cp), "CP 1 (each rank all tokens)": score(dp)},
                     size["repeat"])
    return dict(train=train, decode=decode, context=context,
                loads=os.getloadavg())


def _spread(samples):
    return f"{min(samples) * 1e3:.0f}-{max(samples) * 1e3:.0f}"


def report(mode, size, res, load_before, seconds):
    tokens = size["seqs"] * size["seq_len"]
    base = res["train"]["PP 1 x DP 2"][0]
    rows = []
    for name, (t, s, wait) in res["train"].items():
        m = int(name.split("M=")[1]) if "M=" in name else None
        theory = f"{(2 - 1) / (m + 2 - 1):.2f}" if m else "-"
        rows.append((name, f"{t * 1e3:.0f}", _spread(s), f"{tokens / t:,.0f}", fmt_ratio(t / base),
                     f"{wait / t:.2f}" if m else "-", theory))
    train = md_table(("training step", "ms (median)", "range ms", "tokens/s", "time vs PP 1",
                      "bubble measured", "1F1B bubble"), rows)
    dbase = res["decode"]["PP 1 x DP 2"][0]
    new = size["prompts"] * size["new_tokens"]
    decode = md_table(("rollout", "ms (median)", "range ms", "new tok/s", "time vs PP 1"),
                      [(n, f"{t * 1e3:.0f}", _spread(s), f"{new / t:,.0f}", fmt_ratio(t / dbase))
                       for n, (t, s, _) in res["decode"].items()])
    cbase = res["context"]["CP 1 (each rank all tokens)"][0]
    context = md_table(("forward of one sequence", "ms (median)", "range ms", "time vs CP 1"),
                       [(n, f"{t * 1e3:.0f}", _spread(s), fmt_ratio(t / cbase))
                        for n, (t, s, _) in res["context"].items()])
    spread = max(max(s) / min(s) for part in res.values() if isinstance(part, dict)
                 for _, s, _ in part.values())
    return "\n".join([
        f"# Pipeline and context parallelism ({mode}, {time.strftime('%Y-%m-%d %H:%M')})", "",
        f"2 gloo ranks on this machine ({os.cpu_count()} cores), one thread each; model: tiny "
        f"preset at hidden {size['hidden']}, {size['layers']} layers; global batch "
        f"{size['seqs']} x {size['seq_len']} tokens; contenders in turn, {size['repeat']} "
        f"repeats, each the slowest rank's time. Load average {load_before:.1f} before, "
        f"{res['loads'][0]:.1f} at the end; the slowest repeat of a contender was up to "
        f"{spread:.1f}x its fastest (how noisy the machine was). Run took {seconds:.0f} s.", "",
        "## Training step: PP 2 (1F1B) against PP 1 x DP 2", "", train, "",
        "The bubble column is the fraction of the step the slowest rank spent waiting in "
        "pipeline receives (bubble and transfers).", "",
        f"## Rollout (generate, {size['prompts']} prompts of 16 tokens, "
        f"{size['new_tokens']} new): micro-batches in flight", "", decode, "",
        f"## Forward of one {size['cp_len']}-token sequence: CP 2 against CP 1", "", context, ""])


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat (tests)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    from tonp_parallel.launch import run_distributed
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    size = SIZES[mode]
    load, t0 = os.getloadavg()[0], time.perf_counter()
    log(f"parallel_bench ({mode}): 2 ranks")
    res = run_distributed(_bench_rank, 2, size, timeout=1800)[0]
    md = report(mode, size, res, load, time.perf_counter() - t0)
    stem = "parallel" if mode != "smoke" else "parallel_smoke"
    paths = write_results(args.out, stem, md, {"mode": mode, "size": size, **res})
    print(md)
    log("wrote " + ", ".join(str(p) for p in paths))
    return md


if __name__ == "__main__":
    main()
