"""fp32 master weights, AdamW over them, and the warmup + cosine learning-rate schedule.

    master = MasterWeights(model)                 # fp32 copies for a bf16 model, else the params
    opt = build_optimizer(master, lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(warmup=10, total=200))
    loss.backward(); master.grads_to_master(); ...; opt.step(); master.master_to_model()
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Tuple

import torch


class MasterWeights:
    """The fp32 tensors the optimizer updates, in `model.named_parameters()` order (trainable
    ones only). For fp32 parameters they ARE the parameters; for bf16 ones they are fp32 copies
    (`separate`), written back rounded to bf16 by `master_to_model` after each step."""

    def __init__(self, model: torch.nn.Module):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("MasterWeights: the model has no trainable parameters")
        self.names, self.model_params = (tuple(x) for x in zip(*named))
        self.params = [p if p.dtype == torch.float32 else
                       p.detach().float().clone().requires_grad_(True) for p in self.model_params]

    @property
    def separate(self) -> bool:
        """True when some master tensor is a copy (the model holds bf16 parameters)."""
        return any(m is not p for m, p in zip(self.params, self.model_params))

    def grads_to_master(self) -> None:
        """Give every master tensor the fp32 gradient of its parameter (zeros when it has none:
        an expert no token reached), so every step updates the same tensors."""
        for m, p in zip(self.params, self.model_params):
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            if m is not p:
                m.grad = g.float()
            elif p.grad is None:
                p.grad = g

    @torch.no_grad()
    def master_to_model(self) -> None:
        """Copy the updated master tensors into the model's parameters (rounding to bf16)."""
        for m, p in zip(self.params, self.model_params):
            if m is not p:
                p.copy_(m)

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """The fp32 copies by parameter name (empty for an fp32 model: the model state is them)."""
        return {n: m.detach().clone() for n, m, p in zip(self.names, self.params,
                                                         self.model_params) if m is not p}

    @torch.no_grad()
    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        for n, m, p in zip(self.names, self.params, self.model_params):
            if m is p:
                continue
            if n not in state:
                raise KeyError(f"MasterWeights: the checkpoint has no fp32 master copy of {n}")
            if state[n].shape != m.shape:
                raise ValueError(f"MasterWeights: the checkpoint's master copy of {n} has shape "
                                 f"{tuple(state[n].shape)}, this model {tuple(m.shape)}")
            m.copy_(state[n])


def build_optimizer(master: MasterWeights, lr: float, weight_decay: float = 0.0,
                    betas: Tuple[float, float] = (0.9, 0.95), eps: float = 1e-8
                    ) -> torch.optim.AdamW:
    """AdamW on the fp32 master tensors; no weight decay on norms and biases (1-D tensors).
    foreach=False: one fixed per-tensor update order, the same in every run."""
    for name, v in (("lr", lr), ("weight_decay", weight_decay), ("eps", eps)):
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"build_optimizer: {name} must be a finite number >= 0, got {v!r}")
    decay = [m for m in master.params if m.dim() >= 2]
    no_decay = [m for m in master.params if m.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps,
                             foreach=False)


def warmup_cosine(warmup: int, total: int, min_ratio: float = 0.1) -> Callable[[int], float]:
    """LR multiplier for LambdaLR: linear from 1/warmup to 1 over `warmup` steps, then a cosine
    down to min_ratio at `total` (LambdaLR calls it with the number of steps done so far)."""
    if warmup < 0 or total < 1 or not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"warmup_cosine: need warmup >= 0, total >= 1 and 0 <= min_ratio <= 1, "
                         f"got warmup={warmup}, total={total}, min_ratio={min_ratio}")

    def multiplier(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))
    return multiplier
