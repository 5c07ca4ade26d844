"""Supervised finetuning (SFT) of an HF Qwen3-MoE checkpoint on prompt/response pairs.

    python examples/finetune.py --init out/pretrain/hf                 # default data: sft.jsonl
    python examples/finetune.py --init path/to/Qwen3-30B-A3B --data pairs.jsonl --dtype bf16
    torchrun --nproc-per-node 2 examples/finetune.py --init out/pretrain/hf
    torchrun --nproc-per-node 4 examples/finetune.py --init out/pretrain/hf --pp 2 --tp 2 --sp

--data is JSONL, one {"prompt": str, "response": str} per line. Each example is
prompt + response (+ eos); the loss is the mean -log p over the response tokens only. Tokenizer:
the checkpoint's `tokenizer.json` when present, else UTF-8 bytes (bos first). The loop,
optimizer, checkpoints and `--resume` are pretrain.py's (tonp_models.training.cli.run_supervised);
the HF export to <out>/hf carries the tokenizer files over.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Tuple

import torch

from tonp_models import Qwen3MoeForCausalLM
from tonp_models.training import (ItemSampler, evaluate, load_tokenizer, response_loss,
                                  response_step)
from tonp_models.training.cli import (DTYPES, add_launch_args, add_training_args, fraction,
                                      launch, layout_meta, positive_int, prepare_run_dir,
                                      run_script, run_supervised)

SFT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "sft.jsonl")
Example = Tuple[List[int], List[int]]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--init", required=True, help="HF checkpoint dir (config.json + safetensors)")
    ap.add_argument("--data", default=SFT, help="JSONL of prompt/response pairs (default: "
                    "examples/data/sft.jsonl, written by examples/make_corpus.py)")
    ap.add_argument("--max-len", type=positive_int, default=256,
                    help="prompt + response tokens at most")
    ap.add_argument("--val-fraction", type=fraction, default=0.1)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="parameter dtype (default: the checkpoint's if fp32/bf16)")
    add_training_args(ap, steps=100, batch_size=16, lr=1e-3, warmup=5, weight_decay=0.0,
                      keep_last=2, what="finetune")
    add_launch_args(ap)
    return ap.parse_args(argv)


def load_pairs(path: str, tokenizer, max_len: int) -> List[Example]:
    """Tokenized (prompt ids, response ids + eos) pairs; the response is cut to fit max_len."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file not found: {path} (a JSONL of "
                                f'{{"prompt": ..., "response": ...}} lines)')
    out: List[Example] = []
    skipped = 0
    with open(path, encoding="utf-8", errors="strict") as f:
        try:
            lines = list(enumerate(f, 1))
        except UnicodeDecodeError as e:
            raise ValueError(f"{path} is not UTF-8 text ({e})") from e
    for n, line in lines:
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e})") from e
        if not (isinstance(row, dict) and isinstance(row.get("prompt"), str)
                and isinstance(row.get("response"), str)):
            raise ValueError(f"{path}:{n}: expected a JSON object with \"prompt\" and "
                             f"\"response\" strings, got {line.strip()[:80]}")
        p = ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + \
            tokenizer.encode(row["prompt"])
        r = tokenizer.encode(row["response"]) + ([tokenizer.eos_id] if tokenizer.eos_id
                                                 is not None else [])
        if not p or len(p) >= max_len or not r:
            skipped += 1
            continue
        out.append((p, r[:max_len - len(p)]))
    if skipped:
        print(f"{path}: skipped {skipped} examples (empty, or prompt >= --max-len={max_len})")
    if not out:
        raise ValueError(f"{path} holds no usable prompt/response pairs")
    return out


def main(argv=None) -> Dict:
    """Run SFT; returns {"losses": {step: loss}, "eval": {...}, "model", "out", ...}."""
    return launch(parse_args(argv), _train)


def _train(args, groups) -> Dict:
    if not os.path.isfile(os.path.join(args.init, "config.json")):
        raise FileNotFoundError(f"--init {args.init}: not an HF checkpoint directory (no "
                                f"config.json); export one with examples/pretrain.py")
    prepare_run_dir(args, groups)               # refuses to land on another run's history
    torch.manual_seed(args.seed)
    model = Qwen3MoeForCausalLM.from_pretrained(
        args.init, dtype=DTYPES[args.dtype] if args.dtype else None,
        groups=groups if groups.world_size > 1 else None)
    tokenizer = load_tokenizer(args.init, model.config)
    pairs = load_pairs(args.data, tokenizer, args.max_len)
    n_val = int(len(pairs) * args.val_fraction)
    train, val = pairs[:len(pairs) - n_val], pairs[len(pairs) - n_val:]
    sampler = ItemSampler(train, args.batch_size, args.seed, groups.dp_rank, groups.dp_size,
                          what="training pairs")
    meta = {"script": "finetune", "config": model.config.to_hf(),
            "init": os.path.abspath(args.init), "dtype": str(model.dtype),
            "layout": layout_meta(groups)}

    def loss(batch):
        return (response_step(model, [p for p, _ in batch], [r for _, r in batch],
                              args.micro_batches), sum(len(p) + len(r) for p, r in batch))

    def nll(part):                              # (sum of -log p, tokens) of held-out pairs
        n = sum(len(r) for _, r in part)
        return float(response_loss(model, *zip(*part))) * n, n

    out = run_supervised(args, groups, model, sampler, loss, meta=meta, name="finetune",
                         fixed=("data", "max_len", "val_fraction"),
                         eval_fn=(lambda: evaluate(model, val, args.batch_size, groups, nll))
                         if val else None, files_from=args.init)
    out["tokenizer"] = type(tokenizer).__name__
    return out


if __name__ == "__main__":
    sys.exit(run_script(main, "finetune.py"))
