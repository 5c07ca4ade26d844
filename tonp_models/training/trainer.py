"""`Trainer`: master weights + AdamW + warmup/cosine + gradient sync + checkpoints, in one object.

    trainer = Trainer(model, groups, lr=3e-3, total_steps=200, ckpt_dir="out/x/ckpt", meta={...})
    start, state = trainer.resume("latest")     # (0, {}) when there is nothing to resume
    for step in range(start, 200):
        trainer.zero_grad(); loss = ...; loss.backward()
        stats = trainer.step()                  # {"lr", "grad_norm"}
        trainer.save(step + 1, extra={"data": sampler.state_dict()})
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

import tonp_parallel as tpar

from ..qwen3_moe import Qwen3MoeForCausalLM
from .checkpoints import CheckpointManager, rng_state, set_rng_state
from .grad_sync import GradSync
from .optim import MasterWeights, build_optimizer, warmup_cosine


def build_model(config, dtype: torch.dtype, groups, seed: int) -> Qwen3MoeForCausalLM:
    """The model initialised from `seed`: each rank holds exactly its shard (and pipeline
    stage) of the weights the single-process model would draw (bad layouts are refused with
    every reason listed)."""
    if groups.world_size > 1:
        tpar.validate_model_layout(config, tp=groups.tp_size, ep=groups.ep_size,
                                   pp=groups.pp_size, cp=groups.cp_size,
                                   pp_layers=groups.pp_layers)
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config, dtype=dtype,
                               groups=groups if groups.world_size > 1 else None)


class Trainer:
    """Model + MasterWeights + AdamW + LambdaLR(warmup_cosine) + GradSync + CheckpointManager.

    The model moves to `groups.device` first (this rank's GPU / NPU, or the CPU).
    Args: model (with `parameter_shards()`), groups (ParallelGroups), lr, weight_decay, betas,
    warmup, total_steps, min_lr_ratio, grad_clip (0 = off), ckpt_dir (None = no checkpoints),
    keep_last, meta (what a resumed checkpoint must match: config, layout, hyper-parameters;
    the checkpoint also records total_steps, which a resume may change: see `resume`).
    """

    def __init__(self, model: torch.nn.Module, groups, *, lr: float, weight_decay: float = 0.0,
                 betas: Tuple[float, float] = (0.9, 0.95), warmup: int = 0,
                 total_steps: int = 1, min_lr_ratio: float = 0.1, grad_clip: float = 1.0,
                 ckpt_dir: Optional[str] = None, keep_last: int = 3,
                 meta: Optional[Dict[str, Any]] = None):
        model.to(getattr(groups, "device", None) or next(model.parameters()).device)
        self.model, self.groups, self.grad_clip = model, groups, grad_clip
        self.master = MasterWeights(model)
        self.sync = GradSync(model, self.master, groups)
        self.new_optimizer(lr, weight_decay, betas, warmup, total_steps, min_lr_ratio)
        self.ckpt = CheckpointManager(ckpt_dir, keep_last, groups) if ckpt_dir else None
        self.meta = meta or {}
        if "total_steps" in self.meta:
            raise ValueError("Trainer: meta key 'total_steps' is reserved (the trainer records "
                             "its schedule's length itself)")

    def new_optimizer(self, lr: float, weight_decay: float = 0.0,
                      betas: Tuple[float, float] = (0.9, 0.95), warmup: int = 0,
                      total_steps: int = 1, min_lr_ratio: float = 0.1) -> None:
        """A fresh AdamW and schedule over the same master weights (e.g. SFT, then RL)."""
        self.opt = build_optimizer(self.master, lr, weight_decay, betas)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, warmup_cosine(warmup, total_steps, min_lr_ratio))
        self.total_steps = total_steps

    def zero_grad(self) -> None:
        for p in self.model.parameters():
            p.grad = None

    def step(self) -> Dict[str, float]:
        """After loss.backward(): average over DP, clip, AdamW step, schedule step, write the
        master weights back into the model. Returns the lr used and the pre-clip grad norm."""
        self.master.grads_to_master()
        self.sync.average()
        norm = self.sync.clip(self.grad_clip)
        lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.sched.step()
        self.master.master_to_model()
        return {"lr": lr, "grad_norm": norm}

    def state_dict(self) -> Dict[str, Any]:
        return {"model": self.model.state_dict(), "master": self.master.state_dict(),
                "optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(),
                "rng": rng_state()}

    def _manager(self) -> CheckpointManager:
        if self.ckpt is None:
            raise ValueError("Trainer: no ckpt_dir was given, so there are no checkpoints")
        return self.ckpt

    def save(self, step: int, extra: Optional[Dict[str, Any]] = None) -> str:
        """Checkpoint everything a bit-exact resume needs (+ `extra`, e.g. the data position).
        Collective under torchrun. Returns the checkpoint directory."""
        return self._manager().save(step, {**self.state_dict(), **(extra or {})},
                                    {**self.meta, "total_steps": self.total_steps})

    def resume(self, path: Optional[str]) -> Tuple[int, Dict[str, Any]]:
        """Load checkpoint `path` ("latest" = the newest under ckpt_dir; None = nothing) into the
        model, master weights, optimizer, schedule and RNGs. Returns (step, state) so the caller
        can restore its own extras; (0, {}) when there is nothing to resume. The checkpoint's
        meta must match `meta`; a different total_steps is applied: the schedule keeps its
        position and ends at this trainer's total_steps (state["meta"]["total_steps"] is the
        checkpoint's)."""
        if not path:
            return 0, {}
        mgr = self._manager()
        if path == "latest":
            path = mgr.latest()
            if path is None:
                raise FileNotFoundError(f"--resume: no complete checkpoint under {mgr.root}")
        s = mgr.load(path, expect=self.meta)
        self.model.load_state_dict(s["model"])
        self.master.load_state_dict(s["master"])
        self.opt.load_state_dict(s["optimizer"])
        self.sched.load_state_dict(s["scheduler"])
        if s["meta"].get("total_steps", self.total_steps) != self.total_steps:
            # The saved lr is the old schedule's value for the next step: recompute it from
            # this trainer's schedule (LambdaLR does not save a function's closure).
            for g, base, fn in zip(self.opt.param_groups, self.sched.base_lrs,
                                   self.sched.lr_lambdas):
                g["lr"] = base * fn(self.sched.last_epoch)
        set_rng_state(s["rng"])
        s["path"] = path
        return s["meta"]["step"], s
