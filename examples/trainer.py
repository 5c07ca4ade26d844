"""The optimisation side of the example scripts: fp32 master weights, AdamW, warmup + cosine,
gradient averaging over data-parallel replicas and global-norm clipping over model shards, and a
`Trainer` that bundles them with checkpoint save / exact resume.

    trainer = Trainer(model, groups, lr=3e-3, total_steps=200, ckpt_dir="out/x/ckpt", meta={...})
    start = trainer.resume("latest")            # 0 when starting fresh
    for step in range(start, 200):
        loss = ...; loss.backward()
        stats = trainer.step()                  # {"lr", "grad_norm"}
        trainer.save(step + 1, extra={"data": sampler.state_dict()})
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional

import torch

import tonp_kernels as tk
import tonp_parallel as tpar
from tonp_models import Qwen3MoeForCausalLM

from checkpointing import CheckpointManager, rng_state, set_rng_state


# -- optimizer, schedule, master weights ----------------------------------------------------------
class MasterWeights:
    """The fp32 tensors the optimizer updates. For fp32 models they ARE the model parameters; for
    bf16 models they are fp32 copies (master weights), written back (rounded) after each step."""

    def __init__(self, model: torch.nn.Module):
        self.names, self.model_params = zip(*[(n, p) for n, p in model.named_parameters()
                                              if p.requires_grad])
        self.params = [p if p.dtype == torch.float32 else
                       p.detach().float().clone().requires_grad_(True) for p in self.model_params]

    @property
    def separate(self) -> bool:
        return any(m is not p for m, p in zip(self.params, self.model_params))

    def grads_to_master(self) -> None:
        for m, p in zip(self.params, self.model_params):
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            if m is not p:
                m.grad = g.float()
            elif p.grad is None:
                p.grad = g

    @torch.no_grad()
    def master_to_model(self) -> None:
        for m, p in zip(self.params, self.model_params):
            if m is not p:
                p.copy_(m)

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {n: m.detach().clone() for n, m, p in zip(self.names, self.params,
                                                         self.model_params) if m is not p}

    @torch.no_grad()
    def load_state_dict(self, s: Dict[str, torch.Tensor]) -> None:
        for n, m, p in zip(self.names, self.params, self.model_params):
            if m is not p:
                if n not in s:
                    raise KeyError(f"the checkpoint has no fp32 master copy of {n}")
                m.copy_(s[n])


def build_optimizer(master: MasterWeights, lr: float, weight_decay: float,
                    betas=(0.9, 0.95), eps: float = 1e-8) -> torch.optim.AdamW:
    """AdamW on the fp32 master tensors; no weight decay on norms and biases (1-D tensors).
    foreach=False: one fixed per-tensor update order, the same in every run."""
    decay = [m for m in master.params if m.dim() >= 2]
    no_decay = [m for m in master.params if m.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps,
                             foreach=False)


def warmup_cosine(warmup: int, total: int, min_ratio: float = 0.1):
    """LR multiplier: linear from 1/warmup to 1 over `warmup` steps, then a cosine down to
    min_ratio at `total` (step counts from 0; LambdaLR calls it with the steps done so far)."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))
    return f


# -- gradients over ranks -------------------------------------------------------------------------
def _expert_param(name: str) -> bool:
    return name.endswith("mlp.gate_up_proj") or name.endswith("mlp.down_proj")


def _sharded_names(model: Qwen3MoeForCausalLM) -> Dict[str, str]:
    """name -> "tp" | "ep" for parameters whose local shape differs from the one-rank model."""
    with torch.device("meta"):
        full = Qwen3MoeForCausalLM(model.config, dtype=model.dtype)
    shapes = {n: p.shape for n, p in full.named_parameters()}
    return {n: ("ep" if _expert_param(n) else "tp") for n, p in model.named_parameters()
            if p.shape != shapes[n]}


class GradSync:
    """Averages gradients over data-parallel replicas and clips by the global norm.

    Dense parameters are replicated over `groups.dp_group`; experts (under EP) over the
    expert-data-parallel group (ranks holding the same experts). Every sum is
    `tonp_parallel.tree_all_reduce` (fixed order: all replicas get the same bits) of one flat
    fp32 buffer; the average divides by the dense DP degree (the loss is a per-rank mean).
    """

    def __init__(self, model: Qwen3MoeForCausalLM, master: MasterWeights, groups,
                 expert_dp_group=None):
        self.master, self.groups = master, groups
        sharded = _sharded_names(model) if groups.world_size > 1 else {}
        self.kind = [sharded.get(n, "rep") for n in master.names]
        self.is_expert = [_expert_param(n) and groups.ep_size > 1 for n in master.names]
        self.expert_dp_group = expert_dp_group
        # A shard held by `copies` TP ranks (KV heads when TP > KV heads) enters the TP sum once
        # per copy: weight its square norm by 1 / copies so it counts once.
        copies = {f"{mn}.{pn}" if mn else pn: getattr(mod, "copies", 1)
                  for mn, mod in model.named_modules() for pn, _ in mod.named_parameters(recurse=False)}
        self.norm_weight = [1.0 / copies.get(n, 1) for n in master.names]

    def average(self) -> None:
        g = self.groups
        if g.dp_size == 1:
            return
        for expert, group in ((False, g.dp_group), (True, self.expert_dp_group)):
            ps = [m for m, e in zip(self.master.params, self.is_expert) if e == expert]
            if not ps:
                continue
            flat = torch.cat([m.grad.reshape(-1) for m in ps])
            flat = tpar.tree_all_reduce(flat, group) / g.dp_size
            for m, part in zip(ps, flat.split([m.numel() for m in ps])):
                m.grad.copy_(part.view_as(m.grad))

    def clip(self, max_norm: float) -> float:
        """Scale grads so the norm over the whole (sharded) model is <= max_norm; returns it."""
        sq = {"rep": torch.zeros((), dtype=torch.float32), "tp": torch.zeros(()),
              "ep": torch.zeros(())}
        for m, kind, w in zip(self.master.params, self.kind, self.norm_weight):
            sq[kind] = sq[kind] + m.grad.float().pow(2).sum() * w
        g = self.groups
        total = sq["rep"]
        if g.tp_size > 1:
            total = total + tpar.tree_all_reduce(sq["tp"].reshape(1), g.tp_group)[0]
        else:
            total = total + sq["tp"]
        if g.ep_size > 1:
            total = total + tpar.tree_all_reduce(sq["ep"].reshape(1), g.ep_group)[0]
        else:
            total = total + sq["ep"]
        norm = float(total.sqrt())
        if max_norm > 0 and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            for m in self.master.params:
                m.grad.mul_(scale)
        return norm


def setup_parallel(tp: int, ep: int):
    """ParallelGroups for this process (torchrun or plain python), plus the expert-DP group."""
    groups = tpar.init_parallel(tp=tp, ep=ep)
    expert_dp = None
    if groups.world_size > 1 and ep > 1:
        import torch.distributed as dist
        layout = tpar.rank_layout(groups.world_size, tp, ep)
        for ranks in layout.expert_dp_groups:     # collective: every rank makes every group
            pg = dist.new_group(list(ranks)) if len(ranks) > 1 else None
            if groups.rank in ranks:
                expert_dp = pg
    return groups, expert_dp


def build_model(config, dtype: torch.dtype, groups, seed: int) -> Qwen3MoeForCausalLM:
    """The model, initialised from `seed`: each rank holds exactly its shard of the weights the
    single-process model would draw (bad TP/EP layouts are refused with every reason listed)."""
    if groups.world_size > 1:
        tpar.validate_model_layout(config, tp=groups.tp_size, ep=groups.ep_size)
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config, dtype=dtype,
                               groups=groups if groups.world_size > 1 else None)



class Trainer:
    """Model + master weights + AdamW + LambdaLR(warmup_cosine) + GradSync + checkpoints.

    Args: model, groups (ParallelGroups), expert_dp_group (from setup_parallel), lr,
    weight_decay, betas, warmup, total_steps, min_lr_ratio, grad_clip (0 = off), ckpt_dir,
    keep_last, meta (what a resumed checkpoint must match: config, layout, ...).
    """

    def __init__(self, model: Qwen3MoeForCausalLM, groups, expert_dp_group=None, *, lr: float,
                 weight_decay: float = 0.0, betas=(0.9, 0.95), warmup: int = 0,
                 total_steps: int = 1, min_lr_ratio: float = 0.1, grad_clip: float = 1.0,
                 ckpt_dir: Optional[str] = None, keep_last: int = 3,
                 meta: Optional[Dict[str, Any]] = None):
        self.model, self.groups, self.grad_clip = model, groups, grad_clip
        self.master = MasterWeights(model)
        self.opt = build_optimizer(self.master, lr, weight_decay, betas)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, warmup_cosine(warmup, total_steps, min_lr_ratio))
        self.sync = GradSync(model, self.master, groups, expert_dp_group)
        self.ckpt = CheckpointManager(ckpt_dir, keep_last, groups) if ckpt_dir else None
        self.meta = meta or {}

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

    def save(self, step: int, extra: Optional[Dict[str, Any]] = None) -> str:
        """Checkpoint everything a bit-exact resume needs (+ `extra`, e.g. the data position)."""
        return self.ckpt.save(step, {**self.state_dict(), **(extra or {})}, self.meta)

    def resume(self, path: Optional[str]) -> tuple:
        """Load checkpoint `path` ("latest" = the newest under ckpt_dir; None = nothing) into the
        model, master weights, optimizer, schedule and RNGs. Returns (step, state) so the caller
        can restore its own extras; (0, {}) when there is nothing to resume."""
        if not path:
            return 0, {}
        if path == "latest":
            path = self.ckpt.latest()
            if path is None:
                raise FileNotFoundError(f"--resume: no complete checkpoint under {self.ckpt.root}")
        s = self.ckpt.load(path, expect=self.meta)
        self.model.load_state_dict(s["model"])
        self.master.load_state_dict(s["master"])
        self.opt.load_state_dict(s["optimizer"])
        self.sched.load_state_dict(s["scheduler"])
        set_rng_state(s["rng"])
        s["path"] = path
        return s["meta"]["step"], s


def launch(args, body):
    """The scripts' shared entry: thread count, process groups (torchrun or one process) and the
    kernel mode, then body(args, groups, expert_dp_group)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    groups, expert_dp = setup_parallel(args.tp, args.ep)
    with tk.use(args.mode):
        return body(args, groups, expert_dp)
