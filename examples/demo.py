"""The true-on-policy demo (`make demo`): rollout logprobs vs training logprobs, bit for bit.

    python examples/demo.py                      # embedded tiny model, random weights (seed 0)
    python examples/demo.py --dtype bf16 --prompts 32 --temperature 0.8
    python examples/demo.py --hf path/to/qwen3_moe_checkpoint

For each dtype and kernel mode ("torch" = stock PyTorch ops, "invariant" = tonp's kernels) it
rolls out ragged prompts with the generator (continuous batching, paged KV cache, seeded
sampling), scores the same sequences with the training forward in another arrangement
(reversed order, padded micro-batches of another size), and compares every generated token's
two logprobs. The layout row scores the invariant rollout with the training forward at TP=2, in
two local processes it spawns itself. It prints a table and plots |Δlogp| per position under
out/. Exit status 1 if an invariant row shows any difference.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Dict, List

import torch

import tonp_kernels as tk
import tonp_parallel as tpar
from tonp_models import Qwen3MoeConfig, Qwen3MoeForCausalLM, generate
from tonp_parallel.launch import run_distributed

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hf", metavar="PATH", help="load an HF Qwen3-MoE checkpoint directory "
                   "instead of the embedded tiny model")
    p.add_argument("--preset", default="tiny", help="config preset of the random-weight model")
    p.add_argument("--weights-seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--init-std", type=float, default=None, help="std of the random weights "
                   "(default: the config's initializer_range)")
    p.add_argument("--dtype", default="fp32,bf16", help="parameter dtypes, comma-separated")
    p.add_argument("--prompts", type=int, default=16, help="number of prompts")
    p.add_argument("--min-len", type=int, default=4, help="shortest prompt (tokens)")
    p.add_argument("--max-len", type=int, default=80, help="longest prompt (tokens)")
    p.add_argument("--new-tokens", type=int, default=48, help="max new tokens per prompt")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=1234, help="prompt and sampling seed")
    p.add_argument("--max-batch-size", type=int, default=5,
                   help="rollout slots (fewer than --prompts: continuous batching)")
    p.add_argument("--micro-batch", type=int, default=3, help="training micro-batch size")
    p.add_argument("--modes", default="torch,invariant", help="kernel modes to compare")
    p.add_argument("--layout-tp", type=int, default=2, help="TP degree of the layout row, "
                   "scored in that many local processes (0 = no layout row)")
    p.add_argument("--layout-timeout", type=float, default=300.0,
                   help="seconds the layout row's processes may take")
    p.add_argument("--out", default="out/demo_logdiff.png", help="where to save the plot")
    args = p.parse_args(argv)
    args.dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    bad = [d for d in args.dtypes if d not in DTYPES]
    if bad or not args.dtypes:
        p.error(f"--dtype: {args.dtype!r}: each must be one of {sorted(DTYPES)}")
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.mode_list or any(m not in tk.MODES for m in args.mode_list):
        p.error(f"--modes: {args.modes!r}: each must be one of {list(tk.MODES)}")
    if not 1 <= args.min_len <= args.max_len:
        p.error(f"need 1 <= --min-len <= --max-len, got {args.min_len}, {args.max_len}")
    if args.layout_tp < 0 or args.layout_timeout <= 0:
        p.error("--layout-tp must be >= 0 and --layout-timeout > 0")
    return args


def build_model(args, dtype: torch.dtype) -> Qwen3MoeForCausalLM:
    if args.hf:
        return Qwen3MoeForCausalLM.from_pretrained(args.hf, dtype=dtype).eval()
    torch.manual_seed(args.weights_seed)
    config = Qwen3MoeConfig.preset(args.preset)
    if args.init_std is not None:
        config.initializer_range = args.init_std
    return Qwen3MoeForCausalLM(config, dtype=dtype).eval()


def make_prompts(args, vocab_size: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(args.seed)
    lens = torch.randint(args.min_len, args.max_len + 1, (args.prompts,), generator=g)
    top = min(vocab_size, 256)  # byte-like ids: no special tokens inside prompts
    return [torch.randint(0, top, (int(n),), generator=g) for n in lens]


def score(model, sequences, args) -> List[torch.Tensor]:
    """The training forward's logprobs, arranged unlike the rollout: reversed order, padded
    micro-batches of --micro-batch."""
    order = list(range(len(sequences)))[::-1]
    with torch.no_grad():
        scored = model.token_logprobs([sequences[i] for i in order],
                                      temperature=args.temperature or 1.0,
                                      micro_batch_size=args.micro_batch, packed=False)
    out = [None] * len(sequences)
    for i, lp in zip(order, scored):
        out[i] = lp
    return out


def summarize(out, train: List[torch.Tensor], score_s: float, **labels) -> Dict:
    """|Δlogp| of every generated token and the table's numbers."""
    diffs = [(train[i][p - 1:] - out.logprobs[i]).abs() for i, p in enumerate(out.prompt_lengths)]
    flat = torch.cat(diffs)
    return dict(**labels, diffs=diffs, tokens=flat.numel(), differ=int((flat != 0).sum()),
                max=float(flat.max()), mean=float(flat.mean()),
                rollout_tps=out.stats.new_tokens / out.stats.seconds,
                score_tps=sum(len(s) for s in out.sequences) / score_s, out=out)


def run_mode(model, prompts, args, mode: str, dtype: str) -> Dict:
    """Roll out and score in one kernel mode, in this process."""
    with tk.use(mode):
        out = generate(model, prompts, args.new_tokens, eos_token_id=model.config.eos_token_id,
                       temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                       seed=args.seed, max_batch_size=args.max_batch_size)
        start = time.perf_counter()
        train = score(model, out.sequences, args)
    return summarize(out, train, time.perf_counter() - start, mode=mode, dtype=dtype,
                     layout="1 process")


def _score_rank(model_dir: str, dtype: str, sequences, args):
    """One rank of the layout row: its TP shard of the checkpoint, the training forward."""
    groups = tpar.init_parallel(tp=args.layout_tp)
    model = Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype], groups=groups)
    with tk.use("invariant"):
        start = time.perf_counter()
        train = score(model.eval(), sequences, args)
    return train, time.perf_counter() - start


def run_layout(model, base: Dict, args) -> Dict:
    """Score the invariant rollout `base` with the training forward at TP = --layout-tp."""
    tp = args.layout_tp
    tpar.validate_model_layout(model.config, tp=tp)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        train, score_s = run_distributed(_score_rank, tp, tmp, base["dtype"],
                                         base["out"].sequences, args,
                                         timeout=args.layout_timeout)[0]
    return summarize(base["out"], train, score_s, mode="invariant", dtype=base["dtype"],
                     layout=f"TP={tp}, {tp} procs")


def print_table(results: List[Dict]) -> None:
    head = (f"{'mode':<10} {'dtype':<5} {'training forward':<17} {'tokens':>7} {'differ':>7} "
            f"{'max |Δlogp|':>12} {'mean |Δlogp|':>13} {'rollout tok/s':>14} "
            f"{'scoring tok/s':>14}")
    print(head)
    print("-" * len(head))
    for r in results:
        print(f"{r['mode']:<10} {r['dtype']:<5} {r['layout']:<17} {r['tokens']:>7} "
              f"{r['differ']:>7} {r['max']:>12.3e} {r['mean']:>13.3e} {r['rollout_tps']:>14.0f} "
              f"{r['score_tps']:>14.0f}")


def plot(results: List[Dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(9, 2.4 * len(results)), sharex=True,
                             squeeze=False)
    for ax, r in zip(axes[:, 0], results):
        for d in r["diffs"]:
            ax.plot(range(len(d)), d.tolist(), ".", ms=3, alpha=0.5, color="tab:blue")
        per_pos = [max((float(d[j]) for d in r["diffs"] if j < len(d)), default=0.0)
                   for j in range(max(len(d) for d in r["diffs"]))]
        ax.plot(per_pos, "-", color="tab:red", lw=1, label="max over requests")
        verdict = "bitwise equal everywhere" if r["differ"] == 0 else \
            f"{r['differ']}/{r['tokens']} tokens differ, max {r['max']:.2e}"
        ax.set_title(f'"{r["mode"]}" kernels, {r["dtype"]}, training forward in '
                     f'{r["layout"]}: {verdict}', fontsize=10)
        ax.set_ylabel("|Δ logp|")
        ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("generated token position")
    fig.suptitle("rollout logprob vs training-forward logprob, per generated token")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    results = []
    for i, dtype in enumerate(args.dtypes):
        model = build_model(args, DTYPES[dtype])
        c = model.config
        prompts = make_prompts(args, c.vocab_size)
        if i == 0:
            print(f"model: {args.hf or 'random ' + args.preset} ({c.num_hidden_layers} layers, "
                  f"{c.num_experts} experts top-{c.num_experts_per_tok}, vocab {c.vocab_size}), "
                  f"{torch.get_num_threads()} threads")
            print(f"rollout: {len(prompts)} prompts of {args.min_len}-{args.max_len} tokens, "
                  f"{args.new_tokens} new tokens, temperature {args.temperature}, "
                  f"{args.max_batch_size} slots (continuous batching); scoring: reversed order, "
                  f"padded micro-batches of {args.micro_batch}\n")
        rows = [run_mode(model, prompts, args, m, dtype) for m in args.mode_list]
        results += rows
        base = next((r for r in rows if r["mode"] == "invariant"), None)
        if i == 0 and base is not None and args.layout_tp > 1:
            results.append(run_layout(model, base, args))
    print_table(results)
    plot(results, args.out)
    print(f"\nplot: {args.out} ({time.perf_counter() - t0:.0f}s)")
    if any(r["mode"] == "invariant" and r["differ"] for r in results):
        print("FAIL: the invariant kernels disagree between rollout and training", file=sys.stderr)
        return 1
    if any(r["mode"] == "invariant" for r in results):
        print("invariant mode: every rollout logprob equals its training logprob bit for bit, "
              "in every dtype and layout shown.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
