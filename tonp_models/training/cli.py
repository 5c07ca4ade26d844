"""What the example scripts share: their common flags, process-group setup with a timeout,
clean error exits, and `run_supervised` (the one loop pretrain.py and finetune.py run).

    ap = argparse.ArgumentParser(); add_launch_args(ap); add_training_args(ap, steps=200, ...)
    sys.exit(run_script(main, "pretrain.py"))   # user errors: one line on stderr, exit 1

A resume keeps the hyper-parameters the checkpoint was trained with: the flags in
SUPERVISED_FIXED (and each script's own) are recorded in its meta.json and a resume with another
value is refused, naming the flag; --steps is applied (the schedule's end moves, said in the log).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
from typing import Any, Callable, Dict, Optional, Sequence

import torch

import tonp_kernels as tk
import tonp_parallel as tpar

from ..qwen3_moe import PRESETS, Qwen3MoeConfig
from .checkpoints import CheckpointError
from .loop import fit
from .metrics import plot_curves
from .peers import peer_failure, register_peers
from .rundir import prepare_out_dir
from .trainer import Trainer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "vocab.json", "merges.txt")
# Errors a user's input causes (bad values, files, checkpoints), and a pipeline stage that
# failed on another rank (that rank says why): one clean line. Peers that die: `peer_failure`.
USER_ERRORS = (ValueError, TypeError, OSError, CheckpointError, FloatingPointError,
               torch.distributed.DistError, tpar.StageFailed)
# Flags a supervised checkpoint fixes (a resume with another value is refused, naming the flag);
# the scripts add their data flags. Not recorded, so free on resume: --steps (applied: the
# schedule's end moves), --eval-every, --save-every, --keep-last, --stop-after, --threads, ...
SUPERVISED_FIXED = ("lr", "min_lr_ratio", "warmup", "weight_decay", "grad_clip", "batch_size",
                    "seed", "micro_batches", "mode", "numerics")
PATH_FLAGS = ("data",)                  # recorded as absolute paths


# -- argument types -------------------------------------------------------------------------------
def _number(kind, test, rule):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{rule}, got {text!r}") from None
        if not test(v):
            raise argparse.ArgumentTypeError(f"{rule}, got {text!r}")
        return v
    parse.__name__ = rule
    return parse


positive_int = _number(int, lambda v: v >= 1, "must be an integer >= 1")
non_negative_int = _number(int, lambda v: v >= 0, "must be an integer >= 0")
non_negative_float = _number(float, lambda v: math.isfinite(v) and v >= 0,
                             "must be a finite number >= 0")
positive_float = _number(float, lambda v: math.isfinite(v) and v > 0,
                         "must be a finite number > 0")
fraction = _number(float, lambda v: 0 <= v < 1, "must be a number in [0, 1)")


def int_list(text: str):
    """"13,12,12,11" -> (13, 12, 12, 11): positive ints, comma-separated."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers >= 1 (layers per "
                                         f"pipeline stage), got {text!r}")
    return values


int_list.__name__ = "layers per stage"


def add_launch_args(ap: argparse.ArgumentParser) -> None:
    """--tp, --ep, --pp, --cp, --sp, --pp-layers, --micro-batches, --threads, --mode, --device,
    --numerics, --dist-timeout."""
    ap.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel degree")
    ap.add_argument("--ep", type=positive_int, default=1, help="expert-parallel degree")
    ap.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel degree")
    ap.add_argument("--cp", type=positive_int, default=1, help="context-parallel degree")
    ap.add_argument("--sp", action="store_true",
                    help="sequence parallelism over the TP group (Megatron's)")
    ap.add_argument("--pp-layers", type=int_list, default=None, metavar="N,N,...",
                    help="layers per pipeline stage, e.g. 13,12,12,11 (default: even split, "
                         "the first stages one longer)")
    ap.add_argument("--micro-batches", type=positive_int, default=None,
                    help="micro-batches per training step (default: the pp degree; 1F1B "
                         "schedule under --pp)")
    ap.add_argument("--threads", type=positive_int, default=None,
                    help="torch threads (default: as set)")
    ap.add_argument("--mode", choices=tk.MODES, default="invariant", help="tonp kernel mode")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda", "npu"), default="auto",
                    help="where the model runs (auto: LOCAL_RANK's GPU / NPU under torchrun "
                         "with NCCL / HCCL, else the CPU; cuda / npu: that device in one "
                         "process too)")
    ap.add_argument("--numerics", choices=tk.NUMERICS, default="exact",
                    help="numerics of the accelerator kernels: exact (the CPU's bits) or fast "
                         "(tensor cores; invariant within one device model)")
    ap.add_argument("--dist-timeout", type=positive_float, default=600.0, metavar="SECONDS",
                    help="under torchrun: how long a collective waits for a stalled rank before "
                         "every rank fails (default %(default)s)")


def add_config_args(ap: argparse.ArgumentParser) -> None:
    """--preset, --config, --set KEY=VALUE (see `load_config`)."""
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                    help="Qwen3MoeConfig preset (default tiny)")
    ap.add_argument("--config", help="an HF config.json (or checkpoint dir) instead of --preset")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config field, e.g. --set num_hidden_layers=2 (repeatable)")


def add_training_args(ap: argparse.ArgumentParser, *, steps: int, batch_size: int, lr: float,
                      warmup: int, weight_decay: float, keep_last: int, what: str) -> None:
    """The flags of `run_supervised`: output, schedule, optimizer, eval, checkpoints, resume."""
    ap.add_argument("--out", default=f"out/{what}", help="output directory")
    ap.add_argument("--steps", type=positive_int, default=steps)
    ap.add_argument("--batch-size", type=positive_int, default=batch_size,
                    help="examples per rank per step")
    ap.add_argument("--lr", type=non_negative_float, default=lr)
    ap.add_argument("--min-lr-ratio", type=_number(float, lambda v: 0 <= v <= 1,
                                                   "must be a number in [0, 1]"), default=0.1)
    ap.add_argument("--warmup", type=non_negative_int, default=warmup)
    ap.add_argument("--weight-decay", type=non_negative_float, default=weight_decay)
    ap.add_argument("--grad-clip", type=non_negative_float, default=1.0,
                    help="max global grad norm (0 = off)")
    ap.add_argument("--eval-every", type=non_negative_int, default=25)
    ap.add_argument("--save-every", type=non_negative_int, default=50)
    ap.add_argument("--keep-last", type=positive_int, default=keep_last)
    ap.add_argument("--resume", nargs="?", const="latest", default=None,
                    help="continue from a checkpoint dir, or the latest under <out>/ckpt")
    add_overwrite_arg(ap)
    ap.add_argument("--stop-after", type=positive_int, default=None,
                    help="stop (with a checkpoint) after this step, as if interrupted")
    ap.add_argument("--no-export", action="store_true", help="skip the HF export at the end")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true")


def add_overwrite_arg(ap: argparse.ArgumentParser) -> None:
    """--overwrite (see `rundir.prepare_out_dir`)."""
    ap.add_argument("--overwrite", action="store_true",
                    help="start afresh in an --out that holds a run: delete its checkpoints, "
                         "metrics, curves and HF export first (without it such a start is "
                         "refused)")


def fixed_flags(args, names: Sequence[str]) -> Dict[str, Any]:
    """{"--lr": 0.005, ...}: the values of the flags `names` (attribute names), for meta.json."""
    return {"--" + n.replace("_", "-"): os.path.abspath(getattr(args, n))
            if n in PATH_FLAGS and getattr(args, n) is not None else getattr(args, n)
            for n in names}


def parse_overrides(items: Sequence[str]) -> Dict[str, object]:
    """["num_hidden_layers=1", "rope_theta=1e4"] -> {"num_hidden_layers": 1, "rope_theta": 1e4}
    (values parsed as JSON when they are JSON, else kept as strings)."""
    out: Dict[str, object] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def load_config(args) -> Qwen3MoeConfig:
    """--config (an HF config.json or checkpoint dir) or --preset, with the --set overrides."""
    overrides = parse_overrides(args.set)
    fields = set(Qwen3MoeConfig.__dataclass_fields__)
    unknown = sorted(k for k in overrides if k not in fields)
    if unknown:
        raise ValueError(f"--set: {', '.join(unknown)} is not a Qwen3MoeConfig field")
    if not getattr(args, "config", None):
        return Qwen3MoeConfig.preset(args.preset, **overrides)
    return Qwen3MoeConfig.from_hf(args.config, **overrides)  # names the file on bad JSON


# -- running --------------------------------------------------------------------------------------
def launch(args, body: Callable[[Any, tpar.ParallelGroups], Any]) -> Any:
    """Thread count, process groups (torchrun or one process, --dist-timeout), the device
    (groups.device: the Trainer moves the model there) and the kernel mode, then
    body(args, groups)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if max(args.tp, args.ep, args.pp, args.cp) > 1 and "WORLD_SIZE" not in os.environ \
            and not torch.distributed.is_initialized():
        raise ValueError(f"--tp {args.tp} --ep {args.ep} --pp {args.pp} --cp {args.cp} needs "
                         f"several processes: launch with torchrun --nproc-per-node N (N a "
                         f"multiple of tp x cp x pp and of pp x ep)")
    groups = tpar.init_parallel(tp=args.tp, ep=args.ep, pp=args.pp, cp=args.cp, sp=args.sp,
                                pp_layers=args.pp_layers, timeout=args.dist_timeout)
    device = getattr(args, "device", "auto")
    if device not in ("auto", groups.device.type):
        local = int(os.environ.get("LOCAL_RANK", "0")) if device != "cpu" else None
        groups = dataclasses.replace(groups, device=torch.device(device, local))
    if args.micro_batches is None:
        args.micro_batches = groups.pp_size
    register_peers(groups)
    with tk.use(args.mode, numerics=getattr(args, "numerics", "exact")):
        return body(args, groups)


def prepare_run_dir(args, groups, can_resume: bool = True) -> None:
    """`rundir.prepare_out_dir` from --out, --resume and --overwrite (before the run writes)."""
    prepare_out_dir(args.out, resume=getattr(args, "resume", None), overwrite=args.overwrite,
                    groups=groups, can_resume=can_resume)


def layout_meta(groups) -> Dict[str, Any]:
    """The layout a checkpoint was written at (a resume must match it)."""
    return {"tp": groups.tp_size, "ep": groups.ep_size, "dp": groups.dp_size,
            "pp": groups.pp_size, "cp": groups.cp_size, "sp": groups.sequence_parallel,
            "pp_layers": list(groups.pp_layers) if groups.pp_layers else None}


def run_script(main: Callable[[Optional[Sequence[str]]], Any], prog: str,
               argv: Optional[Sequence[str]] = None) -> int:
    """main(argv); a user error (bad value, missing or bad file, mismatched checkpoint) or a
    collective that failed because a peer rank died or stalled (`peers.peer_failure`) prints
    `prog: error: ...` (one line) on stderr and returns 1 instead of a traceback
    (TONP_TRACEBACK=1 shows it). When main initialised torch.distributed, its groups end here
    (`tpar.destroy_parallel`), not in the interpreter's teardown."""
    started = torch.distributed.is_initialized()
    try:
        main(argv)
        if not started:
            tpar.destroy_parallel()
        return 0
    except Exception as e:
        if os.environ.get("TONP_TRACEBACK"):
            raise
        line = peer_failure(e)
        if line is None and not isinstance(e, USER_ERRORS):
            raise
        print(f"{prog}: error: {line or e}", file=sys.stderr)
        return 1


def export_hf(model, path: str, groups, files_from: Optional[str] = None) -> str:
    """`model.save_pretrained(path)` (+ the tokenizer files of `files_from`). Under TP/EP/PP
    every rank takes part (shards and stages are gathered, global rank 0 writes); otherwise
    rank 0 alone."""
    if model.parameter_shards() or model.pipelined or groups.rank == 0:
        model.save_pretrained(path)
    if files_from and groups.rank == 0:
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(files_from, name)):
                shutil.copy(os.path.join(files_from, name), path)
    return path


def run_supervised(args, groups, model, sampler, loss_fn, *, meta: Dict[str, Any], name: str,
                   eval_fn: Optional[Callable[[], float]] = None,
                   files_from: Optional[str] = None, fixed: Sequence[str] = ()) -> Dict[str, Any]:
    """The run pretrain.py and finetune.py share: a Trainer from the flags of
    `add_training_args`, `fit`, the HF export (when the run reached --steps), the curves PNG
    and a summary line. meta: the run's identity; the flags SUPERVISED_FIXED + `fixed` join it
    (meta["flags"]), so a resume must match them too. Call `prepare_out_dir` first.
    Returns fit's dict plus "model", "out", "hf", "png"."""
    meta = {**meta, "flags": fixed_flags(args, SUPERVISED_FIXED + tuple(fixed))}
    trainer = Trainer(model, groups, lr=args.lr, weight_decay=args.weight_decay,
                      warmup=args.warmup, total_steps=args.steps, min_lr_ratio=args.min_lr_ratio,
                      grad_clip=args.grad_clip, ckpt_dir=os.path.join(args.out, "ckpt"),
                      keep_last=args.keep_last, meta=meta)
    out = fit(trainer, sampler, loss_fn, steps=args.steps, out_dir=args.out, resume=args.resume,
              stop_after=args.stop_after, eval_fn=eval_fn, eval_every=args.eval_every,
              save_every=args.save_every, desc=name, progress=not args.no_progress)
    out.update(model=model, out=args.out)
    if out["step"] == args.steps and not args.no_export:
        out["hf"] = export_hf(model, os.path.join(args.out, "hf"), groups, files_from)
    if groups.rank == 0 and os.path.exists(out["metrics"]):
        out["png"] = plot_curves(out["metrics"], os.path.join(args.out, "curves.png"),
                                 ["loss", "eval_loss", "lr", "grad_norm", "tokens_per_s"],
                                 title=name)
        losses = out["losses"]
        if losses:
            print(f"loss {losses[min(losses)]:.3f} -> {losses[max(losses)]:.3f} over steps "
                  f"{min(losses)}..{max(losses)}; outputs in {args.out}")
    return out
