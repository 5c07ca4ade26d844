"""Fuzzing the rollout and scoring entry points: `generate` and `model.token_logprobs`.

Each case (seeded, so a failure replays) starts from a valid call and replaces a few arguments by
random values: valid ones in every accepted form (lists, tensors, numpy integers, huge top_k,
tiny caches that force preemption) and bad ones (wrong types, bools and floats for integers,
out-of-range values, empty prompts, token ids outside the vocabulary, huge max_new_tokens, NaN
and fp32-underflowing temperatures). A call must then either
* raise TypeError / ValueError / IndexError / CacheFullError whose message starts with the
  function's name and names one of the replaced arguments, or
* return a correct result: tokens in the vocabulary, lengths and finish reasons that follow the
  settings, finite logprobs equal bit for bit to what the training forward gives the returned
  sequences (generate), or to each sequence scored alone (token_logprobs);
never another exception, a hang (the timeout) or a silent NaN.
"""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from conftest import assert_bitwise
from test_generation import tiny_model
from tonp_models import generate
from tonp_models.layers import CacheFullError

CLEAN_ERRORS = (TypeError, ValueError, IndexError, CacheFullError)
CASES = 160
V, LIMIT = 320, 1024  # the tiny preset's vocabulary and position limit


def _ids(rng: random.Random, n: int):
    """n valid token ids in a random accepted form."""
    ids = [rng.randrange(V) for _ in range(n)]
    return rng.choice([ids, tuple(ids), torch.tensor(ids), torch.tensor(ids, dtype=torch.int32),
                       np.array(ids, dtype=np.int64)])


def _some_ids(rng: random.Random):
    return [_ids(rng, rng.randint(1, 20)) for _ in range(rng.randint(1, 4))]


def _bad_ids(rng: random.Random):
    """A list of sequences one of which is not a valid token-id sequence."""
    seqs = _some_ids(rng)
    seqs[rng.randrange(len(seqs))] = rng.choice([
        [], [V], [-1], [1, 2**70], [1.0, 2.0], torch.tensor([1.5]), [True, 1], "abc", 7, None,
        torch.zeros(2, 3, dtype=torch.long), torch.tensor([1, 2], dtype=torch.bool),
        [0] * (LIMIT + 1)])
    return rng.choice([seqs, torch.tensor([1, 2, 3]), "prompt", 5, None, {0: [1]}])  \
        if rng.random() < 0.2 else seqs


def _request_ids(rng: random.Random, n: int, good: bool):
    if good:
        return rng.choice([None, rng.sample(range(10**6), n), torch.arange(n) * 3,
                           np.arange(n, dtype=np.uint32)])
    return rng.choice([[0] * n, [-1] * n, [0.5] * n, list(range(n + 1)), [2**63] * n, "ab"])


TOKENS = ([None, 3, [1, 2], (5,), np.int64(4), torch.tensor(5), torch.tensor([6, 7]), {8}],
          [V, -1, 1.5, "3", [1, 2.0], True, [None], torch.tensor([[1]]), 10**30])
# Per argument: (valid values, bad values). The base call takes valid values that never make
# another argument invalid (SAFE: no cache too small for a request); the redrawn ones take any.
GENERATE_ARGS = {
    "prompts": (_some_ids, _bad_ids),
    "max_new_tokens": ([0, 1, 3, 6, 12, 20, np.int64(4), torch.tensor(2)],
                       [-1, 1.5, True, "3", None, 10**9, LIMIT, 2**70]),
    "temperature": ([0, 0.0, 0.5, 1.0, 1.7, np.float32(0.8), torch.tensor(1.2)],
                    [-1.0, math.nan, math.inf, -math.inf, 1e-300, 1e-45, 1e-39, 1e39, "1",
                     True, None]),
    "top_k": ([None, 1, 5, 300, 10**30, np.int32(7)], [0, -3, 1.5, True, "5"]),
    "top_p": ([None, 0.5, 1.0, np.float64(0.9)], [0.0, -0.1, 1.5, math.nan, "0.5", True]),
    "seed": ([0, 7, 2**63, 2**64 - 1, np.uint64(5), torch.tensor(11)],
             [-1, 2**64, 1.0, "s", None, True]),
    "eos_token_id": TOKENS,
    "stop_token_ids": TOKENS,
    "max_batch_size": ([None, 1, 2, 10**18, np.int64(3)], [0, -1, 1.5, True, "2"]),
    "num_pages": ([None, 2, 3, 4, 5, 10**12], [0, -2, 1.5, False, "8", 1]),
    "request_ids": (True, False),          # built for the prompts
    "progress": ([False], ["yes", 1, None]),
}
SAFE = {"num_pages": [None, 3, 4, 5, 10**12]}  # base values: every request fits alone


def _draw(rng: random.Random, table: dict, name: str, kw: dict, good: bool):
    valid, bad = table[name]
    if name == "request_ids":
        n = len(kw["prompts"]) if isinstance(kw["prompts"], list) else 2
        return _request_ids(rng, n, good)
    pool = valid if good else bad
    return pool(rng) if callable(pool) else rng.choice(pool)


def _check_clean_error(e: Exception, who: str, replaced) -> None:
    msg = str(e)
    assert isinstance(e, CLEAN_ERRORS), f"{type(e).__name__} is not a clean error: {msg}"
    assert msg.startswith(f"{who}: "), f"the message does not name {who}: {msg}"
    names = [n.rstrip("s") for n in replaced]  # "prompts" -> "prompt 2 ...", "seed", ...
    assert any(n in msg for n in names), f"the message names none of {replaced}: {msg}"


def _check_rollout(model, out, kw: dict) -> None:
    n_new = int(kw["max_new_tokens"])
    ends = set()
    for v in (kw.get("eos_token_id"), kw.get("stop_token_ids")):
        many = isinstance(v, (list, tuple, set)) or getattr(v, "ndim", 0) == 1
        ends |= set() if v is None else {int(x) for x in (v if many else [v])}
    assert len(out.sequences) == len(kw["prompts"])
    for seq, lp, p, why in zip(out.sequences, out.logprobs, out.prompt_lengths,
                               out.finish_reasons):
        new = seq[p:]
        assert seq.dtype == torch.int64 and lp.dtype == torch.float32 and len(lp) == len(new)
        assert bool(((seq >= 0) & (seq < V)).all()), f"token out of the vocabulary: {seq}"
        assert bool(torch.isfinite(lp).all()) and bool((lp <= 0).all()), f"bad logprobs {lp}"
        assert len(new) <= n_new and (len(new) == n_new or int(new[-1]) in ends), why
        assert (why == "length") == (len(new) == n_new and int(new[-1]) not in ends) \
            if len(new) else why == "length"
    if any(len(lp) for lp in out.logprobs):  # the training forward gives the same bits
        t = kw.get("temperature", 0)
        train = model.token_logprobs(out.sequences, temperature=float(t) or 1.0)
        for a, b, p in zip(train, out.logprobs, out.prompt_lengths):
            assert_bitwise(a[p - 1:], b, f"training forward vs rollout, {kw}")


def _fuzz(who: str, calls, call, check) -> None:
    """Make every (kwargs, redrawn names) call: a clean error naming a redrawn argument, or a
    result check(kwargs, result) accepts. Both outcomes must be common, so the test can fail
    either way."""
    outcomes = {"returned": 0, "refused": 0}
    for kw, replaced in calls:
        try:
            with torch.no_grad():
                out = call(**kw)
        except Exception as e:  # noqa: BLE001 -- what was raised is the test
            _check_clean_error(e, who, replaced)
            outcomes["refused"] += 1
            continue
        check(kw, out)
        outcomes["returned"] += 1
    assert min(outcomes.values()) > CASES // 5, outcomes


def _generate_calls(rng: random.Random):
    for _ in range(CASES):
        kw = {"prompts": _some_ids(rng)}
        for name in GENERATE_ARGS:  # a random valid call ...
            kw[name] = rng.choice(SAFE[name]) if name in SAFE else \
                _draw(rng, GENERATE_ARGS, name, kw, True)
        replaced = rng.sample(list(GENERATE_ARGS), rng.randint(1, 2))  # ... then 1 or 2 redrawn
        for name in sorted(replaced, key=lambda n: n == "request_ids"):  # after the prompts
            kw[name] = _draw(rng, GENERATE_ARGS, name, kw, rng.random() < 0.5)
        if "prompts" in replaced and "request_ids" not in replaced:
            kw["request_ids"] = None                   # the base's were for the base prompts
        yield kw, replaced


@pytest.mark.timeout(240)
def test_fuzz_generate():
    model = tiny_model(torch.float32)
    _fuzz("generate", _generate_calls(random.Random(2024)), lambda **kw: generate(model, **kw),
          lambda kw, out: _check_rollout(model, out, kw))


SCORE_ARGS = {
    "sequences": (_some_ids, _bad_ids),
    "temperature": ([0.5, 1.0, 2.0, np.float32(0.7), 1.0000001],
                    [0, 0.0, -1.0, math.nan, math.inf, 1e-45, 1e-300, "1", True, None]),
    "micro_batch_size": ([None, 1, 2, 5, np.int64(3), 10**18], [0, -1, 1.5, True, "2"]),
    "packed": ([True, False], ["yes", 1, None]),
}


def _score_calls(rng: random.Random):
    for _ in range(CASES):
        kw = {"sequences": _some_ids(rng)}
        replaced = rng.sample(list(SCORE_ARGS), rng.randint(1, 2))
        for name in replaced:
            kw[name] = _draw(rng, SCORE_ARGS, name, kw, rng.random() < 0.5)
        yield kw, replaced


def _check_scores(model, kw: dict, got) -> None:
    """Finite logprobs of the right shapes, each sequence's the bits it gets scored alone."""
    seqs, T = kw["sequences"], kw.get("temperature", 1.0)
    assert len(got) == len(seqs)
    for s, lp in zip(seqs, got):
        assert lp.dtype == torch.float32 and lp.shape == (len(s) - 1,)
        assert bool(torch.isfinite(lp).all()) and bool((lp <= 0).all()), lp
        with torch.no_grad():
            assert_bitwise(model.token_logprobs([torch.as_tensor(s)], temperature=T)[0], lp,
                           f"sequence scored alone vs in {kw}")


@pytest.mark.timeout(240)
def test_fuzz_token_logprobs():
    model = tiny_model(torch.float32)
    _fuzz("token_logprobs", _score_calls(random.Random(7)), model.token_logprobs,
          lambda kw, got: _check_scores(model, kw, got))
