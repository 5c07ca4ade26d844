"""One run per output directory: a new run never lands on an old run's history.

    prepare_out_dir(args.out, resume=args.resume, overwrite=args.overwrite, groups=groups)

A run's history in `out` is its complete checkpoints (`out/ckpt`) and a non-empty
`out/metrics.jsonl`. Starting afresh over it would truncate the metrics, let the old run's
higher steps prune the new run's checkpoints, and make a later resume continue the old run, so
it is refused unless the caller asks for `overwrite` (which deletes RUN_OUTPUTS first). Resuming
from an older checkpoint of `out` than its newest, or from another run's checkpoint into an `out`
with a history, is refused for the same reason. Details: docs/training.md.
"""
from __future__ import annotations

import os
import shutil
from typing import List, Optional

from .checkpoints import CheckpointManager

# What a run writes into its --out (and --overwrite deletes): nothing else there is touched.
RUN_OUTPUTS = ("ckpt", "metrics.jsonl", "tb", "curves.png", "hf")
_TRASH = ".overwritten-"


def history(out: str) -> List[str]:
    """What a previous run left in `out`: its complete checkpoints, a non-empty metrics.jsonl."""
    found = []
    done = CheckpointManager(os.path.join(out, "ckpt")).complete()
    if done:
        found.append(f"{len(done)} checkpoint{'s' * (len(done) > 1)} up to "
                     f"{os.path.basename(done[-1])}")
    metrics = os.path.join(out, "metrics.jsonl")
    if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
        found.append("metrics.jsonl")
    return found


def _inside(path: str, root: str) -> bool:
    path, root = os.path.abspath(path), os.path.abspath(root)
    return path == root or path.startswith(root + os.sep)


def out_dir_problem(out: str, resume: Optional[str], overwrite: bool,
                    can_resume: bool = True) -> Optional[str]:
    """Why a run may not start in `out` as asked (one line naming the directory and the ways
    on), or None. resume: None, "latest" or a checkpoint directory."""
    if os.path.exists(out) and not os.path.isdir(out):
        return f"--out {out} is a file, not a directory"
    ckpt = os.path.join(out, "ckpt")
    if resume == "latest" or (resume and _inside(resume, ckpt)):       # continuing this run
        if overwrite:
            return (f"--overwrite would delete the checkpoints in {ckpt} that --resume "
                    f"continues from: pass one of the two")
        done = [os.path.abspath(p) for p in CheckpointManager(ckpt).complete()]
        if resume != "latest" and os.path.abspath(resume) in done[:-1]:
            return (f"--resume {resume} is not the newest checkpoint in {ckpt} "
                    f"({os.path.basename(done[-1])} is): going on from it would mix the steps "
                    f"after it with the new ones; pass --resume alone for the newest, or resume "
                    f"from it into another --out")
        return None
    found = history(out)
    if not found or overwrite:
        return None
    ways = ("--overwrite to delete its checkpoints and metrics first, or choose another --out"
            if resume or not can_resume else
            "--resume to continue it, or --overwrite to delete its checkpoints and metrics "
            "first (or choose another --out)")
    what = f"; --resume {resume} is another run's checkpoint" if resume else ""
    return f"--out {out} already holds a run ({', '.join(found)}){what}: pass {ways}"


def prepare_out_dir(out: str, *, resume: Optional[str], overwrite: bool, groups=None,
                    can_resume: bool = True) -> None:
    """Refuse (ValueError, the same on every rank) a run `out_dir_problem` names; with
    `overwrite`, delete the old run's RUN_OUTPUTS in `out` (rank 0; said on stdout) before
    anyone writes. Collective under torchrun: call it on every rank before the run writes."""
    rank = groups.rank if groups is not None else 0
    world = groups.world_size if groups is not None else 1
    problem = out_dir_problem(out, resume, overwrite, can_resume) if rank == 0 else None
    if world > 1:                                  # rank 0 decides, for every rank alike
        import torch.distributed as dist
        box = [problem]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem:
        raise ValueError(problem)
    if overwrite and rank == 0:
        removed = remove_outputs(out)
        if removed:
            print(f"--overwrite: deleted the previous run's {', '.join(removed)} in {out}")
    if world > 1:
        import torch.distributed as dist
        dist.barrier()


def remove_outputs(out: str) -> List[str]:
    """Delete RUN_OUTPUTS in `out`, each renamed away first (gone at once for every reader, a
    crash leaves `.overwritten-*` the next call deletes). Returns the names it deleted."""
    if not os.path.isdir(out):
        return []
    removed = []
    for name in RUN_OUTPUTS:
        path = os.path.join(out, name)
        if os.path.lexists(path):
            os.rename(path, os.path.join(out, _TRASH + name))
            removed.append(name + ("/" if os.path.isdir(os.path.join(out, _TRASH + name))
                                   else ""))
    for name in os.listdir(out):
        if name.startswith(_TRASH):
            path = os.path.join(out, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
    return removed
