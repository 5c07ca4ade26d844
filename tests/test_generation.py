"""The rollout engine keeps the true-on-policy promise.

* "logdiff is exactly 0": the logprobs `generate` reports equal, bit for bit, the training
  forward's `token_logprobs` of the returned sequences, in fp32 and bf16, greedy and sampled, with
  the rollout batch (ragged prompts, continuous batching, preemption) and the training
  micro-batches (1, 3, all; packed and padded; reordered) arranged differently. Twin: stock torch
  ops ("torch" mode) give a non-zero logdiff.
* "a request does not depend on its batch": tokens and logprobs are the same alone and in any
  batch (any max_batch_size, companions, order, cache size). Twin: not so in "torch" mode.
* Seeded sampling is reproducible and changes with the seed; eos / stop tokens end a request;
  bad input raises a clear error.
"""
from __future__ import annotations

import copy
import math
import re

import numpy as np
import pytest
import torch

import tonp_kernels as tk
from conftest import assert_bitwise, num_threads
from tonp_models import GenerationOutput, Qwen3MoeConfig, Qwen3MoeForCausalLM, generate
from tonp_models.layers import CacheFullError

# Ragged prompts that end inside, at and just past a page (the tiny preset's block is 16).
PROMPT_LENS = (5, 16, 1, 33, 9, 17, 24)
NEW = 10
SAMPLINGS = {
    "greedy": dict(temperature=0.0),
    "T1": dict(temperature=1.0),
    "T0.7-topk": dict(temperature=0.7, top_k=20),
    "T1.3-topp": dict(temperature=1.3, top_p=0.9),
}


def _config() -> Qwen3MoeConfig:
    # Two layers: one sparse MoE layer and one dense MLP layer.
    return Qwen3MoeConfig.preset("tiny", num_hidden_layers=2, mlp_only_layers=[1])


_MODELS = {}


def tiny_model(dtype: torch.dtype) -> Qwen3MoeForCausalLM:
    if dtype not in _MODELS:
        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM(_config(), dtype=dtype)
        # Sharper than the 0.02 init: a peaked next-token distribution, so greedy and top-k/p
        # make real choices and eos is reachable.
        with torch.no_grad():
            model.lm_head.weight.mul_(10.0)
        _MODELS[dtype] = model.eval()
    return _MODELS[dtype]


def prompts(lens=PROMPT_LENS, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g) for n in lens]


def rollout_logdiff(model, out: GenerationOutput, temperature: float, **score_kw):
    """(max |logp_train - logp_rollout|, all bitwise equal) over every generated token."""
    T = temperature or 1.0
    with torch.no_grad():
        train = model.token_logprobs(out.sequences, temperature=T, **score_kw)
    worst, equal = 0.0, True
    for lp_train, lp_roll, p in zip(train, out.logprobs, out.prompt_lengths):
        lp_train = lp_train[p - 1:]          # positions that predicted generated tokens
        assert lp_train.dtype == lp_roll.dtype == torch.float32
        assert lp_train.shape == lp_roll.shape
        equal &= torch.equal(lp_train, lp_roll)
        worst = max(worst, float((lp_train - lp_roll).abs().max()))
    return worst, equal


def assert_same_rollouts(got: GenerationOutput, want: GenerationOutput, what: str) -> None:
    for i, (s, w) in enumerate(zip(got.sequences, want.sequences, strict=True)):
        assert_bitwise(s, w, f"{what}: tokens of request {i}")
    for i, (s, w) in enumerate(zip(got.logprobs, want.logprobs, strict=True)):
        assert_bitwise(s, w, f"{what}: logprobs of request {i}")


# ---------------------------------------------------------------------------------------------
# logdiff == 0
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_rollout_logprobs_equal_training_logprobs(dtype, sampling):
    model, kw = tiny_model(dtype), SAMPLINGS[sampling]
    # Continuous batching: 7 ragged prompts through 3 slots, joining as others finish.
    out = generate(model, prompts(), NEW, max_batch_size=3, seed=11, **kw)
    assert out.num_new_tokens == [NEW] * len(PROMPT_LENS)
    for mb, packed in ((1, True), (3, False), (3, True), (None, True), (None, False)):
        worst, equal = rollout_logdiff(model, out, kw["temperature"], micro_batch_size=mb,
                                       packed=packed)
        assert equal, f"logdiff {worst:.3e} with micro-batches of {mb}, packed={packed}"
    # Training order reversed: each sequence sits among other companions than in the rollout.
    rev = GenerationOutput(out.sequences[::-1], out.logprobs[::-1], out.prompt_lengths[::-1],
                           out.finish_reasons[::-1])
    worst, equal = rollout_logdiff(model, rev, kw["temperature"], micro_batch_size=2)
    assert equal, f"logdiff {worst:.3e} with reversed micro-batches of 2"


def test_logdiff_zero_under_preemption():
    """A cache too small for the batch forces preemption and recomputation: still exact."""
    model = tiny_model(torch.float32)
    out = generate(model, prompts(), NEW, temperature=1.0, seed=3, num_pages=4)
    assert out.stats.preemptions > 0
    worst, equal = rollout_logdiff(model, out, 1.0, micro_batch_size=3)
    assert equal, f"logdiff {worst:.3e} after preemption"


def test_logdiff_nonzero_with_stock_torch(torch_mode):
    """Twin: the same rollout and scoring with stock torch ops do not agree bit for bit."""
    model = tiny_model(torch.float32)
    out = generate(model, prompts()[:4], 6, max_batch_size=2)
    worst, equal = rollout_logdiff(model, out, 0.0, micro_batch_size=3, packed=False)
    assert not equal and worst > 0, "stock torch unexpectedly matched bit for bit"


# ---------------------------------------------------------------------------------------------
# A request does not depend on its batch
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sampling", ["greedy", "T0.7-topk"])
def test_request_is_the_same_alone_and_in_any_batch(sampling):
    model, kw = tiny_model(torch.float32), SAMPLINGS[sampling]
    ps = prompts()
    n = len(ps)
    alone = [generate(model, [p], NEW, seed=5, request_ids=[i], **kw) for i, p in enumerate(ps)]
    want = GenerationOutput([a.sequences[0] for a in alone], [a.logprobs[0] for a in alone],
                            list(PROMPT_LENS), ["length"] * n)
    for mbs in (2, None):
        assert_same_rollouts(generate(model, ps, NEW, seed=5, max_batch_size=mbs, **kw), want,
                             f"max_batch_size={mbs}")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(2)).tolist()
    got = generate(model, [ps[i] for i in perm], NEW, seed=5, request_ids=perm, max_batch_size=3,
                   **kw)
    inv = [perm.index(i) for i in range(n)]
    assert_same_rollouts(GenerationOutput([got.sequences[j] for j in inv],
                                          [got.logprobs[j] for j in inv], list(PROMPT_LENS),
                                          ["length"] * n), want, f"prompts permuted {perm}")
    # New companions (other prompts, other ids) and a cache small enough to force preemption.
    extra = prompts((40, 2, 11), seed=9)
    got = generate(model, extra[:2] + ps + extra[2:], NEW, seed=5,
                   request_ids=[100, 101, *range(n), 102], max_batch_size=4, num_pages=5, **kw)
    got = GenerationOutput(got.sequences[2:2 + n], got.logprobs[2:2 + n], list(PROMPT_LENS),
                           ["length"] * n)
    assert_same_rollouts(got, want, "among other companions, with preemption")


def test_rollout_is_the_same_with_1_and_2_threads():
    model = tiny_model(torch.bfloat16)
    ps = prompts()[:4]
    with num_threads(1):
        one = generate(model, ps, NEW, temperature=1.0, seed=8, max_batch_size=2)
    with num_threads(2):
        two = generate(model, ps, NEW, temperature=1.0, seed=8, max_batch_size=3)
    assert_same_rollouts(two, one, "2 threads vs 1 thread")


def test_request_depends_on_batch_with_stock_torch(torch_mode):
    """Twin: with stock torch ops a request's logprobs change with its batch (one slot, i.e.
    each request alone, vs all together)."""
    model = tiny_model(torch.float32)
    alone = generate(model, prompts(), NEW, max_batch_size=1)
    together = generate(model, prompts(), NEW)
    assert any(not torch.equal(a, b) for a, b in zip(alone.logprobs, together.logprobs)), \
        "stock torch unexpectedly gave batch-independent rollouts"


# ---------------------------------------------------------------------------------------------
# Sampling, eos and stop tokens
# ---------------------------------------------------------------------------------------------
def test_seeded_sampling_is_reproducible_and_follows_the_seed():
    model = tiny_model(torch.float32)
    ps = prompts()
    a = generate(model, ps, NEW, temperature=1.0, seed=42, max_batch_size=3)
    b = generate(model, ps, NEW, temperature=1.0, seed=42)
    assert_same_rollouts(b, a, "same seed")
    c = generate(model, ps, NEW, temperature=1.0, seed=43)
    assert any(not torch.equal(x, y) for x, y in zip(a.sequences, c.sequences)), \
        "changing the seed changed no token"
    # Requests with the same prompt but different ids draw different samples (GRPO groups).
    g = generate(model, [ps[3]] * 4, NEW, temperature=1.0, seed=42)
    assert len({tuple(s.tolist()) for s in g.sequences}) > 1


def test_greedy_logprobs_are_plain_log_softmax():
    model = tiny_model(torch.float32)
    out = generate(model, prompts()[:3], 4, progress=True)
    for seq, lp, p in zip(out.sequences, out.logprobs, out.prompt_lengths):
        logits = model(seq[:-1])[p - 1:]
        assert torch.equal(seq[p:], tk.argmax(logits))
        assert torch.equal(lp, tk.token_logprobs(logits, seq[p:]))


def test_eos_and_stop_tokens_end_a_request():
    model = tiny_model(torch.float32)
    ps = prompts()
    free = generate(model, ps, NEW, temperature=1.0, seed=7)
    # The token request 1 draws at its 4th step becomes eos; request 3's 2nd token a stop token.
    eos, stop = int(free.completions[1][3]), int(free.completions[3][1])
    out = generate(model, ps, NEW, temperature=1.0, seed=7, eos_token_id=eos,
                   stop_token_ids=[stop], max_batch_size=3)
    for i, (full, got) in enumerate(zip(free.completions, out.completions)):
        hits = [j for j, t in enumerate(full.tolist()) if t in (eos, stop)]
        n = hits[0] + 1 if hits else NEW
        assert torch.equal(got, full[:n]), f"request {i} did not stop at its first eos/stop"
        assert torch.equal(out.logprobs[i], free.logprobs[i][:n])
        want = "length" if not hits else "eos" if int(full[hits[0]]) == eos else "stop"
        assert out.finish_reasons[i] == want
    assert out.num_new_tokens[1] <= 4 and out.finish_reasons[1] in ("eos", "stop")
    assert generate(model, ps[:2], 0).completions[0].numel() == 0


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------
def test_bad_input_raises_clear_errors():
    model = tiny_model(torch.float32)
    V, limit = model.config.vocab_size, model.config.max_position_embeddings
    ok = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="request 1: the prompt is empty"):
        generate(model, [ok, torch.tensor([], dtype=torch.long)], 4)
    with pytest.raises(IndexError, match=r"request 0: the prompt holds token ids \[320\]"):
        generate(model, [torch.tensor([1, V])], 4)
    with pytest.raises(IndexError, match=r"token ids \[-1\]"):
        generate(model, [[-1, 2]], 4)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        generate(model, [torch.zeros(limit, dtype=torch.long)], 1)
    with pytest.raises(ValueError, match="max_new_tokens=10 = 1029 tokens exceeds the context"):
        generate(model, [torch.zeros(limit - 5, dtype=torch.long)], 10)
    with pytest.raises(CacheFullError, match="cannot run even alone"):
        generate(model, [torch.zeros(40, dtype=torch.long)], 10, num_pages=2)
    with pytest.raises(TypeError, match="1-D"):
        generate(model, [torch.zeros(2, 3, dtype=torch.long)], 4)
    with pytest.raises(TypeError, match="wrap it in a list"):
        generate(model, ok, 4)
    with pytest.raises(ValueError, match="eos_token_id"):
        generate(model, [ok], 4, eos_token_id=V)
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=0),
                dict(max_batch_size=0), dict(num_pages=0)):
        with pytest.raises(ValueError):
            generate(model, [ok], 4, **bad)
    with pytest.raises(ValueError, match="request_ids"):
        generate(model, [ok, ok], 4, request_ids=[0])


# ---------------------------------------------------------------------------------------------
# Hardening: every bad argument named, no NaN out, TP ranks checked
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("t", [1e-300, 1e-45, 1e-39, -1e-300, -0.5, math.nan, math.inf, 1e39])
def test_temperatures_fp32_cannot_carry_are_refused(t):
    """1e-300 and 1e-45 pass a `> 0` check but are 0 or a denormal in the kernels' fp32."""
    model, got = tiny_model(torch.float32), rf"got {re.escape(str(t))}$"
    with pytest.raises(ValueError, match="generate: temperature must be .*" + got):
        generate(model, [[1, 2, 3]], 2, temperature=t)
    with pytest.raises(ValueError, match="token_logprobs: temperature must be .*" + got):
        model.token_logprobs([torch.tensor([1, 2, 3])], temperature=t)
    with pytest.raises(ValueError, match="token_logprobs: temperature 0 means greedy"):
        model.token_logprobs([torch.tensor([1, 2, 3])], temperature=0.0)


def test_temperature_whose_division_overflows_raises_instead_of_nan():
    """The smallest normal fp32 temperature is valid, but logits / T overflow: an error names
    it (the logprobs would be NaN)."""
    model = tiny_model(torch.float32)
    with pytest.raises(ValueError, match="divided by the temperature overflow fp32"):
        generate(model, [[1, 2, 3]], 2, temperature=torch.finfo(torch.float32).tiny)


@pytest.mark.parametrize("where", ["lm_head", "layer"])
@pytest.mark.parametrize("sampling", ["greedy", "T1"])
def test_non_finite_logits_raise_naming_the_first(where, sampling):
    model = copy.deepcopy(tiny_model(torch.float32))
    with torch.no_grad():
        if where == "lm_head":       # vocab id 7 is NaN in every row
            model.lm_head.weight[7] = math.nan
        else:                        # every logit NaN
            model.layers[1].mlp.down_proj.weight[0, 0] = math.inf
    v = 7 if where == "lm_head" else 0
    with pytest.raises(RuntimeError, match=rf"request 0, position 4, vocab id {v} is nan"):
        generate(model, [[1, 2, 3, 4, 5], [6, 7]], 3, **SAMPLINGS[sampling])


BAD_ARGS = [  # (generate keyword arguments, exception, message)
    (dict(top_k=1.5), TypeError, "top_k must be an integer, got 1.5"),
    (dict(top_k=True), TypeError, "top_k must be an integer, got True"),
    (dict(max_new_tokens=True), TypeError, "max_new_tokens must be an integer, got True"),
    (dict(max_new_tokens=2.0), TypeError, "max_new_tokens must be an integer"),
    (dict(top_p="0.9"), TypeError, "top_p must be a real number, got '0.9'"),
    (dict(top_p=math.nan), ValueError, r"top_p must be in \(0, 1\], got nan"),
    (dict(temperature="1"), TypeError, "temperature must be a real number"),
    (dict(temperature=True), TypeError, "temperature must be a real number"),
    (dict(seed=1.5), TypeError, "seed must be an integer, got 1.5"),
    (dict(seed=-1), ValueError, r"seed must be in \[0, 18446744073709551616\), got -1"),
    (dict(seed=2**64), ValueError, "seed must be in"),
    (dict(max_batch_size=2.0), TypeError, "max_batch_size must be an integer"),
    (dict(max_batch_size=True), TypeError, "max_batch_size must be an integer"),
    (dict(num_pages=4.0), TypeError, "num_pages must be an integer"),
    (dict(num_pages=False), TypeError, "num_pages must be an integer"),
    (dict(request_ids=[0.0, 1.0]), TypeError, r"request_ids\[0\] must be an integer, got 0.0"),
    (dict(request_ids=[3, 3]), ValueError, r"request_ids must be distinct.*\[3\]"),
    (dict(request_ids=[0, -1]), ValueError, r"request_ids\[1\] must be in"),
    (dict(eos_token_id=2.0), TypeError, "eos_token_id must be an integer, got 2.0"),
    (dict(eos_token_id=True), TypeError, "eos_token_id must be an integer"),
    (dict(stop_token_ids=[5, "6"]), TypeError, r"stop_token_ids\[1\] must be an integer"),
    (dict(stop_token_ids=np.array([1.0])), TypeError, r"stop_token_ids\[0\] must be an integ"),
    (dict(progress="yes"), TypeError, "progress must be True or False"),
]


@pytest.mark.parametrize("kw, exc, match", BAD_ARGS, ids=[str(a[0]) for a in BAD_ARGS])
def test_bad_arguments_are_refused_by_name(kw, exc, match):
    model = tiny_model(torch.float32)
    with pytest.raises(exc, match=match):
        generate(model, **{"prompts": [[1, 2, 3], [4, 5]], "max_new_tokens": 3, **kw})


def test_integer_like_arguments_are_accepted_with_the_same_result():
    model = tiny_model(torch.float32)
    ps = prompts()[:3]
    free = generate(model, ps, NEW, temperature=1.0, seed=7)
    eos = int(free.completions[0][2])
    want = generate(model, ps, NEW, temperature=1.0, seed=7, eos_token_id=eos, top_k=300)
    assert want.finish_reasons[0] == "eos"
    for form in (np.int64(eos), torch.tensor(eos), [np.int32(eos)], torch.tensor([eos]),
                 (eos,), np.array([eos]), {eos}):
        got = generate(model, ps, np.int64(NEW), temperature=np.float32(1.0), seed=np.uint64(7),
                       eos_token_id=form, top_k=torch.tensor(300), request_ids=torch.arange(3),
                       max_batch_size=np.int8(2), num_pages=torch.tensor(10**9))
        assert_same_rollouts(got, want, f"eos_token_id={form!r}")
        assert got.finish_reasons == want.finish_reasons
    # top_k beyond the vocabulary restricts nothing (it does not overflow the kernel's int64).
    assert_same_rollouts(generate(model, ps, NEW, temperature=1.0, seed=7, eos_token_id=eos,
                                  top_k=10**30), want, "top_k=10**30")


def test_token_logprobs_refuses_bad_arguments_by_name():
    model = tiny_model(torch.float32)
    seq = torch.tensor([1, 2, 3])
    for kw, exc, match in [
            (dict(micro_batch_size=0), ValueError, "micro_batch_size must be >= 1, got 0"),
            (dict(micro_batch_size=1.5), TypeError, "micro_batch_size must be an integer"),
            (dict(micro_batch_size=True), TypeError, "micro_batch_size must be an integer"),
            (dict(packed="no"), TypeError, "packed must be True or False")]:
        with pytest.raises(exc, match=match):
            model.token_logprobs([seq], **kw)
    for seqs, exc, match in [
            ([torch.tensor([1.0, 2.7])], TypeError, "sequence 0 must be a 1-D sequence of int"),
            ([seq, [1, 2.5]], TypeError, "sequence 1 must be a 1-D sequence of integer"),
            ([torch.tensor([True, False])], TypeError, "sequence 0 must be a 1-D sequence"),
            ([[1, True]], TypeError, "sequence 0 must be a 1-D sequence of integer"),
            ([seq.view(1, 3)], TypeError, "sequence 0 must be a 1-D sequence"),
            (seq, TypeError, "wrap it in a list"),
            ([seq, [1, 320]], IndexError, r"sequence 1 holds token ids \[320\]")]:
        with pytest.raises(exc, match=match):
            model.token_logprobs(seqs)
    want = model.token_logprobs([seq, torch.tensor([4, 5])])
    for got in (model.token_logprobs([[1, 2, 3], np.array([4, 5])], micro_batch_size=np.int64(1)),
                model.token_logprobs(torch.tensor([[1, 2, 3], [4, 5, 6]]))[:1] + want[1:]):
        assert_bitwise(tuple(got), tuple(want), "integer-like sequences")


class _DivergingModel:
    """The model, except that this rank's logits are reversed at the second forward: a TP rank
    whose rollout diverges mid-way (generate takes anything with forward/new_cache/config)."""

    def __init__(self, model, diverge: bool):
        self.model, self.config, self.groups, self.diverge = model, model.config, model.groups, \
            diverge
        self.parameters, self.new_cache, self.calls = model.parameters, model.new_cache, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        out = self.model(*args, **kwargs)
        return out.flip(-1) if self.diverge and self.calls == 2 else out


def _tp_mismatch_rank():
    """TP 2 over 2 gloo ranks: each case's error text on this rank (None = returned)."""
    import tonp_parallel as tpar
    g = tpar.init_parallel(tp=2)
    torch.manual_seed(0)
    model, r = Qwen3MoeForCausalLM(_config(), groups=g).eval(), g.tp_rank
    base = [[1, 2, 3, 4], [5, 6]]
    cases = {
        "same": lambda: generate(model, base, 3, temperature=1.0, seed=3),
        "same_length_other_prompt": lambda: generate(model, [[1, 2, 3, 4 + r], [5, 6]], 3),
        "other_length": lambda: generate(model, [[1, 2, 3, 4][:4 - r], [5, 6]], 3),
        "other_setting": lambda: generate(model, base, 3, temperature=1.0, seed=r),
        "refused_on_rank_1": lambda: generate(model, base if r == 0 else [[1, 999]], 3),
        "diverged": lambda: generate(_DivergingModel(model, r == 1), base, 3),
        "scored_same": lambda: model.token_logprobs([torch.tensor(p) for p in base]),
        "scored_other": lambda: model.token_logprobs([torch.tensor([1, 2, 3 + r])]),
        "scored_other_length": lambda: model.token_logprobs([torch.arange(1, 4 + r)]),
        "same_again": lambda: generate(model, base, 3, temperature=1.0, seed=3),
    }
    out = {}
    for name, call in cases.items():
        try:
            out[name] = call()
        except Exception as e:  # noqa: BLE001 -- the test compares every rank's error
            out[name] = f"{type(e).__name__}: {e}"
    return out


def test_tp_ranks_given_different_calls_raise_on_every_rank():
    """Same-length and different-length prompts, other settings, one rank's bad input, and a
    rollout that diverges mid-way: every rank raises naming TP rank 1 (no gloo size mismatch,
    no hang, no rank 0's completion returned on rank 1); equal calls pass and agree, and the
    group works after the errors."""
    from dist_utils import run_distributed
    ranks = run_distributed(_tp_mismatch_rank, 2, timeout=120)
    for name in ("same", "same_again"):
        assert_same_rollouts(ranks[1][name], ranks[0][name], f"{name}: rank 1 vs rank 0")
    assert_same_rollouts(ranks[0]["same_again"], ranks[0]["same"], "the group after errors")
    assert_bitwise(tuple(ranks[1]["scored_same"]), tuple(ranks[0]["scored_same"]))
    for name, who, what in [
            ("same_length_other_prompt", "generate", "call"), ("other_length", "generate", "call"),
            ("other_setting", "generate", "call"), ("diverged", "generate", "result"),
            ("scored_other", "token_logprobs", "call"),
            ("scored_other_length", "token_logprobs", "call")]:
        for rank, res in enumerate(ranks):
            assert isinstance(res[name], str) and res[name].startswith(
                f"RuntimeError: {who}: TP rank(s) [1] (global rank(s) [1]) got a different "
                f"{what}"), f"{name}, rank {rank}: {res[name]!r}"
    assert ranks[1]["refused_on_rank_1"].startswith(
        "IndexError: generate: request 0: the prompt holds")
    assert ranks[0]["refused_on_rank_1"].startswith(
        "RuntimeError: generate: TP rank(s) [1] (global rank(s) [1]) refused their arguments")
