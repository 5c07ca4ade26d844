"""True on-policy RL (GRPO with a PPO-clip loss) with one model as trainer and rollout engine.

    python examples/grpo.py                          # tiny model, digit-copy task, invariant kernels
    python examples/grpo.py --mode torch --out out/grpo_torch   # stock ops: logdiff > 0, ratio != 1
    python examples/grpo.py --init out/pretrain/hf --task reverse --out out/grpo_rev
    torchrun --nproc-per-node 2 examples/grpo.py --out out/grpo_dp2   # DP: each rank its prompts
    torchrun --nproc-per-node 2 examples/grpo.py --pp 2 --rollout-tp 2 --overwrite   # in out/grpo

Each step samples --group-size responses per prompt with `tonp_models.generate`, rewards them
(copy "407>" -> "407", reverse -> "704", add "3+5>" -> "8"; partial credit per character),
and takes --inner-steps PPO-clip steps on group-relative advantages, scoring with the training
forward (`model.forward_backward`: micro-batches, the 1F1B schedule under --pp). Before the
first update the policy has not moved, so in the invariant mode the logged logdiff is exactly
0.0 and every ratio exactly 1. --sft-steps supervised steps first give a fresh model the answer
format. --rollout-tp / --rollout-ep / --rollout-pp roll out with a second model instance at
another layout on the same ranks, refilled with the trainer's weights after every update
(tonp_models.training.rollouts): the logdiff stays 0.0. Details and measured curves:
docs/training.md and docs/parallelism.md.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from typing import Dict, List, Sequence, Tuple

import torch

import tonp_kernels as tk
import tonp_parallel as tpar
from tonp_models import Qwen3MoeForCausalLM
from tonp_models.qwen3_moe.checkpoint import copy_parameters
from tonp_models.training import (ByteTokenizer, MetricLogger, Trainer, build_model, dp_mean,
                                  plot_curves, response_step)
from tonp_models.training.cli import (DTYPES, add_config_args, add_launch_args,
                                      add_overwrite_arg, export_hf, launch, layout_meta,
                                      load_config, non_negative_float, non_negative_int,
                                      positive_float, positive_int, prepare_run_dir, run_script)
from tonp_models.training.rollouts import replica_share, rollout_all

TASKS = ("copy", "reverse", "add")


# -- the task -------------------------------------------------------------------------------------
def make_problem(task: str, rng: random.Random, digits: int) -> Tuple[str, str]:
    """(question, answer) strings: the prompt text before ">" and the expected response."""
    if task == "add":
        a, b = rng.randrange(10), rng.randrange(10)
        return f"{a}+{b}", str(a + b)
    n = rng.randint(max(1, digits - 1), digits)
    s = "".join(str(rng.randrange(10)) for _ in range(n))
    return s, (s if task == "copy" else s[::-1])


def encode_prompt(tok: ByteTokenizer, question: str) -> List[int]:
    return [tok.bos_id] + tok.encode(question + ">")


def reward(response: Sequence[int], answer: str, tok: ByteTokenizer) -> float:
    """Fraction of answer characters in place; a response longer or shorter than the answer is
    scored over the longer of the two. `response` excludes the prompt; it ends at eos if any."""
    ids = list(response)
    if tok.eos_id in ids:
        ids = ids[:ids.index(tok.eos_id)]
    got = tok.encode(answer)
    hits = sum(1 for a, b in zip(ids, got) if a == b)
    return hits / max(len(got), len(ids), 1)


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """rewards [P, G] -> (r - group mean) / (group std + eps) [P, G] (0 for a uniform group)."""
    mean = rewards.mean(1, keepdim=True)
    std = rewards.std(1, keepdim=True, unbiased=False)
    return (rewards - mean) / (std + eps)


def rollout_via_server(model, args, prompts, max_new: int, eos: int, request_ids):
    """The step's rollouts through a running tonp server (--server URL; python -m
    tonp_models.serve; one training process only) after pushing the policy's current weights to
    it. The same bits as rolling out in process (tests/test_serve.py)."""
    kw = dict(eos_token_id=eos, temperature=args.temperature, seed=args.seed,
              request_ids=request_ids)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SystemExit("grpo.py: --server rolls out from one process (no torchrun)")
    from tonp_models.serve import RolloutClient
    client = RolloutClient(args.server)
    path = os.path.join(os.path.abspath(args.out), "server_weights")
    model.save_pretrained(path)
    client.update_weights(path)
    return client.generate(prompts, max_new, **kw)


# -- one RL step ----------------------------------------------------------------------------------
def ppo_clip_loss(lp_train: List[torch.Tensor], lp_old: List[torch.Tensor],
                  adv: torch.Tensor, clip_eps: float, n: int = 0) -> torch.Tensor:
    """Sum over sequences of the per-sequence mean of -min(ratio*A, clip(ratio)*A) over its
    response tokens, divided by n (default: the number of sequences, i.e. the mean).
    lp_train/lp_old: fp32 [n_i] per sequence; adv: [N]."""
    per_seq = []
    for lt, lo, a in zip(lp_train, lp_old, adv.tolist()):
        ratio = torch.exp(lt - lo)
        obj = torch.minimum(ratio * a, ratio.clamp(1 - clip_eps, 1 + clip_eps) * a)
        per_seq.append(-obj.mean())
    return torch.stack(per_seq).sum() / (n or len(per_seq))


def rl_step(trainer: Trainer, rollout_model, args, tok, step: int) -> Dict:
    """Rollouts, rewards, advantages and `args.inner_steps` PPO-clip updates; returns the metrics."""
    model, groups = trainer.model, trainer.groups
    if rollout_model is not model:                 # the trainer's weights, at the rollout layout
        copy_parameters(model, rollout_model)
    # The whole step's prompts, the same on every rank; each training replica trains on its
    # share, whichever ranks rolled them out (noise keys: the global request index).
    rng = random.Random(args.seed * 1_000_003 + step * 1009)
    problems = [make_problem(args.task, rng, args.digits)
                for _ in range(args.prompts * groups.dp_size)]
    prompts = [encode_prompt(tok, q) for q, _ in problems for _ in range(args.group_size)]
    answers = [a for _, a in problems for _ in range(args.group_size)]
    max_new = max(len(a) for a in answers) + 2
    t0 = time.perf_counter()
    request_ids = range(step * len(prompts), (step + 1) * len(prompts))   # global noise keys
    if getattr(args, "server", None):
        out = rollout_via_server(model, args, prompts, max_new, tok.eos_id, request_ids)
    else:
        out = rollout_all(rollout_model, prompts, max_new_tokens=max_new,
                          eos_token_id=tok.eos_id, temperature=args.temperature, seed=args.seed,
                          request_ids=request_ids, max_batch_size=args.rollout_batch)
    t_roll = time.perf_counter() - t0
    rewards = torch.tensor([reward(c, a, tok) for c, a in zip(out.completions, answers)])
    adv = group_advantages(rewards.view(-1, args.group_size)).reshape(-1)
    solved = float((rewards == 1).float().mean())
    mine = replica_share(len(prompts), groups)
    seqs = out.sequences[mine.start:mine.stop]
    old = out.logprobs[mine.start:mine.stop]
    starts = out.prompt_lengths[mine.start:mine.stop]
    adv = adv[mine.start:mine.stop]
    row: Dict = {"reward": float(rewards.mean()), "solved": solved,
                 "response_len": float(sum(out.num_new_tokens) / len(prompts)),
                 "rollout_tokens_per_s": out.stats.tokens_per_s}
    t1 = time.perf_counter()
    train_tokens = 0

    def loss_fn(lps, index):              # this micro-batch's share of the PPO loss
        return ppo_clip_loss([lp[starts[i] - 1:] for lp, i in zip(lps, index)],
                             [old[i] for i in index], adv[index.start:index.stop],
                             args.clip_eps, n=len(seqs))

    for inner in range(args.inner_steps):
        trainer.zero_grad()
        res = model.forward_backward(seqs, loss_fn, micro_batches=args.micro_batches,
                                     temperature=args.temperature)
        if inner == 0:
            lp_train = [lp[s - 1:] for lp, s in zip(res.logprobs, starts)]  # response tokens
            diff = torch.cat([(a - b).abs() for a, b in zip(lp_train, old)])
            ratio = torch.exp(torch.cat([a - b for a, b in zip(lp_train, old)]))
            worst = torch.stack([diff.max(), -ratio.min(), ratio.max()])
            if groups.dp_size > 1:         # the worst over every DP rank's rollouts
                worst = tpar.all_gather_stacked(worst, groups.dp_group).max(0).values
            row.update(logdiff=float(worst[0]), ratio_min=float(-worst[1]),
                       ratio_max=float(worst[2]), ratio_mean=float(ratio.mean()),
                       ratio_is_one=bool(worst[1] == -1.0 and worst[2] == 1.0))
        row["grad_norm"] = trainer.step()["grad_norm"]
        train_tokens += sum(len(s) for s in seqs)
    row["loss"] = dp_mean(res.loss, groups)             # the last inner step's, over DP
    row["train_tokens_per_s"] = train_tokens / (time.perf_counter() - t1)
    row["tokens_per_s"] = (out.stats.prefill_tokens + out.stats.decode_tokens + train_tokens) / \
        (time.perf_counter() - t0)
    row["rollout_s"] = t_roll
    row["sample"] = f"{problems[0][0]}> {tok.decode(out.completions[0])!r}"
    return row


def sft_step(trainer: Trainer, args, tok, step: int) -> Dict:
    """One supervised warm-start step on the task (loss on the answer + eos tokens only)."""
    rng = random.Random(args.seed * 7919 + step * 31 + trainer.groups.dp_rank + 12345)
    problems = [make_problem(args.task, rng, args.digits)
                for _ in range(args.prompts * args.group_size)]
    trainer.zero_grad()
    loss = response_step(trainer.model, [encode_prompt(tok, q) for q, _ in problems],
                         [tok.encode(a) + [tok.eos_id] for _, a in problems], args.micro_batches)
    return {"sft_loss": dp_mean(loss, trainer.groups), "grad_norm": trainer.step()["grad_norm"]}


# -- main -----------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", metavar="URL", help="roll out through a tonp server (one "
                    "process): each step saves the policy and loads it there first")
    ap.add_argument("--task", choices=TASKS, default="copy")
    ap.add_argument("--digits", type=positive_int, default=3,
                    help="max digits of copy/reverse strings")
    ap.add_argument("--init", help="an HF checkpoint dir to start from (default: fresh tiny)")
    add_config_args(ap)
    ap.add_argument("--out", default="out/grpo")
    add_overwrite_arg(ap)
    ap.add_argument("--steps", type=non_negative_int, default=60, help="RL steps")
    ap.add_argument("--sft-steps", type=non_negative_int, default=35,
                    help="supervised warm-start steps")
    ap.add_argument("--sft-lr", type=non_negative_float, default=3e-3)
    ap.add_argument("--prompts", type=positive_int, default=8,
                    help="prompts per step (per DP rank)")
    ap.add_argument("--group-size", type=positive_int, default=8, help="G responses per prompt")
    ap.add_argument("--inner-steps", type=positive_int, default=2,
                    help="PPO updates per rollout batch")
    ap.add_argument("--temperature", type=positive_float, default=1.0)
    ap.add_argument("--clip-eps", type=non_negative_float, default=0.2)
    ap.add_argument("--lr", type=non_negative_float, default=1e-3,
                    help="RL learning rate (fresh AdamW)")
    ap.add_argument("--weight-decay", type=non_negative_float, default=0.0)
    ap.add_argument("--grad-clip", type=non_negative_float, default=1.0)
    ap.add_argument("--rollout-batch", type=positive_int, default=None,
                    help="generate's max_batch_size")
    for flag in ("tp", "ep", "pp"):
        ap.add_argument(f"--rollout-{flag}", type=positive_int, default=None,
                        help=f"roll out at this {flag} degree, on a second model on the same "
                             f"ranks (the --rollout-* not given are 1; none given: the "
                             f"training model rolls out)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-export", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    add_launch_args(ap)
    return ap.parse_args(argv)


def main(argv=None) -> Dict:
    """Run GRPO; returns {"rows": [per-step metrics], "model", "out", ...}."""
    return launch(parse_args(argv), _run)


def _run(args, groups) -> Dict:
    from tqdm.auto import tqdm
    is_main = groups.rank == 0
    prepare_run_dir(args, groups, can_resume=False)   # refuses to land on another run's history
    dtype = DTYPES[args.dtype]
    if args.init:
        torch.manual_seed(args.seed)
        model = Qwen3MoeForCausalLM.from_pretrained(
            args.init, dtype=dtype, groups=groups if groups.world_size > 1 else None)
    else:
        model = build_model(load_config(args), dtype, groups, args.seed)
    c = model.config
    tok = ByteTokenizer(bos_id=c.bos_token_id if c.bos_token_id is not None else 256,
                        eos_id=c.eos_token_id if isinstance(c.eos_token_id, int) else 257)
    if c.vocab_size <= max(tok.bos_id, tok.eos_id):
        raise ValueError(f"the task needs a byte vocabulary with bos/eos ids; the model has "
                         f"vocab_size={c.vocab_size}")
    # SFT warm-start: AdamW at --sft-lr; then RL: a fresh AdamW on the same master weights.
    rollout_model = _rollout_model(args, model, groups)
    trainer = Trainer(model, groups, lr=args.sft_lr, weight_decay=args.weight_decay,
                      min_lr_ratio=1.0, grad_clip=args.grad_clip,
                      ckpt_dir=os.path.join(args.out, "ckpt"), keep_last=1,
                      meta={"script": "grpo", "config": c.to_hf(), "dtype": args.dtype,
                            "layout": layout_meta(groups)})
    log = MetricLogger(args.out, enabled=is_main)
    rows: List[Dict] = []
    for s in tqdm(range(args.sft_steps), desc="sft warm-start",
                  disable=not is_main or args.no_progress):
        r = {"step": s + 1 - args.sft_steps, "phase": "sft", **sft_step(trainer, args, tok, s)}
        log.log(r, echo=(s + 1 == args.sft_steps))
    trainer.new_optimizer(args.lr, args.weight_decay, betas=(0.9, 0.99), min_lr_ratio=1.0)
    bar = tqdm(range(args.steps), desc=f"grpo[{tk.get_mode()}]",
               disable=not is_main or args.no_progress, dynamic_ncols=True)
    for step in bar:
        r = {"step": step + 1, "phase": "rl", **rl_step(trainer, rollout_model, args, tok, step)}
        rows.append(r)
        log.log(r)
        bar.set_postfix(reward=f"{r['reward']:.3f}", logdiff=f"{r['logdiff']:.2g}", refresh=False)
    bar.close()
    trainer.save(args.steps)
    out = {"rows": rows, "model": model, "out": args.out}
    if not args.no_export:
        out["hf"] = export_hf(model, os.path.join(args.out, "hf"), groups)
    log.close()
    if is_main:
        out["png"] = plot_curves(log.path, os.path.join(args.out, "curves.png"),
                                 ["reward", "solved", "logdiff", "ratio_max", "tokens_per_s"],
                                 title=f"grpo {args.task} ({tk.get_mode()} kernels)")
        if rows:
            print(f"reward {rows[0]['reward']:.3f} -> {rows[-1]['reward']:.3f}; max logdiff "
                  f"{max(r['logdiff'] for r in rows):.3g}; outputs in {args.out}")
    return out


def _rollout_model(args, model, groups):
    """The model generate runs: `model` itself, or (--rollout-tp/-ep/-pp) a second instance at
    that layout on the same ranks (its weights come from the trainer before every rollout)."""
    given = {k: getattr(args, f"rollout_{k}") for k in ("tp", "ep", "pp")}
    if all(v is None for v in given.values()):
        return model
    want = {k: v or 1 for k, v in given.items()}
    if all(want[k] == getattr(groups, f"{k}_size") for k in want):
        return model  # (under CP every CP rank decodes every row: the same bits)
    rg = tpar.init_parallel(**want, timeout=args.dist_timeout)
    with torch.device("meta"):
        rollout = Qwen3MoeForCausalLM(model.config, dtype=model.dtype,
                                      groups=rg if rg.world_size > 1 else None)
    rollout.to_empty(device="cpu")
    rollout.rotary.reset_tables()
    rollout.requires_grad_(False)
    return rollout


if __name__ == "__main__":
    sys.exit(run_script(main, "grpo.py"))
