"""Command line: `python -m tonp_models.diagnose`.

    python -m tonp_models.diagnose --preset tiny --paths train:decode --out diag/
    python -m tonp_models.diagnose --hf CKPT --paths invariant:torch --out diag/
    python -m tonp_models.diagnose --hf CKPT --hf-b CKPT2 --paths ckpt:ckpt --out diag/
    torchrun --nproc-per-node 2 -m tonp_models.diagnose --hf CKPT --paths tp=1:tp=2 --out diag/
    torchrun --nproc-per-node 2 -m tonp_models.diagnose --preset tiny --paths train:decode,tp=2,ep=2 \
        --out diag/
    python -m tonp_models.diagnose --hf CKPT --external vllm.jsonl --out diag/

A path is a comma list of: a kind (train | padded | decode), a kernel mode (invariant |
torch), tp=N, ep=N, ckpt[=PATH]; the two paths are joined by ':'. Side B loads --hf-b when
given (or its own ckpt=PATH). Sequences come from --tokens FILE.jsonl ({"token_ids": [...],
"prompt_len": p} per line, or examples/rollout.py's output) or are drawn at random (--num-seqs,
--seq-len, --seed). Writes OUT/diagnosis.txt + .json (and OUT/external.txt, .json, _hist.png)
and prints the text. Bad input: a one-line error on stderr naming file and line, exit code 2.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

from ..qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM
from .compare import compare_traces, differing_parameters
from .external import compare_external, format_external, load_jsonl, write_external_report
from .inputs import load_tokens
from .layout import run_layout
from .paths import PathSpec, run_path
from .report import format_text, write_report

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_PROG = "python -m tonp_models.diagnose"


def _args(argv):
    p = argparse.ArgumentParser(prog=_PROG,
                                description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="a Qwen3MoeConfig preset with random weights (e.g. tiny)")
    src.add_argument("--hf", help="an HF checkpoint directory")
    p.add_argument("--hf-b", help="the checkpoint of path B (for ckpt:ckpt)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), help="default: the checkpoint's")
    p.add_argument("--paths", help="A:B, e.g. train:decode, invariant:torch, ckpt:ckpt, "
                                   "tp=1:tp=2 (default train:decode unless --external alone)")
    p.add_argument("--tokens", help="JSONL with token_ids (and prompt_len) per line")
    p.add_argument("--num-seqs", type=_at_least(1), default=3)
    p.add_argument("--seq-len", type=_at_least(2), default=24)
    p.add_argument("--prompt-len", type=_at_least(1), help="prefill length of the decode path")
    p.add_argument("--seed", type=int, default=0, help="weights (--preset) and random tokens")
    p.add_argument("--external", help="JSONL of another engine's per-token logprobs")
    p.add_argument("--temperature", type=_finite(0, False), default=1.0,
                   help="the temperature of the external logprobs (rollout.py: 1 when greedy)")
    p.add_argument("--threshold", type=_finite(0, True), default=1e-3,
                   help="|logprob diff| above which an external token counts as divergent "
                        "(0: anything not bitwise equal)")
    p.add_argument("--out", required=True, help="output directory")
    a = p.parse_args(argv)
    if a.paths is None and a.external is None:
        a.paths = "train:decode"
    return a


def _at_least(low):
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"{v} is below {low}")
        return v
    return parse


def _finite(low, inclusive):
    def parse(text):
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(v) or v < low or (v == low and not inclusive):
            raise argparse.ArgumentTypeError(f"{text} must be a finite number "
                                             f"{'>=' if inclusive else '>'} {low}")
        return v
    return parse


def _load(path, dtype, groups=None):
    return Qwen3MoeForCausalLM.from_pretrained(path, dtype=dtype, groups=groups)


def _preset(name, seed, dtype):
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig.preset(name), dtype=dtype or torch.float32)


def _sequences(args, vocab):
    if args.tokens:
        seqs, pls = load_tokens(args.tokens, vocab)
        pl = [p if p is not None else max(1, len(s) // 2) for p, s in zip(pls, seqs)]
        return seqs, (pl if args.prompt_len is None else [args.prompt_len])
    g = torch.Generator().manual_seed(args.seed)
    lens = [max(2, args.seq_len - 3 * i) for i in range(args.num_seqs)]  # ragged on purpose
    seqs = [torch.randint(0, vocab, (n,), generator=g) for n in lens]
    return seqs, None if args.prompt_len is None else [args.prompt_len]


def _distributed(specs) -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 or any(s.tp * s.ep > 1 for s in specs)


def main(argv=None) -> int:
    args = _args(argv)
    try:
        return _main(args)
    except (ValueError, TypeError, IndexError, OSError) as e:  # bad input: one line, no trace
        msg = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.strerror else str(e)
        print(f"{_PROG}: error: {msg}", file=sys.stderr)
        return 2


def _main(args) -> int:
    dtype = _DTYPES.get(args.dtype)
    specs = [PathSpec.parse(s) for s in args.paths.split(":")] if args.paths else []
    if args.paths and len(specs) != 2:
        raise ValueError(f"--paths takes two paths joined by ':', got {args.paths!r}")
    if args.paths and specs[0].label == specs[1].label and not args.hf_b and \
            not specs[1].ckpt:
        raise ValueError(f"--paths {args.paths}: both sides are the same path; a checkpoint "
                         f"comparison needs --hf-b (or ckpt=PATH)")
    external = load_jsonl(args.external) if args.external else None  # before any model work
    if args.tokens:
        load_tokens(args.tokens)
    os.makedirs(args.out, exist_ok=True)
    if specs and _distributed(specs):
        return _main_distributed(args, specs, dtype, external)
    model_a = _preset(args.preset, args.seed, dtype) if args.preset else _load(args.hf, dtype)
    seqs, pls = _sequences(args, model_a.config.vocab_size)
    if specs:
        b_path = specs[1].ckpt or args.hf_b
        model_b = _load(b_path, dtype) if b_path else model_a
        la, lb = specs[0].label, specs[1].label
        if la == lb:
            la, lb = f"{la} ({args.hf or args.preset})", f"{lb} ({b_path})"
        traces = [run_path(m, seqs, s.kind, mode=s.mode, prompt_lens=pls, label=lab)
                  for m, s, lab in ((model_a, specs[0], la), (model_b, specs[1], lb))]
        diag = compare_traces(*traces, differing_parameters(model_a, model_b))
        write_report(diag, args.out)
        print(format_text(diag))
    if args.external:
        rep = compare_external(model_a, external, temperature=args.temperature,
                               threshold=args.threshold)
        paths = write_external_report(rep, args.out)
        print(format_external(rep))
        print(f"histogram: {paths['png']}")
    return 0


def _main_distributed(args, specs, dtype, external) -> int:
    """Every rank runs both paths (TP/EP layouts via tonp_parallel); rank 0 compares."""
    import tonp_parallel as tpar
    import torch.distributed as dist
    tpar.init_parallel()  # initialises torch.distributed from torchrun's environment
    ckpt = args.hf
    if args.preset:  # layouts load shards from a checkpoint: write the preset's weights once
        ckpt = os.path.join(args.out, "_preset_checkpoint")
        if dist.get_rank() == 0:
            _preset(args.preset, args.seed, dtype).save_pretrained(ckpt)
        dist.barrier()
    vocab = Qwen3MoeConfig.from_hf(ckpt).vocab_size
    seqs, pls = _sequences(args, vocab)
    if specs[1].ckpt is None and args.hf_b:
        specs[1].ckpt = args.hf_b
    traces = [run_layout(ckpt, seqs, s, dtype=dtype, prompt_lens=pls, label=f"{s.label} ({n})")
              for s, n in zip(specs, "AB")]
    if dist.get_rank() == 0:
        diag = compare_traces(*traces)
        diag.meta["world_size"] = dist.get_world_size()
        write_report(diag, args.out)
        print(format_text(diag))
    if args.external and dist.get_rank() == 0:
        rep = compare_external(_load(ckpt, dtype), external, temperature=args.temperature,
                               threshold=args.threshold)
        write_external_report(rep, args.out)
        print(format_external(rep))
    dist.barrier()
    tpar.destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
