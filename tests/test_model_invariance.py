"""A token's logits are the same bits however the model computes them (invariant kernel mode).

- a sequence alone == the same sequence packed among others;
- a padded [B, L] batch == the packed batch;
- the full causal pass == extending a KV cache: prefill then one token at a time, and a chunked
  prefill whose chunks cross the attention block (= page) boundaries, with other sequences
  decoding in the same steps;
- token_logprobs in micro-batches of 1, 3 and all, packed or padded, are equal.
Each is checked with torch.equal in fp32 and bf16; the twin shows stock torch ("torch" mode)
breaks at least one of them, so the checks can fail.
"""
from __future__ import annotations

import pytest
import torch

import tonp_kernels as tk
from model_helpers import packed, random_seqs, tiny_model, use_mode
from tonp_models.engine import PageAllocator, extend

# Lengths cross the tiny model's attention block (16) and include a 1-token sequence.
LENGTHS = [37, 5, 20, 16, 1, 33]


def _full(model, seqs):
    """Logits of each sequence from one packed training forward."""
    ids, cu = packed(seqs)
    out = model(ids, cu)
    return [out[a:b] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]


def _by_cache(model, seqs, chunks):
    """Logits of each sequence by extending a shared cache: sequence i is fed in pieces
    chunks(i) (a list of sizes), all sequences advancing together, one forward per step."""
    pages = PageAllocator(model.new_cache(len(seqs), max(len(s) for s in seqs)))
    slots = [pages.add_sequence() for _ in seqs]
    pieces = [list(chunks(i, len(s))) for i, s in enumerate(seqs)]
    done = [0] * len(seqs)
    outs = [[] for _ in seqs]
    step = 0
    while any(step < len(p) for p in pieces):
        batch = [i for i, p in enumerate(pieces) if step < len(p)]
        parts = [seqs[i][done[i]:done[i] + pieces[i][step]] for i in batch]
        ids, cu = packed(parts)
        logits = extend(model, pages, ids, [slots[i] for i in batch], cu)
        for j, i in enumerate(batch):
            outs[i].append(logits[int(cu[j]):int(cu[j + 1])])
            done[i] += pieces[i][step]
        step += 1
    return [torch.cat(o) for o in outs]


def _token_by_token(i, n):
    return [min(n, 3)] + [1] * (n - min(n, 3))  # a short prefill, then decode steps


def _chunked(i, n):
    sizes, k = [], 0
    for c in [7, 13, 5, 16, 11][i % 2:] * 4:
        if k < n:
            sizes.append(min(c, n - k))
            k += sizes[-1]
    return sizes


def _padded(model, seqs):
    L = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), L, dtype=torch.long)
    mask = torch.zeros(len(seqs), L, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = s, 1
    out = model(ids, attention_mask=mask)
    return [out[i, :len(s)] for i, s in enumerate(seqs)]


def _arrangements(model, seqs):
    """(description, logits per sequence) for every arrangement the contract covers."""
    yield "alone", [_full(model, [s])[0] for s in seqs]
    yield "packed in reverse order", _full(model, seqs[::-1])[::-1]
    yield "padded", _padded(model, seqs)
    yield "prefill + token-by-token decode", _by_cache(model, seqs, _token_by_token)
    yield "chunked prefill", _by_cache(model, seqs, _chunked)


def _differences(model, seqs, first_only=False):
    base = _full(model, seqs)
    bad = []
    for what, got in _arrangements(model, seqs):
        for i, (g, b) in enumerate(zip(got, base)):
            if not torch.equal(g, b):
                bad.append(f"{what}: sequence {i} (len {len(seqs[i])}) max |diff| "
                           f"{(g - b).abs().max():.3e}")
        if bad and first_only:
            break
    return bad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_do_not_depend_on_the_arrangement(dtype):
    model = tiny_model("mlp_only", dtype=dtype)
    seqs = random_seqs(LENGTHS, model.config.vocab_size)
    with use_mode("invariant"), torch.no_grad():
        bad = _differences(model, seqs)
    assert not bad, "\n".join(bad)


def test_stock_torch_breaks_the_arrangement_invariance():
    """The twin: with stock torch ops the same comparisons find differences."""
    model = tiny_model("mlp_only")
    seqs = random_seqs(LENGTHS, model.config.vocab_size)
    with tk.use("torch"), torch.no_grad():
        assert _differences(model, seqs, first_only=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_do_not_depend_on_micro_batching(dtype):
    model = tiny_model("sparse_step2", dtype=dtype)
    seqs = random_seqs(LENGTHS, model.config.vocab_size, seed=2)
    with use_mode("invariant"), torch.no_grad():
        base = model.token_logprobs(seqs, temperature=0.8)
        for mb in (1, 3, None):
            for is_packed in (True, False):
                got = model.token_logprobs(seqs, temperature=0.8, micro_batch_size=mb,
                                           packed=is_packed)
                for i, (g, b) in enumerate(zip(got, base)):
                    assert torch.equal(g, b), (mb, is_packed, i)


def test_logits_do_not_depend_on_the_thread_count():
    model = tiny_model("mlp_only")
    ids, cu = packed(random_seqs(LENGTHS, model.config.vocab_size))
    threads = torch.get_num_threads()
    with use_mode("invariant"), torch.no_grad():
        try:
            torch.set_num_threads(1)
            one = model(ids, cu)
            torch.set_num_threads(2)
            two = model(ids, cu)
        finally:
            torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_experts_equal_one_call_per_expert(dtype):
    """The MoE blocks' fused expert op (the default) and their one-call-per-expert path (which
    the diagnoser also runs beside the fused op, to see inside) give the same logits bit for bit,
    in a training forward and in cached decode; their gradients agree (backward is torch math,
    not promised bitwise)."""
    from tonp_models.layers.moe import SparseMoeBlock
    model = tiny_model("mlp_only", dtype=dtype)
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks
    seqs = random_seqs(LENGTHS, model.config.vocab_size)
    ids, cu = packed(seqs)
    out, grads = {}, {}
    with use_mode("invariant"):
        for fused in (True, False):
            for b in blocks:
                b.fused_experts = fused
            model.zero_grad()
            logits = model(ids, cu)
            logits.float().square().mean().backward()
            grads[fused] = [p.grad.float().clone() for p in model.parameters()]
            with torch.no_grad():
                out[fused] = (logits.detach(), torch.cat(_by_cache(model, seqs, _token_by_token)))
    for b in blocks:
        b.fused_experts = True
    assert torch.equal(out[True][0], out[False][0]), "training forward"
    assert torch.equal(out[True][1], out[False][1]), "cached decode"
    assert torch.equal(out[True][0], out[True][1]), "training forward vs cached decode"
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, e in zip(grads[True], grads[False]):
        torch.testing.assert_close(a, e, rtol=tol, atol=tol * float(e.abs().max() + 1e-12))
