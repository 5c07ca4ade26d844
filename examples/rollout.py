"""Roll out prompts with tonp's generator and write JSONL (token ids, fp32 logprobs).

    python examples/rollout.py --preset tiny --prompt "Hello" --prompt "The sky is" \\
        --max-new-tokens 32 --temperature 1.0 --out out/rollouts.jsonl
    python examples/rollout.py --hf path/to/Qwen3-30B-A3B --prompts-file prompts.jsonl --dtype bf16
    python examples/rollout.py --preset tiny --token-ids 1,2,3 --token-ids 7,8
    torchrun --nproc-per-node 4 examples/rollout.py --tp 2 --ep 2 --preset tiny --token-ids 1,2,3
    torchrun --nproc-per-node 2 examples/rollout.py --pp 2 --micro-batches 4 --preset tiny ...

Prompts: --prompt TEXT, --token-ids I,J,K (both repeatable), --prompts-file: JSONL (one
{"prompt": text} or {"token_ids": [ints]} a line; a .jsonl/.json file or a first line starting
with "{") or plain text (one prompt a line). Text is tokenized by the checkpoint's tokenizer.json
when --hf has one, else as UTF-8 bytes; the config's bos_token_id goes first unless --no-bos.
Each output line: {"index", "prompt_ids", "completion_ids", "logprobs", "finish_reason"}
(+ "completion" text for text prompts). The logprobs are what `model.token_logprobs` gives
for prompt + completion, bit for bit, at any --tp / --ep / --pp / --sp (global rank 0 writes;
under --pp each decode step's sequences go through the stages in --micro-batches groups).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Tuple

import torch

from tonp_models import PRESETS, Qwen3MoeConfig, Qwen3MoeForCausalLM, generate
from tonp_models.training import load_tokenizer
from tonp_models.training.cli import (DTYPES, add_launch_args, launch, non_negative_float,
                                      non_negative_int, positive_int, run_script)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--hf", metavar="PATH", help="HF Qwen3-MoE checkpoint directory")
    src.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                     help="config preset with random weights")
    p.add_argument("--weights-seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    p.add_argument("--token-ids", action="append", default=[],
                   help="a prompt as comma-separated token ids (repeatable)")
    p.add_argument("--prompts-file", help="JSONL ({'prompt': text} or {'token_ids': [...]}) "
                   "or plain text, one prompt a line")
    p.add_argument("--prompts-format", choices=["auto", "jsonl", "text"], default="auto",
                   help="how to read --prompts-file (auto: JSONL for .jsonl/.json or a first "
                        "line starting with '{', else text)")
    p.add_argument("--no-bos", action="store_true", help="do not prepend bos to text prompts")
    p.add_argument("--max-new-tokens", type=positive_int, default=32)
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=positive_int, default=None)
    p.add_argument("--top-p", type=non_negative_float, default=None)
    p.add_argument("--seed", type=non_negative_int, default=0, help="sampling seed")
    p.add_argument("--eos", type=non_negative_int, action="append", default=None,
                   help="eos token id (repeatable; default: the config's)")
    p.add_argument("--max-batch-size", type=positive_int, default=None)
    p.add_argument("--num-pages", type=positive_int, default=None,
                   help="KV-cache pages (default: enough)")
    p.add_argument("--out", default="-", help="output JSONL path ('-' = stdout)")
    p.add_argument("--progress", action="store_true", help="show a progress bar")
    add_launch_args(p)
    return p.parse_args(argv)


def load_model(args, groups) -> Qwen3MoeForCausalLM:
    """The model, sharded by --tp / --ep under torchrun."""
    groups = groups if groups.world_size > 1 else None
    dtype = DTYPES[args.dtype]
    if args.hf:
        return Qwen3MoeForCausalLM.from_pretrained(args.hf, dtype=dtype, groups=groups).eval()
    torch.manual_seed(args.weights_seed)  # every rank draws the full weights and keeps its shard
    return Qwen3MoeForCausalLM(Qwen3MoeConfig.preset(args.preset), dtype=dtype,
                               groups=groups).eval()


def _token_ids(value, where: str, vocab_size: int) -> List[int]:
    """A non-empty list of int token ids in [0, vocab_size), or ValueError naming `where`."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: token_ids must be a non-empty list of integers, got "
                         f"{json.dumps(value)[:80]}")
    for j, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int):
            raise ValueError(f"{where}: token_ids[{j}] = {t!r} is not an integer")
        if not 0 <= t < vocab_size:
            raise ValueError(f"{where}: token_ids[{j}] = {t} is outside the vocabulary "
                             f"[0, {vocab_size})")
    return value


def _file_prompts(path: str, fmt: str) -> List[Tuple[str, object]]:
    """(where, text | {"prompt"/"token_ids": ...}) for every non-empty line of the prompts file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--prompts-file {path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            lines = [(n, line.rstrip("\r\n")) for n, line in enumerate(f, 1) if line.strip()]
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompts-file {path} is not UTF-8 text ({e})") from e
    if fmt == "auto":
        jsonl = path.endswith((".jsonl", ".json")) or (lines and lines[0][1].lstrip()[:1] == "{")
        fmt = "jsonl" if jsonl else "text"
    if fmt == "text":
        return [(f"{path}:{n}", line) for n, line in lines]
    out = []
    for n, line in lines:
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e}); a JSONL prompts file holds one "
                             f"object a line (--prompts-format text reads plain lines)") from e
        keys = set(obj) & {"prompt", "token_ids"} if isinstance(obj, dict) else set()
        if len(keys) != 1:
            raise ValueError(f"{where}: expected a JSON object with exactly one of 'prompt' "
                             f"(text) or 'token_ids' (integers), got {line.strip()[:80]}")
        if "prompt" in keys and not isinstance(obj["prompt"], str):
            raise ValueError(f"{where}: 'prompt' must be a string, got "
                             f"{type(obj['prompt']).__name__} {json.dumps(obj['prompt'])[:40]}")
        out.append((where, obj))
    return out


def read_prompts(args, tokenizer, vocab_size: int) -> Tuple[List[List[int]], List[bool]]:
    """Every prompt as token ids (in the order --prompt, --token-ids, --prompts-file) and
    whether it was text (its completion is decoded into the output)."""
    bos = [] if args.no_bos or tokenizer.bos_id is None else [tokenizer.bos_id]
    sources: List[Tuple[str, object]] = [("--prompt", {"prompt": t}) for t in args.prompt]
    for s in args.token_ids:
        try:
            ids = [int(x) for x in s.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--token-ids {s!r} is not comma-separated integers") from None
        sources.append((f"--token-ids {s!r}", {"token_ids": ids}))
    if args.prompts_file:
        sources += _file_prompts(args.prompts_file, args.prompts_format)
    prompts, is_text = [], []
    for where, obj in sources:
        if isinstance(obj, str) or "prompt" in obj:
            ids = bos + tokenizer.encode(obj if isinstance(obj, str) else obj["prompt"])
            if not ids:
                raise ValueError(f"{where}: the prompt is empty (and there is no bos)")
            prompts.append(_token_ids(ids, where, vocab_size))
        else:
            prompts.append(_token_ids(obj["token_ids"], where, vocab_size))
        is_text.append(isinstance(obj, str) or "prompt" in obj)
    if not prompts:
        raise ValueError("no prompts (use --prompt, --token-ids or --prompts-file)")
    return prompts, is_text


def output_rows(out, is_text: List[bool], tokenizer) -> List[Dict]:
    """The JSONL rows; ValueError (nothing written) when a logprob is not finite: NaN or inf
    are not JSON, and a rollout with them is unusable for training."""
    rows = []
    for i, (seq, lp, p) in enumerate(zip(out.sequences, out.logprobs, out.prompt_lengths)):
        bad = (~torch.isfinite(lp)).nonzero().flatten()
        if len(bad):
            j = int(bad[0])
            raise ValueError(f"request {i}: the logprob of completion token {j} is "
                             f"{float(lp[j])}, not finite ({len(bad)} such tokens); refusing to "
                             f"write it (check --temperature and the weights)")
        row = dict(index=i, prompt_ids=seq[:p].tolist(), completion_ids=seq[p:].tolist(),
                   logprobs=lp.tolist(), finish_reason=out.finish_reasons[i])
        if is_text[i]:
            row["completion"] = tokenizer.decode(seq[p:].tolist())
        rows.append(row)
    return rows


def write_jsonl(rows: List[Dict], path: str) -> None:
    """One strict-JSON line per row into `path` ('-' = stdout)."""
    lines = [json.dumps(r, allow_nan=False) + "\n" for r in rows]
    if path == "-":
        sys.stdout.writelines(lines)
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(lines)


def main(argv=None) -> int:
    return launch(parse_args(argv), _run)


def _run(args, groups) -> int:
    model = load_model(args, groups)
    model.pipeline_micro_batches = args.micro_batches
    tokenizer = load_tokenizer(args.hf, model.config)
    prompts, is_text = read_prompts(args, tokenizer, model.config.vocab_size)
    eos = args.eos if args.eos is not None else model.config.eos_token_id
    out = generate(model, prompts, args.max_new_tokens, eos_token_id=eos,
                   temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                   seed=args.seed, max_batch_size=args.max_batch_size, num_pages=args.num_pages,
                   progress=args.progress)
    if groups.rank != 0:
        return 0
    write_jsonl(output_rows(out, is_text, tokenizer), args.out)
    s = out.stats
    print(f"rollout.py: {len(prompts)} requests, {s.new_tokens} new tokens in {s.seconds:.2f}s "
          f"({s.new_tokens_per_s:.0f} tok/s, {s.forward_steps} forwards, {s.preemptions} "
          f"preemptions), mode={args.mode}" + ("" if args.out == "-" else f" -> {args.out}"),
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main, "rollout.py"))
