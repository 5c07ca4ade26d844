"""The true-on-policy demo (`make demo`): rollout logprobs vs training logprobs, bit for bit.

    python examples/demo.py                      # embedded tiny model, random weights (seed 0)
    python examples/demo.py --dtype bf16 --prompts 32 --temperature 0.8
    python examples/demo.py --hf path/to/qwen3_moe_checkpoint

For each kernel mode ("torch" = stock PyTorch ops, "invariant" = tonp's kernels) the demo
1. rolls out a batch of ragged prompts with the generator (continuous batching, paged KV cache,
   seeded sampling), recording each generated token's logprob;
2. scores the same sequences with the training forward (`model.token_logprobs`) in a different
   arrangement: reversed order, padded micro-batches of another size;
3. compares the two logprobs of every generated token.
It prints a table (max and mean |Δlogp|, tokens that differ, rollout and scoring tokens/s) and saves
a plot of |Δlogp| per position under out/. RL methods that assume on-policy data (PPO/GRPO
importance ratios) get exactly ratio 1 only when the invariant row says 0.
Exit status 1 if the invariant mode shows any difference.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Dict, List

import torch

import tonp_kernels as tk
from tonp_models import Qwen3MoeConfig, Qwen3MoeForCausalLM, generate

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
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
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
    p.add_argument("--out", default="out/demo_logdiff.png", help="where to save the plot")
    return p.parse_args(argv)


def build_model(args) -> Qwen3MoeForCausalLM:
    dtype = DTYPES[args.dtype]
    if args.hf:
        return Qwen3MoeForCausalLM.from_pretrained(args.hf, dtype=dtype).eval()
    torch.manual_seed(args.weights_seed)
    config = Qwen3MoeConfig.preset(args.preset)
    if args.init_std is not None:
        config.initializer_range = args.init_std
    return Qwen3MoeForCausalLM(config, dtype=dtype).eval()


def make_prompts(args, vocab_size: int) -> List[torch.Tensor]:
    if not 1 <= args.min_len <= args.max_len:
        raise SystemExit(f"demo: need 1 <= --min-len <= --max-len, got {args.min_len}, "
                         f"{args.max_len}")
    g = torch.Generator().manual_seed(args.seed)
    lens = torch.randint(args.min_len, args.max_len + 1, (args.prompts,), generator=g)
    top = min(vocab_size, 256)  # byte-like ids: no special tokens inside prompts
    return [torch.randint(0, top, (int(n),), generator=g) for n in lens]


def run_mode(model, prompts, args, mode: str) -> Dict:
    """Roll out and score in one kernel mode; -> summary numbers and |Δlogp| per request."""
    T = args.temperature
    with tk.use(mode):
        out = generate(model, prompts, args.new_tokens, eos_token_id=model.config.eos_token_id,
                       temperature=T, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                       max_batch_size=args.max_batch_size)
        # The trainer sees the batch differently: reversed, padded, other micro-batch size.
        order = list(range(len(prompts)))[::-1]
        start = time.perf_counter()
        with torch.no_grad():
            scored = model.token_logprobs([out.sequences[i] for i in order], temperature=T or 1.0,
                                          micro_batch_size=args.micro_batch, packed=False)
        score_s = time.perf_counter() - start
    train = [None] * len(prompts)
    for i, lp in zip(order, scored):
        train[i] = lp
    diffs = [(train[i][p - 1:] - out.logprobs[i]).abs()
             for i, p in enumerate(out.prompt_lengths)]
    flat = torch.cat(diffs)
    return dict(mode=mode, diffs=diffs, tokens=flat.numel(), differ=int((flat != 0).sum()),
                max=float(flat.max()), mean=float(flat.mean()),
                rollout_tps=out.stats.new_tokens / out.stats.seconds,
                score_tps=sum(len(s) for s in out.sequences) / score_s,
                steps=out.stats.forward_steps)


def print_table(results: List[Dict], args) -> None:
    head = (f"{'mode':<10} {'dtype':<5} {'tokens':>7} {'differ':>7} {'max |Δlogp|':>12} "
            f"{'mean |Δlogp|':>13} {'rollout tok/s':>14} {'scoring tok/s':>14}")
    print(head)
    print("-" * len(head))
    for r in results:
        print(f"{r['mode']:<10} {args.dtype:<5} {r['tokens']:>7} {r['differ']:>7} "
              f"{r['max']:>12.3e} {r['mean']:>13.3e} {r['rollout_tps']:>14.0f} "
              f"{r['score_tps']:>14.0f}")


def plot(results: List[Dict], path: str, args) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(9, 2.8 * len(results)), sharex=True,
                             squeeze=False)
    for ax, r in zip(axes[:, 0], results):
        for d in r["diffs"]:
            ax.plot(range(len(d)), d.tolist(), ".", ms=3, alpha=0.5, color="tab:blue")
        per_pos = [max((float(d[j]) for d in r["diffs"] if j < len(d)), default=0.0)
                   for j in range(max(len(d) for d in r["diffs"]))]
        ax.plot(per_pos, "-", color="tab:red", lw=1, label="max over requests")
        verdict = "bitwise equal everywhere" if r["differ"] == 0 else \
            f"{r['differ']}/{r['tokens']} tokens differ, max {r['max']:.2e}"
        ax.set_title(f'"{r["mode"]}" kernels ({args.dtype}): {verdict}', fontsize=10)
        ax.set_ylabel("|Δ logp|")
        ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("generated token position")
    fig.suptitle("rollout logprob vs training-forward logprob, per generated token")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    model = build_model(args)
    c = model.config
    prompts = make_prompts(args, c.vocab_size)
    print(f"model: {args.hf or 'random ' + args.preset} ({c.num_hidden_layers} layers, "
          f"{c.num_experts} experts top-{c.num_experts_per_tok}, vocab {c.vocab_size}), "
          f"{args.dtype}, {torch.get_num_threads()} threads")
    print(f"rollout: {len(prompts)} prompts of {args.min_len}-{args.max_len} tokens, "
          f"{args.new_tokens} new tokens, temperature {args.temperature}, "
          f"{args.max_batch_size} slots (continuous batching); scoring: reversed order, padded "
          f"micro-batches of {args.micro_batch}\n")
    results = [run_mode(model, prompts, args, m.strip()) for m in args.modes.split(",")]
    print_table(results, args)
    plot(results, args.out, args)
    print(f"\nplot: {args.out}")
    bad = [r for r in results if r["mode"] == "invariant" and r["differ"]]
    if bad:
        print("FAIL: the invariant kernels disagree between rollout and training", file=sys.stderr)
        return 1
    if any(r["mode"] == "invariant" for r in results):
        print("invariant mode: every rollout logprob equals its training logprob bit for bit.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
