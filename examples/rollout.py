"""Roll out prompts with tonp's generator and write JSONL (token ids, fp32 logprobs).

    python examples/rollout.py --preset tiny --prompt "Hello" --prompt "The sky is" \\
        --max-new-tokens 32 --temperature 1.0 --out out/rollouts.jsonl
    python examples/rollout.py --hf path/to/Qwen3-30B-A3B --prompts-file prompts.jsonl --dtype bf16
    python examples/rollout.py --preset tiny --token-ids 1,2,3 --token-ids 7,8
    torchrun --nproc-per-node 4 examples/rollout.py --tp 2 --ep 2 --preset tiny --token-ids 1,2,3

Prompts: --prompt TEXT (repeatable), --token-ids I,J,K (repeatable), or --prompts-file (JSONL
lines with "prompt" (text) or "token_ids", or plain text, one prompt a line). Text is tokenized by
the checkpoint's tokenizer.json when --hf has one, else as UTF-8 bytes (ids 0..255); the config's
bos_token_id goes first unless --no-bos.
Each output line: {"index", "prompt_ids", "completion_ids", "logprobs", "finish_reason"} plus
"completion" (decoded text) when a tokenizer was used. The logprobs are what
`model.token_logprobs(prompt_ids + completion_ids, temperature=T)` gives, bit for bit, in the
invariant kernel mode, at any --tp / --ep (under torchrun every rank rolls out every prompt in
lockstep, as TP and EP need; global rank 0 writes the output).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tonp_kernels as tk  # noqa: E402
from tonp_models import Qwen3MoeConfig, Qwen3MoeForCausalLM, generate  # noqa: E402

from common import DTYPES, load_tokenizer  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--hf", metavar="PATH", help="HF Qwen3-MoE checkpoint directory")
    src.add_argument("--preset", default="tiny", help="config preset with random weights")
    p.add_argument("--weights-seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--mode", choices=tk.MODES, default="invariant", help="kernel mode")
    p.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    p.add_argument("--token-ids", action="append", default=[],
                   help="a prompt as comma-separated token ids (repeatable)")
    p.add_argument("--prompts-file", help="JSONL ({'prompt': text} or {'token_ids': [...]}) "
                   "or plain text, one prompt a line")
    p.add_argument("--no-bos", action="store_true", help="do not prepend bos to text prompts")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--eos", type=int, action="append", default=None,
                   help="eos token id (repeatable; default: the config's)")
    p.add_argument("--max-batch-size", type=int, default=None)
    p.add_argument("--num-pages", type=int, default=None, help="KV-cache pages (default: enough)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree")
    p.add_argument("--out", default="-", help="output JSONL path ('-' = stdout)")
    p.add_argument("--progress", action="store_true", help="show a progress bar")
    return p.parse_args(argv)


def load_model(args) -> Qwen3MoeForCausalLM:
    """The model, sharded by --tp / --ep under torchrun (tonp_parallel.init_parallel)."""
    import tonp_parallel as tpar
    groups = tpar.init_parallel(tp=args.tp, ep=args.ep)
    args.rank = groups.rank
    groups = groups if groups.world_size > 1 else None
    dtype = DTYPES[args.dtype]
    if args.hf:
        return Qwen3MoeForCausalLM.from_pretrained(args.hf, dtype=dtype, groups=groups).eval()
    torch.manual_seed(args.weights_seed)  # every rank draws the full weights and keeps its shard
    return Qwen3MoeForCausalLM(Qwen3MoeConfig.preset(args.preset), dtype=dtype,
                               groups=groups).eval()


def read_prompts(args, tokenizer) -> List[List[int]]:
    """Every prompt as token ids, in the order: --prompt, --token-ids, --prompts-file."""
    bos = [] if args.no_bos or tokenizer.bos_id is None else [tokenizer.bos_id]
    encode = lambda text: bos + tokenizer.encode(text)  # noqa: E731
    ids = [encode(t) for t in args.prompt]
    for s in args.token_ids:
        try:
            ids.append([int(x) for x in s.split(",") if x.strip()])
        except ValueError:
            raise SystemExit(f"rollout.py: --token-ids {s!r} is not comma-separated integers")
    if args.prompts_file:
        with open(args.prompts_file) as f:
            for n, line in enumerate(f, 1):
                line = line.rstrip("\n")
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    obj = line
                if isinstance(obj, dict) and "token_ids" in obj:
                    ids.append([int(x) for x in obj["token_ids"]])
                elif isinstance(obj, dict) and "prompt" in obj:
                    ids.append(encode(obj["prompt"]))
                elif isinstance(obj, str):
                    ids.append(encode(obj))
                else:
                    raise SystemExit(f"rollout.py: {args.prompts_file}:{n}: expected a JSON object "
                                     f"with 'prompt' or 'token_ids', or a line of text")
    if not ids:
        raise SystemExit("rollout.py: no prompts (use --prompt, --token-ids or --prompts-file)")
    return ids


def main(argv=None) -> int:
    args = parse_args(argv)
    model = load_model(args)
    tokenizer = load_tokenizer(args.hf, model.config)
    prompts = read_prompts(args, tokenizer)
    eos = args.eos if args.eos is not None else model.config.eos_token_id
    with tk.use(args.mode):
        out = generate(model, prompts, args.max_new_tokens, eos_token_id=eos,
                       temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                       seed=args.seed, max_batch_size=args.max_batch_size,
                       num_pages=args.num_pages, progress=args.progress)
    if args.rank != 0:
        return 0
    dest = sys.stdout if args.out == "-" else None
    if dest is None:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        dest = open(args.out, "w")
    try:
        for i, (seq, lp, p) in enumerate(zip(out.sequences, out.logprobs, out.prompt_lengths)):
            row = dict(index=i, prompt_ids=seq[:p].tolist(), completion_ids=seq[p:].tolist(),
                       logprobs=lp.tolist(), finish_reason=out.finish_reasons[i])
            if args.prompt or args.prompts_file:
                row["completion"] = tokenizer.decode(seq[p:].tolist())
            dest.write(json.dumps(row) + "\n")
    finally:
        if dest is not sys.stdout:
            dest.close()
    s = out.stats
    print(f"rollout.py: {len(prompts)} requests, {s.new_tokens} new tokens in {s.seconds:.2f}s "
          f"({s.new_tokens_per_s:.0f} tok/s, {s.forward_steps} forwards, {s.preemptions} "
          f"preemptions), mode={args.mode}" + ("" if args.out == "-" else f" -> {args.out}"),
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
