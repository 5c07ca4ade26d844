"""The supervised training loop pretraining and finetuning share, and its losses.

    result = fit(trainer, sampler, lambda batch: (lm_step(model, batch), batch[:, 1:].numel()),
                 steps=200, out_dir="out/run", resume="latest", eval_fn=..., eval_every=25,
                 save_every=50)
    result["losses"]   # {step: loss}: the mean over the global batch (every DP rank's share)

Each step: next batch, forward + backward, `trainer.step()`, one metrics row (loss, lr,
grad_norm, tokens_per_s, eval_loss every eval_every steps); a checkpoint every save_every steps
and at the end, with the sampler's position, so `resume` continues bit for bit.
Losses: `lm_loss` / `response_loss` return a differentiable loss (PP 1); `lm_step` /
`response_step` run the forward and backward themselves through `model.forward_backward`
(micro-batches; the 1F1B schedule under PP) and return the loss detached: the same bits at
every PP degree for the same micro-batches.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch

import tonp_parallel as tpar

from .metrics import MetricLogger
from .trainer import Trainer


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of int64 [B, L+1] windows, from tonp's token logprobs."""
    lps = model.token_logprobs(list(batch.unbind(0)))           # B x fp32 [L], differentiable
    return -torch.cat(lps).mean()


def response_loss(model, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
                  ) -> torch.Tensor:
    """SFT loss: mean -log p over the response tokens only (the prompt is context, not target).
    Each sequence is prompt + response, scored in one packed forward."""
    seqs = [torch.tensor(list(p) + list(r), dtype=torch.int64) for p, r in zip(prompts, responses)]
    lps = model.token_logprobs(seqs)                      # lps[i][j] = log p(seq_i[j+1] | ...)
    resp = [lp[len(p) - 1:] for lp, p in zip(lps, prompts)]
    return -torch.cat(resp).mean()


def token_mean_step(model, seqs: Sequence[torch.Tensor], first: Sequence[int],
                    micro_batches: int = 1) -> torch.Tensor:
    """Forward + backward of the mean -log p over the tokens seqs[i][first[i] + 1:] (the logprobs
    lps[i][first[i]:]), by `model.forward_backward`; returns the loss (detached, every rank)."""
    n = sum(len(s) - 1 - f for s, f in zip(seqs, first))

    def loss_fn(lps, index):
        mine = torch.cat([lp[first[i]:] for lp, i in zip(lps, index)])
        return -mine.sum() / n
    return model.forward_backward(list(seqs), loss_fn, micro_batches=micro_batches).loss


def lm_step(model, batch: torch.Tensor, micro_batches: int = 1) -> torch.Tensor:
    """`lm_loss`'s forward + backward in `micro_batches` micro-batches (any PP degree)."""
    return token_mean_step(model, list(batch.unbind(0)), [0] * batch.shape[0], micro_batches)


def response_step(model, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                  micro_batches: int = 1) -> torch.Tensor:
    """`response_loss`'s forward + backward in `micro_batches` micro-batches (any PP degree)."""
    seqs = [torch.tensor(list(p) + list(r), dtype=torch.int64) for p, r in zip(prompts, responses)]
    return token_mean_step(model, seqs, [len(p) - 1 for p in prompts], micro_batches)


def dp_sum(x: torch.Tensor, groups) -> torch.Tensor:
    """The fixed-order sum of fp32 `x` over the data-parallel replicas (x itself at DP 1)."""
    return tpar.tree_all_reduce(x.float(), groups.dp_group) if groups.dp_size > 1 else x.float()


def dp_mean(x: torch.Tensor, groups) -> float:
    """The mean over DP replicas of a per-rank scalar (e.g. the loss): the global batch's."""
    return float(dp_sum(x.detach().reshape(1), groups)[0] / groups.dp_size)


@torch.no_grad()
def evaluate(model, items: Sequence[Any], batch_size: int, groups,
             nll: Callable[[Sequence[Any]], Tuple[float, int]]) -> float:
    """Mean loss over `items`: DP rank r scores items r::dp in batches (nll(batch) -> (sum of
    -log p, token count)); the sums meet in the fixed tree. NaN when there is nothing to score."""
    mine = list(items)[groups.dp_rank::groups.dp_size]
    total = torch.zeros(2, dtype=torch.float32)
    for i in range(0, len(mine), batch_size):
        s, n = nll(mine[i:i + batch_size])
        total += torch.tensor([float(s), float(n)])
    total = dp_sum(total, groups)
    return float(total[0] / total[1]) if total[1] > 0 else float("nan")


def fit(trainer: Trainer, sampler, loss_fn: Callable[[Any], Tuple[torch.Tensor, int]], *,
        steps: int, out_dir: str, resume: Optional[str] = None, stop_after: Optional[int] = None,
        eval_fn: Optional[Callable[[], float]] = None, eval_every: int = 0, save_every: int = 0,
        desc: str = "train", progress: bool = True) -> Dict[str, Any]:
    """Train until `steps` (or `stop_after`, as if interrupted there) and checkpoint.

    sampler: next_batch(), state_dict(), load_state_dict() (saved as the checkpoint's "data").
    loss_fn(batch) -> (this rank's mean loss, tokens in the batch): a differentiable loss (fit
    runs its backward) or, from a loss_fn that ran its own (`lm_step`, forward_backward), a
    detached one. resume: a checkpoint dir, "latest", or None.
    Returns {"losses", "eval", "start", "step", "checkpoint", "metrics"}.
    """
    from tqdm.auto import tqdm
    groups = trainer.groups
    is_main = groups.rank == 0
    start, state = trainer.resume(resume)
    if state:
        if start > steps:
            raise ValueError(f"steps={steps} is below the step of the checkpoint it resumes "
                             f"({state['path']}: step {start})")
        sampler.load_state_dict(state["data"])
        saved = state["meta"].get("total_steps", steps)
        if is_main:
            moved = (f"; steps={steps} applied: the lr schedule now ends at step {steps} (the "
                     f"checkpoint's run: {saved})") if saved != steps else ""
            print(f"resumed from {state['path']} at step {start}{moved}")
    end = steps if stop_after is None else min(steps, stop_after)
    losses: Dict[int, float] = {}
    evals: Dict[int, float] = {}
    log = MetricLogger(out_dir, enabled=is_main, resume_step=start if state else None)
    bar = tqdm(range(start, end), initial=start, total=steps, desc=desc,
               disable=not is_main or not progress, dynamic_ncols=True)
    last_saved = start if state else None
    try:
        for step in bar:
            t0 = time.perf_counter()
            batch = sampler.next_batch()
            trainer.zero_grad()
            loss, tokens = loss_fn(batch)
            if loss.requires_grad:
                loss.backward()
            stats = trainer.step()
            dt = time.perf_counter() - t0
            n = step + 1
            losses[n] = dp_mean(loss, groups)
            row = {"step": n, "loss": losses[n], **stats,
                   "tokens_per_s": tokens * groups.dp_size / dt}
            if eval_fn is not None and eval_every and (n % eval_every == 0 or n == steps):
                evals[n] = row["eval_loss"] = eval_fn()
            log.log(row, echo=("eval_loss" in row or n == start + 1))
            bar.set_postfix(loss=f"{losses[n]:.3f}", refresh=False)
            if not math.isfinite(losses[n]):
                raise FloatingPointError(f"step {n}: the loss is {losses[n]}; lower --lr")
            if save_every and n % save_every == 0:
                trainer.save(n, extra={"data": sampler.state_dict()})
                last_saved = n
        if last_saved != end and end > start:
            trainer.save(end, extra={"data": sampler.state_dict()})
    finally:
        bar.close()
        log.close()
    return {"losses": losses, "eval": evals, "start": start, "step": end,
            "checkpoint": trainer.ckpt.latest() if trainer.ckpt else None, "metrics": log.path}
