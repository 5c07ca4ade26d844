"""Supervised finetuning (SFT) of an HF Qwen3-MoE checkpoint on prompt/response pairs.

    python examples/finetune.py --init out/pretrain/hf                 # default data: sft.jsonl
    python examples/finetune.py --init path/to/Qwen3-30B-A3B --data pairs.jsonl --dtype bf16
    torchrun --nproc-per-node 2 examples/finetune.py --init out/pretrain/hf

--data is JSONL, one {"prompt": str, "response": str} per line. Each example is
prompt + response (+ eos); the loss is the mean -log p over the response tokens only (the prompt
is context), from `model.token_logprobs`. Tokenizer: the checkpoint's `tokenizer.json` (through
`tokenizers`) when present, else UTF-8 bytes (bos first, as the tiny preset expects). Training
machinery as pretrain.py: AdamW with fp32 state (and fp32 master weights for bf16), warmup +
cosine, clipping, held-out eval loss, atomic keep-last-N checkpoints, exact `--resume`, an HF
export to `<out>/hf` (with the tokenizer files copied over), metrics JSONL and a PNG.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from typing import Dict, List, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tonp_parallel as tpar  # noqa: E402
from tonp_models import Qwen3MoeForCausalLM  # noqa: E402

import make_corpus  # noqa: E402
from common import (DTYPES, IndexSampler, MetricLogger, load_tokenizer, plot_curves,  # noqa: E402
                    response_loss)
from trainer import Trainer, launch  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "vocab.json", "merges.txt")
Example = Tuple[List[int], List[int]]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--init", required=True, help="HF checkpoint dir (config.json + safetensors)")
    ap.add_argument("--data", default=make_corpus.SFT, help="JSONL of prompt/response pairs")
    ap.add_argument("--out", default="out/finetune")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=16, help="examples per rank per step")
    ap.add_argument("--max-len", type=int, default=256, help="prompt + response tokens at most")
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="parameter dtype (default: the checkpoint's if fp32/bf16)")
    ap.add_argument("--mode", choices=["invariant", "torch"], default="invariant")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--keep-last", type=int, default=2)
    ap.add_argument("--resume", nargs="?", const="latest", default=None)
    ap.add_argument("--no-export", action="store_true")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def load_pairs(path: str, tokenizer, max_len: int) -> List[Example]:
    """Tokenized (prompt ids, response ids + eos) pairs; the response is cut to fit max_len."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file not found: {path} (a JSONL of "
                                f'{{"prompt": ..., "response": ...}} lines)')
    out: List[Example] = []
    skipped = 0
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt, response = row["prompt"], row["response"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: expected a JSON object with \"prompt\" and "
                                 f"\"response\" strings ({e})") from e
            p = ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + \
                tokenizer.encode(prompt)
            r = tokenizer.encode(response) + ([tokenizer.eos_id] if tokenizer.eos_id is not None
                                              else [])
            if not p or len(p) >= max_len or not r:
                skipped += 1
                continue
            out.append((p, r[:max_len - len(p)]))
    if skipped:
        print(f"{path}: skipped {skipped} examples (empty, or prompt >= --max-len={max_len})")
    if not out:
        raise ValueError(f"{path} holds no usable prompt/response pairs")
    return out


@torch.no_grad()
def evaluate(model, pairs: List[Example], batch_size: int, groups) -> float:
    """Mean response-token loss over the held-out pairs (DP ranks split them; tree sum)."""
    mine = pairs[groups.dp_rank::groups.dp_size]
    total = torch.zeros(2)
    for i in range(0, len(mine), batch_size):
        part = mine[i:i + batch_size]
        n = sum(len(r) for _, r in part)
        total += torch.tensor([float(response_loss(model, *zip(*part))) * n, float(n)])
    if groups.dp_size > 1:
        total = tpar.tree_all_reduce(total, groups.dp_group)
    return float(total[0] / total[1].clamp(min=1))


def main(argv=None) -> Dict:
    """Run SFT; returns {"losses": {step: loss}, "eval": {...}, "model", "out", ...}."""
    return launch(parse_args(argv), _train)


def _train(args, groups, expert_dp) -> Dict:
    from tqdm.auto import tqdm
    is_main = groups.rank == 0
    if not os.path.isfile(os.path.join(args.init, "config.json")):
        raise FileNotFoundError(f"--init {args.init}: not an HF checkpoint directory (no "
                                f"config.json); export one with examples/pretrain.py")
    torch.manual_seed(args.seed)
    model = Qwen3MoeForCausalLM.from_pretrained(
        args.init, dtype=DTYPES[args.dtype] if args.dtype else None,
        groups=groups if groups.world_size > 1 else None)
    tokenizer = load_tokenizer(args.init, model.config)
    pairs = load_pairs(make_corpus.ensure(args.data), tokenizer, args.max_len)
    n_val = int(len(pairs) * args.val_fraction)
    train, val = pairs[:len(pairs) - n_val], pairs[len(pairs) - n_val:]
    sampler = IndexSampler(len(train), args.batch_size, args.seed, groups.dp_rank,
                           groups.dp_size, what="training pairs")
    meta = {"script": "finetune", "config": model.config.to_hf(), "init": os.path.abspath(args.init),
            "dtype": str(model.dtype), "layout": {"tp": groups.tp_size, "ep": groups.ep_size,
                                                  "dp": groups.dp_size}, "seed": args.seed}
    trainer = Trainer(model, groups, expert_dp, lr=args.lr, weight_decay=args.weight_decay,
                      warmup=args.warmup, total_steps=args.steps, min_lr_ratio=args.min_lr_ratio,
                      grad_clip=args.grad_clip, ckpt_dir=os.path.join(args.out, "ckpt"),
                      keep_last=args.keep_last, meta=meta)
    start, state = trainer.resume(args.resume)
    if state:
        sampler.load_state_dict(state["data"])

    log = MetricLogger(args.out, enabled=is_main, resume_step=start if state else None)
    losses: Dict[int, float] = {}
    evals: Dict[int, float] = {}
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="finetune",
               disable=not is_main or args.no_progress, dynamic_ncols=True)
    saved = start if state else None
    for step in bar:
        t0 = time.perf_counter()
        batch = [train[i] for i in sampler.next_indices()]
        trainer.zero_grad()
        loss = response_loss(model, [p for p, _ in batch], [r for _, r in batch])
        loss.backward()
        stats = trainer.step()
        n = step + 1
        losses[n] = float(loss.detach())
        row = {"step": n, "loss": losses[n], **stats,
               "tokens_per_s": sum(len(p) + len(r) for p, r in batch) * groups.dp_size
               / (time.perf_counter() - t0)}
        if val and args.eval_every and (n % args.eval_every == 0 or n == args.steps):
            evals[n] = row["eval_loss"] = evaluate(model, val, args.batch_size, groups)
        log.log(row, echo=("eval_loss" in row or n == start + 1))
        bar.set_postfix(loss=f"{losses[n]:.3f}", refresh=False)
        if not math.isfinite(losses[n]):
            raise FloatingPointError(f"step {n}: the loss is {losses[n]}; lower --lr")
        if args.save_every and n % args.save_every == 0:
            trainer.save(n, extra={"data": sampler.state_dict()})
            saved = n
    bar.close()
    if saved != args.steps and args.steps > start:
        trainer.save(args.steps, extra={"data": sampler.state_dict()})
    out = {"losses": losses, "eval": evals, "model": model, "out": args.out,
           "tokenizer": type(tokenizer).__name__}
    if not args.no_export:
        hf = os.path.join(args.out, "hf")
        if is_main or groups.tp_size > 1 or groups.ep_size > 1:
            model.save_pretrained(hf)
        if is_main:
            for name in TOKENIZER_FILES:
                if os.path.isfile(os.path.join(args.init, name)):
                    shutil.copy(os.path.join(args.init, name), hf)
        out["hf"] = hf
    log.close()
    if is_main and os.path.exists(log.path):
        out["png"] = plot_curves(log.path, os.path.join(args.out, "curves.png"),
                                 ["loss", "eval_loss", "lr", "grad_norm"], title="finetune")
        if losses:
            print(f"loss {losses[min(losses)]:.3f} -> {losses[max(losses)]:.3f}; outputs in "
                  f"{args.out}")
    return out


if __name__ == "__main__":
    main()
