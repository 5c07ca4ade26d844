"""TRL's GRPOTrainer on tonp: TRL's loop, loss and metrics; tonp's model and engine.

    python examples/trl_grpo.py                               # tiny model, in-process engine
    python -m tonp_models.serve --preset tiny --port 8000 &   # or: a tonp server generates
    python examples/trl_grpo.py --server http://127.0.0.1:8000
    python examples/trl_grpo.py --mode torch                  # stock ops: TRL logs a mismatch
    accelerate launch --multi_gpu --num_processes 2 examples/trl_grpo.py   # DDP (gloo on CPU)

The task: copy a digit string ("407>" -> "407"), partial credit per character. The tokenizer
is a byte-level one built locally (tonp_models.integrations.tokenizer; no hub). Each step
prints TRL's own `sampling/sampling_logp_difference/max` and importance-sampling ratio range:
0.0 and [1.0, 1.0] with tonp's kernels. --init starts from an HF checkpoint directory (with
its tokenizer, or the byte one). How it works and what it refuses: docs/trl.md.
"""
from __future__ import annotations

import argparse
import json
import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import tonp_kernels as tk  # noqa: E402
from tonp_models import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

METRICS = {"logdiff_max": "sampling/sampling_logp_difference/max",
           "ratio_min": "sampling/importance_sampling_ratio/min",
           "ratio_max": "sampling/importance_sampling_ratio/max"}


def copy_task(n: int, seed: int):
    """A datasets.Dataset of n prompts "<digits>>" with the expected answer."""
    from datasets import Dataset
    rng = random.Random(seed)
    digits = ["".join(str(rng.randrange(10)) for _ in range(rng.randint(2, 4))) for _ in range(n)]
    return Dataset.from_dict({"prompt": [d + ">" for d in digits], "answer": digits})


def copy_reward(prompts, completions, answer, **kw):
    """Characters in place over the longer of the completion and the answer, plus a shaping
    half for digits anywhere (a fresh model rarely writes one: its groups need a spread)."""
    out = []
    for text, want in zip(completions, answer):
        hits = sum(a == b for a, b in zip(text, want))
        digits = sum(c.isdigit() for c in text) / max(len(text), 1)
        out.append(hits / max(len(text), len(want), 1) + 0.5 * digits)
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", metavar="URL", help="a tonp server generates (default: in process)")
    ap.add_argument("--init", help="an HF checkpoint dir (default: a fresh tiny model)")
    ap.add_argument("--mode", choices=["invariant", "torch"], default="invariant")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8, help="per-device completions per step")
    ap.add_argument("--num-generations", type=int, default=4)
    ap.add_argument("--num-iterations", type=int, default=1)
    ap.add_argument("--beta", type=float, default=0.0, help="KL to a frozen copy of the start")
    ap.add_argument("--max-completion-length", type=int, default=6)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/trl_grpo")
    return ap.parse_args(argv)


def main(argv=None):
    from tonp_models.integrations.tokenizer import byte_tokenizer
    from tonp_models.integrations.trl import TonpGRPOTrainer, tonp_grpo_config
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    if args.init:
        model = Qwen3MoeForCausalLM.from_pretrained(args.init)
        if os.path.exists(os.path.join(args.init, "tokenizer.json")):
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(args.init)
        else:
            tok = byte_tokenizer()
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig.preset("tiny"))
        tok = byte_tokenizer()
    config = tonp_grpo_config(
        output_dir=args.out, per_device_train_batch_size=args.batch,
        num_generations=args.num_generations, num_iterations=args.num_iterations,
        beta=args.beta, max_completion_length=args.max_completion_length,
        temperature=args.temperature, learning_rate=args.lr, max_steps=args.steps,
        logging_steps=1, save_strategy="no", report_to="none", seed=args.seed,
        disable_tqdm=True)
    trainer = TonpGRPOTrainer(model, reward_funcs=copy_reward, args=config,
                              train_dataset=copy_task(256, args.seed), processing_class=tok,
                              generator=args.server)
    with tk.use(args.mode):
        trainer.train()
    rows = [{"step": r["step"], "reward": r.get("reward"),
             **{k: r[v] for k, v in METRICS.items() if v in r}}
            for r in trainer.state.log_history if "loss" in r]
    if trainer.accelerator.is_main_process:
        for r in rows:
            print(json.dumps(r))
        worst = [r for r in rows if "logdiff_max" in r]
        exact = all(r["logdiff_max"] == 0.0 and r["ratio_min"] == r["ratio_max"] == 1.0
                    for r in worst)
        print(f"trl_grpo[{args.mode}]: {len(worst)} generations, logdiff 0.0 and ratio 1.0 at "
              f"every one: {exact}")
    return rows


if __name__ == "__main__":
    main()
