"""Expert parallelism without tensor parallelism between the ranks: each EP rank may roll out its
own prompts (different counts, lengths, settings). Every MoE forward is an all_to_all over the EP
group, so the engines step in lockstep: while any rank has work, a rank without any runs a
one-token forward (`Engine.idle_everywhere`). Each rank gets, bit for bit, what one process
gives its prompts, and no rank waits forever in a peer's all_to_all."""
from __future__ import annotations

import torch

from conftest import assert_bitwise
from dist_utils import run_distributed
from test_generation import _config, prompts, tiny_model
from tonp_models import generate

# Rank 1 has one short request: it is done long before rank 0.
CALLS = [dict(prompts=((5, 40, 17, 9), 1), max_new_tokens=12, temperature=1.0, seed=4,
              max_batch_size=2, max_step_tokens=24),
         dict(prompts=((3,), 2), max_new_tokens=2, temperature=0.0)]


def _call(model, rank):
    kw = dict(CALLS[rank])
    lens, seed = kw.pop("prompts")
    return generate(model, prompts(lens, seed=seed), **kw)


def _ep_rank():
    import tonp_parallel as tpar
    from tonp_models import Qwen3MoeForCausalLM
    g = tpar.init_parallel(tp=1, ep=2)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(_config(), groups=g)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)    # as test_generation.tiny_model
    out = _call(model.eval(), g.rank)
    same = generate(model, prompts((6, 2), seed=3), 3)   # the group still works, no lockstep
    return out, same


def test_ep_ranks_with_different_requests_step_in_lockstep():
    ranks = run_distributed(_ep_rank, 2, timeout=240)
    model = tiny_model(torch.float32)
    for rank, (out, same) in enumerate(ranks):
        want = _call(model, rank)
        for i, (a, b) in enumerate(zip(out.sequences, want.sequences, strict=True)):
            assert_bitwise(a, b, f"EP rank {rank}, request {i}: tokens")
            assert_bitwise(out.logprobs[i], want.logprobs[i], f"EP rank {rank}, request {i}")
        assert_bitwise(same.logprobs[0], ranks[0][1].logprobs[0], "the same call on both ranks")
    assert ranks[0][0].stats.forward_steps > ranks[1][0].stats.forward_steps
