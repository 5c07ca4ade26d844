"""A request's prompt logprobs (vLLM's `prompt_logprobs`, OpenAI's `echo` with `logprobs`).

The prompt goes through the model alone, without the KV cache (one forward at admission, on
every rank that holds the request): its rows are the rows of the training forward, so each
position's logprob is bit for bit `model.token_logprobs` of the prompt, whether or not the
prefix cache then serves the prompt's generation. Logprobs and top-k come from the sampler's
ops (`tk.token_logprobs`, `tk.log_softmax` ranked as `sampling.ranked`) at the request's
temperature (T = 1 for greedy), so they read as the generated tokens' do.
"""
from __future__ import annotations

import math
from typing import List, NamedTuple, Tuple

import torch

import tonp_kernels as tk

from .request import Request
from .sampling import ranked

LOGIT_ELEMENTS = 1 << 24     # fp32 logits held at once: 64 MiB (a long prompt x a large vocab)


class PromptLogprob(NamedTuple):
    """Prompt position j >= 1: log p(prompt[j] | prompt[:j]), its rank (1 = most likely;
    1 + the tokens strictly more likely) and the k most likely (id, logprob)."""
    logprob: float
    rank: int
    top: List[Tuple[int, float]]


@torch.no_grad()
def score_prompt(who: str, model, r: Request) -> List[PromptLogprob]:
    """One PromptLogprob per prompt position 1..n-1 of `r` (top k = r.params.prompt_logprobs).
    Raises RuntimeError / ValueError naming the request when a logprob is not finite."""
    tokens, k = r.tokens[:r.prompt_len], r.params.prompt_logprobs
    T = r.params.temperature or 1.0
    n = len(tokens)
    if n < 2:
        return []
    dev = next(model.parameters()).device
    ids = torch.tensor(tokens, dtype=torch.int64, device=dev)
    h = model(ids, torch.tensor([0, n], dtype=torch.int32), return_hidden=True)[:-1]  # (n-1, H)
    targets = ids[1:]
    step = max(1, LOGIT_ELEMENTS // model.config.vocab_size)
    out: List[PromptLogprob] = []
    for a in range(0, n - 1, step):
        logits = model.lm_head(h[a:a + step])                                      # (r, V) fp32
        lp = tk.token_logprobs(logits, targets[a:a + step], temperature=T)         # (r,)
        lsm = tk.log_softmax(logits, temperature=T)                                # (r, V)
        rank = (lsm > lp[:, None]).sum(-1) + 1
        top_ids, top_vals = ranked(lsm, k)
        for j, (v, q, ti, tv) in enumerate(zip(lp.tolist(), rank.tolist(), top_ids.tolist(),
                                               top_vals.tolist())):
            if not math.isfinite(v):
                kind = ValueError if 0 < T < 1 else RuntimeError
                raise kind(f"{who}: request {r.name}'s prompt token at position {a + j + 1} "
                           f"has a non-finite logprob ({v}) at temperature={T!r}")
            out.append(PromptLogprob(v, q, list(zip(ti, tv))))
    return out
