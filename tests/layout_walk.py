"""A walk over parallel layouts in one spawned world, shared by test_pipeline.py,
test_context_parallel.py and test_sequence_parallel.py.

`walk(layouts)` runs on every rank (tonp_parallel.launch.run_distributed): for each layout
(keyword arguments of `init_parallel`; the first must be dict(), the one-process layout) it
builds the seeded model and records what the layouts are compared on: token_logprobs, logits
of some rows, greedy and sampled `generate`, the previous layout's sampled rollout scored by
this one, a training step (`forward_backward` in MICRO micro-batches: its loss, its logprobs,
and the gradients after `GradSync.average`, i.e. what the optimizer would see) and, in stock
torch mode, token_logprobs again (the twins). `check_walk` asserts the bits.
"""
from __future__ import annotations

import torch

import tonp_kernels as tk
from test_parallel_model import _assert_same_rollout

PROMPTS = [[3, 17, 200, 45, 9, 1, 2], [250, 9], [11, 12, 13, 14, 15]]
# The second shares 6 tokens of the first's first page and waits for it: a prefix-cache hit that
# forks a partial page (PageAllocator.fork, on every layer this stage holds).
FORKED = [[3, 17, 200, 45, 9, 1, 2, 8, 8], [3, 17, 200, 45, 9, 1, 5]]
NEW_TOKENS = 4
SAMPLING = dict(temperature=0.8, top_p=0.9, seed=5)
MICRO = 2
LENGTHS = (6, 11, 3, 37, 17)            # ragged; 37 spans three attention blocks of 16


def config(**kw):
    """The tiny preset at 4 layers, layer 1 dense (model_helpers' "mlp_only")."""
    from model_helpers import tiny_config
    return tiny_config("mlp_only", **{"num_hidden_layers": 4, "max_position_embeddings": 128,
                                      **kw})


def seqs():
    from model_helpers import random_seqs
    return random_seqs(LENGTHS, 320, seed=1)


def key(layout: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(layout.items())) or "one process"


def _loss(lps, index):
    n = sum(n - 1 for n in LENGTHS)
    return -torch.cat(lps).sum() / n


def _synced_grads(model, groups):
    from tonp_models.training import GradSync, MasterWeights
    master = MasterWeights(model)
    master.grads_to_master()
    sync = GradSync(model, master, groups)
    sync.average()
    return {n: m.grad.clone() for n, m in zip(master.names, master.params)}, sync.norm()


def walk(layouts, cfg=None):
    import tonp_parallel as tpar
    from tonp_models import Qwen3MoeForCausalLM, generate
    out, prev = [], None
    ids = torch.cat(seqs())
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    rows = torch.tensor([0, 5, 6, 30, len(ids) - 1])
    for layout in layouts:
        g = tpar.init_parallel(**layout, timeout=120)
        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM(config(**(cfg or {})), groups=g)
        r = dict(layout=key(layout), rank=g.rank, shards=model.parameter_shards())
        with torch.no_grad():
            r["lps"] = model.token_logprobs(seqs())
            r["logits"] = model(ids, cu, logits_rows=rows)
            if prev is not None:
                r["rescored"] = model.token_logprobs(prev.sequences,
                                                     temperature=SAMPLING["temperature"])
            with tk.use("torch"):
                r["twin"] = model.token_logprobs(seqs())
        r["greedy"] = generate(model, PROMPTS, NEW_TOKENS)
        r["sampled"] = prev = generate(model, PROMPTS, NEW_TOKENS, **SAMPLING)
        r["forked"] = generate(model, FORKED, NEW_TOKENS, max_batch_size=2)
        model.zero_grad(set_to_none=True)
        step = model.forward_backward(seqs(), _loss, micro_batches=MICRO)
        r["loss"], r["step_lps"] = step.loss, step.logprobs
        r["grads"], r["norm"] = _synced_grads(model, g)
        out.append(r)
    return out


def _same_list(a, b, what):
    assert len(a) == len(b), what
    for x, y in zip(a, b):
        assert torch.equal(x, y), f"{what}: differ by {(x - y).abs().max()}"


def check_bits(spawned, reference_model):
    """Every layout, every rank: the one-process model's bits (torch.equal)."""
    with torch.no_grad():
        ref_lps = reference_model.token_logprobs(seqs())
    base = spawned[0][0]
    _same_list(base["lps"], ref_lps, "the one-process layout vs the test process's model")
    for rank_out in spawned:
        for r in rank_out:
            what = f"{r['layout']} rank {r['rank']}"
            _same_list(r["lps"], base["lps"], f"{what}: token_logprobs")
            assert torch.equal(r["logits"], base["logits"]), f"{what}: logits"
            _assert_same_rollout(r["greedy"], base["greedy"], f"{what}: greedy generate")
            _assert_same_rollout(r["sampled"], base["sampled"], f"{what}: sampled generate")
            _assert_same_rollout(r["forked"], base["forked"], f"{what}: forked prefix")
            assert r["forked"].stats.cached_tokens == 6, f"{what}: no partial-page hit"
            assert torch.equal(r["loss"], base["loss"]), \
                f"{what}: training-step loss {float(r['loss'])} vs {float(base['loss'])}"
            _same_list(r["step_lps"], base["lps"], f"{what}: training-step logprobs")


def check_rescoring(spawned):
    """Layout i's sampled rollout scored by layout i+1's training forward: logdiff 0."""
    checked = 0
    for rank_out in spawned:
        for prev, cur in zip(rank_out, rank_out[1:]):
            roll = prev["sampled"]
            for lp, gen_lp, p in zip(cur["rescored"], roll.logprobs, roll.prompt_lengths):
                assert torch.equal(lp[p - 1:], gen_lp), \
                    f"rollout at {prev['layout']} scored at {cur['layout']}: logdiff " \
                    f"{(lp[p - 1:] - gen_lp).abs().max()}"
                checked += len(gen_lp)
    assert checked > 0


def check_grads(spawned, exact, atol=2e-6, rtol=1e-5):
    """Synced gradients (this rank's shard of them) equal the one-process layout's: bitwise
    for the layouts in `exact`, else within atol + rtol * |g|; the global norm likewise."""
    base = spawned[0][0]
    for rank_out in spawned:
        for r in rank_out:
            what = f"{r['layout']} rank {r['rank']}"
            assert r["grads"], what
            for name, grad in r["grads"].items():
                full = base["grads"][name]
                want = r["shards"][name].take(full) if name in r["shards"] else full
                if r["layout"] in exact:
                    assert torch.equal(grad, want), \
                        f"{what}: {name} grad differs by {(grad - want).abs().max()}"
                else:
                    torch.testing.assert_close(grad, want, atol=atol, rtol=rtol,
                                               msg=f"{what}: {name}")
            assert abs(r["norm"] - base["norm"]) <= rtol * base["norm"], what


def check_layouts(spawned, exact=()):
    """check_bits (against the one-process model), check_rescoring, check_grads (bitwise for
    the layouts in `exact`) and check_twins (stock torch differs at every other layout)."""
    from tonp_models import Qwen3MoeForCausalLM
    torch.manual_seed(0)
    check_bits(spawned, Qwen3MoeForCausalLM(config()))
    check_rescoring(spawned)
    check_grads(spawned, exact={key(dict()), *exact})
    check_twins(spawned)


def check_twins(spawned):
    """Stock torch mode: every layout but the first changes token_logprobs' bits (so the
    bitwise checks above can fail there): micro-batches give F.linear another M, a TP split
    another sum, CP another attention call, SP the backend's reduce_scatter."""
    base = spawned[0][0]["twin"]
    for r in spawned[0][1:]:
        assert any(not torch.equal(a, b) for a, b in zip(r["twin"], base)), \
            f"stock torch at {r['layout']} gave the one-process bits"
