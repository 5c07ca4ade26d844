"""Pretrain a Qwen3-MoE model with tonp's kernels: next-token cross-entropy on a token stream.

    python examples/pretrain.py                                   # tiny preset, bundled corpus
    python examples/pretrain.py --steps 400 --dtype bf16 --out out/run1
    python examples/pretrain.py --out out/run1 --resume           # continue from the latest ckpt
    python examples/pretrain.py --out out/run1 --overwrite        # start run1 again, afresh
    torchrun --nproc-per-node 2 examples/pretrain.py --out out/dp2          # data parallel x2
    torchrun --nproc-per-node 4 examples/pretrain.py --out out/tpep --tp 2 --ep 2
    torchrun --nproc-per-node 4 examples/pretrain.py --out out/pp2 --pp 2 --tp 2 --sp \
        --micro-batches 4
    torchrun --nproc-per-node 2 examples/pretrain.py --out out/cp2 --cp 2 --seq-len 1024

The loss is the mean of -log p(next token) from `model.token_logprobs` (the numbers an RL loop
scores rollouts with), run by `model.forward_backward` in --micro-batches micro-batches (the
1F1B pipeline schedule under --pp; the same loss bits at every --pp for the same micro-batches). The loop, optimizer, checkpoints and `--resume` (bit for bit) are
tonp_models.training's (see docs/training.md); the HF export goes to <out>/hf. A new run in an
--out that holds one is refused: --resume it, --overwrite it, or choose another --out.
--data: a UTF-8 text file (bytes are the tokens) or a raw token file (.bin/.u16 = uint16,
.u32 = uint32, memory-mapped); default examples/data/corpus.txt (examples/make_corpus.py).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict

import torch

from tonp_models.training import (ByteTokenizer, WindowSampler, build_model, check_vocab,
                                  evaluate, lm_step, load_tokens, window_rows)
from tonp_models.training.cli import (DTYPES, add_config_args, add_launch_args,
                                      add_training_args, fraction, launch, layout_meta,
                                      load_config, non_negative_int, positive_int,
                                      prepare_run_dir, run_script, run_supervised)

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "corpus.txt")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(ap)
    ap.add_argument("--data", default=CORPUS, help="text file or uint16/32 token file (default: "
                    "examples/data/corpus.txt, written by examples/make_corpus.py)")
    ap.add_argument("--token-dtype", choices=["uint16", "uint32"], help="dtype of a token file")
    ap.add_argument("--val-fraction", type=fraction, default=0.05, help="held-out tail for eval")
    ap.add_argument("--seq-len", type=positive_int, default=64)
    ap.add_argument("--eval-batches", type=non_negative_int, default=2)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="parameter dtype")
    add_training_args(ap, steps=200, batch_size=8, lr=5e-3, warmup=10, weight_decay=0.1,
                      keep_last=3, what="pretrain")
    add_launch_args(ap)
    return ap.parse_args(argv)


def main(argv=None) -> Dict:
    """Run pretraining; returns {"losses": {step: loss}, "eval": {step: loss}, "model", "out", ...}."""
    return launch(parse_args(argv), _train)


def _train(args, groups) -> Dict:
    config = load_config(args)
    prepare_run_dir(args, groups)               # refuses to land on another run's history
    tokens = load_tokens(args.data, ByteTokenizer(config.bos_token_id, config.eos_token_id),
                         args.token_dtype)
    check_vocab(tokens, config.vocab_size, args.data)
    n_val = int(len(tokens) * args.val_fraction)
    train, val = tokens[:len(tokens) - n_val], tokens[len(tokens) - n_val:]
    sampler = WindowSampler(train, args.seq_len, args.batch_size, args.seed, groups.dp_rank,
                            groups.dp_size)
    model = build_model(config, DTYPES[args.dtype], groups, args.seed)
    meta = {"script": "pretrain", "config": config.to_hf(), "dtype": args.dtype,
            "layout": layout_meta(groups)}

    def nll(windows):                           # (sum of -log p, tokens) of held-out windows
        rows = window_rows(val, windows, args.seq_len)
        lp = torch.cat(model.token_logprobs(list(rows.unbind(0))))
        return -lp.sum(), lp.numel()

    n_eval = min(args.eval_batches * args.batch_size, max(0, (len(val) - 1) // args.seq_len))
    return run_supervised(
        args, groups, model, sampler,
        lambda b: (lm_step(model, b, args.micro_batches), b[:, 1:].numel()),
        meta=meta, name="pretrain", fixed=("data", "token_dtype", "val_fraction", "seq_len"),
        eval_fn=lambda: evaluate(model, range(n_eval), args.batch_size, groups, nll))


if __name__ == "__main__":
    sys.exit(run_script(main, "pretrain.py"))
