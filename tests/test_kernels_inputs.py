"""Bad kernel inputs get a clear error, the same in both kernel modes, never a silent wrong result:
temperatures fp32 cannot carry, logits / T that overflow, rows with no softmax, NaN logits in
sampling, seeds past 48 bits, float or wrapping index tensors, 0-d inputs. Each case failed (NaN,
junk token, truncation, wrap, IndexError from deep inside) before.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import tonp_kernels as tk
from conftest import assert_bitwise, randn

MODES = ("invariant", "torch")
MIN_T = torch.finfo(torch.float32).tiny


def _raises_alike(fn, exc, match):
    """fn() raises `exc` matching `match` in both modes, with the same message."""
    messages = []
    for mode in MODES:
        with tk.use(mode), pytest.raises(exc, match=match) as info:
            fn()
        messages.append(str(info.value))
    return messages


def _ids(n):
    return torch.arange(n)


# --- temperatures -------------------------------------------------------------------------------
def _temperature_ops(x, ids):
    return {
        "sample": lambda T: tk.sample(x, temperature=T, seed=1, request_ids=ids, positions=ids),
        "token_logprobs": lambda T: tk.token_logprobs(x, ids, temperature=T),
        "log_softmax": lambda T: tk.log_softmax(x, temperature=T),
        "logsumexp": lambda T: tk.logsumexp(x, temperature=T),
        "lse_partial": lambda T: tk.lse_partial(x, temperature=T),
        "target_logit": lambda T: tk.target_logit(x, ids, temperature=T),
    }


@pytest.mark.parametrize("T", (1e-300, 1e-45, 1e-39, -1.0, -0.5, math.nan, math.inf, -math.inf,
                               1e39))
def test_temperatures_fp32_cannot_carry_are_refused(T, gen):
    """1e-300 passes `> 0` but is 0 in fp32 (1e-45, 1e-39: denormals): NaN logprobs before."""
    x, ids = randn(3, 64, gen=gen), _ids(3)
    for op, fn in _temperature_ops(x, ids).items():
        msg = _raises_alike(lambda: fn(T), ValueError, f"tonp.{op}: temperature")[0]
        assert repr(tk.MIN_TEMPERATURE) in msg, "the message names the limit"


def test_temperature_zero_is_greedy_in_sample_only(gen):
    x, ids = randn(3, 64, gen=gen), _ids(3)
    for op, fn in _temperature_ops(x, ids).items():
        if op == "sample":
            for mode in MODES:
                with tk.use(mode):
                    assert_bitwise(fn(0.0), tk.argmax(x), f"sample at T=0 ({mode})")
        else:  # token_logprobs(T=0) was NaN in torch mode and an error in invariant mode
            _raises_alike(lambda: fn(0), ValueError, "temperature 0 means greedy")


def test_temperature_types_and_the_limit_itself(gen):
    assert tk.MIN_TEMPERATURE == MIN_T and tk.MAX_TEMPERATURE == torch.finfo(torch.float32).max
    # The rule is on the fp32 value the kernels divide by: a double rounding to a normal passes.
    for t, ok in ((MIN_T - 2.0 ** -150, True), (math.nextafter(MIN_T - 2.0 ** -150, 0), False),
                  (tk.MAX_TEMPERATURE + 2.0 ** 102, True), (tk.MAX_TEMPERATURE + 2.0 ** 103, False)):
        assert (float(torch.tensor(t, dtype=torch.float32)) in (MIN_T, tk.MAX_TEMPERATURE)) == ok
        if ok:
            assert tk.check_temperature(t, op="x") == t
            tk.log_softmax(torch.zeros(1, 8), temperature=t, chunks=1)  # the C++ rule agrees
        else:
            with pytest.raises(ValueError, match="fp32 value is a normal"):
                tk.check_temperature(t, op="x")
    assert tk.check_temperature(np.float32(0.5), op="x") == 0.5
    assert tk.check_temperature(0, op="sample", allow_zero=True) == 0.0
    for bad in ("1.0", None, True, torch.tensor(1.0)):
        with pytest.raises(TypeError, match="temperature must be a real number"):
            tk.check_temperature(bad, op="x")
    x, ids = randn(3, 64, gen=gen, scale=1e-3), _ids(3)   # |x| / MIN_T stays finite
    for mode in MODES:
        with tk.use(mode):
            for op, fn in _temperature_ops(x, ids).items():
                out = fn(tk.MIN_TEMPERATURE)
                for t in out if isinstance(out, tuple) else (out,):
                    assert not t.isnan().any(), f"{op} at the smallest temperature ({mode})"


# --- rows whose softmax does not exist ----------------------------------------------------------
def _rows(gen, special, row=1):
    x = randn(3, 64, gen=gen)
    x[row] = special(x[row])
    return x


def _softmax_ops(ids):
    return {
        "token_logprobs": lambda x, T: tk.token_logprobs(x, ids, temperature=T),
        "log_softmax": lambda x, T: tk.log_softmax(x, temperature=T),
        "sample": lambda x, T: tk.sample(x, temperature=T, seed=0, request_ids=ids,
                                         positions=ids),
    }


def test_logits_over_temperature_overflowing_are_refused_by_row(gen):
    """Row 1's logits / 1e-37 overflow fp32 (+inf max: inf - inf = NaN before)."""
    ids = _ids(3)
    x = _rows(gen, lambda r: r * 100)
    cases = {**_softmax_ops(ids), "logsumexp": lambda x, T: tk.logsumexp(x, temperature=T),
             "lse_partial": lambda x, T: tk.lse_partial(x, temperature=T)}
    small = randn(3, 64, gen=gen, scale=1e-36)
    for op, fn in cases.items():
        _raises_alike(lambda: fn(x, 1e-37), ValueError, rf"tonp.{op}: row 1: .*overflow")
        _raises_alike(lambda: fn(_rows(gen, lambda r: r.fill_(math.inf)), 1.0), ValueError,
                      rf"tonp.{op}: row 1: .*infinite logit")
        fn(small, 1e-37)                   # the same temperature with logits it can divide
    lp = x.detach().clone().requires_grad_(True)  # the training path of token_logprobs too
    with pytest.raises(ValueError, match="tonp.token_logprobs: row 1"):
        tk.token_logprobs(lp, ids, temperature=1e-37)


def test_rows_with_no_finite_logit(gen):
    """Every logit -inf: no softmax (error); logsumexp is -inf (log 0), lse_partial (-inf, 0)."""
    ids = _ids(3)
    x = _rows(gen, lambda r: r.fill_(-math.inf))
    for op, fn in _softmax_ops(ids).items():
        _raises_alike(lambda: fn(x, 1.0), ValueError, rf"tonp.{op}: row 1: every logit is -inf")
    for mode in MODES:
        with tk.use(mode):
            lse = tk.logsumexp(x)
            assert lse[1] == -math.inf and lse[[0, 2]].isfinite().all()
    m, s = tk.lse_partial(x)
    assert m[1] == -math.inf and s[1] == 0


def test_nan_logits(gen):
    """sample and argmax refuse a row holding a NaN (an all-NaN row drew token 0 before); the
    vocab reductions give NaN for that row only (an all-NaN chunk used to read as masked);
    max_with_index, the shard primitive, skips NaN."""
    ids = _ids(3)
    one = _rows(gen, lambda r: r.index_fill_(0, torch.tensor([5]), math.nan))
    full = _rows(gen, lambda r: r.fill_(math.nan))
    chunk = _rows(gen, lambda r: r.index_fill_(0, torch.arange(8, 16), math.nan))  # chunk 1 of 8
    for x in (one, full, chunk):
        for T in (1.0, 0.0):
            _raises_alike(lambda: tk.sample(x, temperature=T, seed=0, request_ids=ids,
                                             positions=ids), ValueError,
                          "tonp.sample: row 1 holds a NaN logit")
        _raises_alike(lambda: tk.argmax(x), ValueError, "tonp.argmax: row 1 holds a NaN logit")
        value, index = tk.max_with_index(x)
        skipped = x.nan_to_num(nan=-math.inf, posinf=math.inf, neginf=-math.inf)
        assert_bitwise(index[[0, 2]], tk.argmax(x[[0, 2]]), "max_with_index, other rows")
        if bool(x[1].isnan().all()):
            assert index[1] == 0 and value[1].isnan()
        else:
            assert index[1] == int(skipped[1].argmax()) and value[1] == skipped[1].max()
        for mode in MODES:
            with tk.use(mode):
                for name, out in (("logsumexp", tk.logsumexp(x)),
                                  ("token_logprobs", tk.token_logprobs(x, ids)),
                                  ("log_softmax", tk.log_softmax(x).amax(-1))):
                    assert out[1].isnan() and out[[0, 2]].isfinite().all(), f"{name} ({mode})"


# --- sampling seeds -----------------------------------------------------------------------------
# Draws recorded from the build whose noise is CONTRACT.md's explicit construction (the 64-bit
# hash, the exponential variate from fp32 and tonp's log): the C++ kernel and the Triton kernel
# (tests/test_triton_sample.py) must keep drawing them.
_LOGITS = (((torch.arange(6 * 64) * 7919) % 1009).float() / 256 - 2).reshape(6, 64)  # exact
_REQ, _POS = torch.tensor([0, 1, 2, 3, 7, 11]), torch.tensor([0, 5, 9, 100, 4096, 3])
_RECORDED = {  # seed: (T=0.9 draws, T=1.0 top_k=10 top_p=0.9 draws)
    0: ([8, 43, 41, 60, 57, 50], [7, 29, 44, 26, 8, 50]),
    1: ([7, 63, 5, 26, 61, 56], [7, 42, 51, 26, 61, 56]),
    7: ([48, 9, 32, 11, 48, 23], [27, 9, 24, 39, 48, 23]),
    123456789: ([54, 56, 4, 59, 11, 63], [14, 2, 4, 59, 48, 63]),
    2 ** 32 + 7: ([8, 16, 25, 14, 22, 51], [60, 16, 31, 39, 21, 63]),
    2 ** 47 + 5: ([27, 42, 25, 47, 4, 30], [27, 42, 57, 39, 2, 30]),
    2 ** 48 - 1: ([16, 16, 51, 13, 56, 50], [47, 16, 51, 13, 21, 50]),
    2 ** 64 - 1: ([8, 35, 20, 60, 48, 51], [60, 35, 31, 39, 48, 56]),
}


def _draw(seed, **kw):
    kw = kw or dict(temperature=0.9)
    return tk.sample(_LOGITS, seed=seed, request_ids=_REQ, positions=_POS, **kw).tolist()


def test_seeds_take_all_64_bits_and_draw_what_was_recorded():
    for seed, (plain, filtered) in _RECORDED.items():
        assert _draw(seed) == plain, f"seed {seed}"
        assert _draw(seed, temperature=1.0, top_k=10, top_p=0.9) == filtered, f"seed {seed}"
    assert _draw(2 ** 48) != _draw(0), "2**48 drew like 0: the seed was masked to 48 bits"
    assert _draw(2 ** 63 + 5) != _draw(5) and _draw(2 ** 64 - 1) != _draw(2 ** 48 - 1)
    assert _draw(np.uint64(2 ** 63 + 5)) == _draw(2 ** 63 + 5)
    for bad in (2 ** 64, -1):
        _raises_alike(lambda: _draw(bad), ValueError, r"tonp.sample: seed must be in \[0, 2\*\*64")
    for bad in (1.5, True, "3", None):
        _raises_alike(lambda: _draw(bad), TypeError, "tonp.sample: seed must be an integer")


# --- index tensors ------------------------------------------------------------------------------
def test_index_tensors_must_hold_integers_that_fit(gen):
    q, k = randn(10, 4, 64, gen=gen), randn(10, 2, 64, gen=gen)
    for cu in (torch.tensor([0.0, 10.0]), torch.tensor([False, True])):
        _raises_alike(lambda: tk.attention_varlen(q, k, k, cu, scale=0.1), TypeError,
                      "tonp.attention_varlen: cu_seqlens must be an integer tensor")
    # int32 wrapped 2**32 + 10 to 10: a T=10 batch of garbage offsets passed before.
    _raises_alike(lambda: tk.attention_varlen(q, k, k, torch.tensor([0, 2 ** 32 + 10]), scale=0.1),
                  ValueError, "cu_seqlens must run from 0 to T=10")
    kc = randn(3, 16, 2, 64, gen=gen)
    pt, qs, qp = torch.tensor([[2, 0, 1]]), torch.zeros(10, dtype=torch.int64), torch.arange(10)

    def paged(pt=pt, qs=qs, qp=qp):
        return tk.attention_paged(q, kc, kc, pt, qs, qp, scale=0.1)

    paged()
    for name, kw in (("page_table", {"pt": pt.float()}), ("q_seq", {"qs": qs.float()}),
                     ("q_pos", {"qp": qp + 0.5}), ("q_pos", {"qp": qp > 3})):
        _raises_alike(lambda: paged(**kw), TypeError,
                      f"tonp.attention_paged: {name} must be an integer tensor")
    # An int64 page id 2**32 + 2 narrowed to int32 read page 2 before.
    _raises_alike(lambda: paged(pt=pt + torch.tensor([[2 ** 32, 0, 0]])), IndexError,
                  "tonp.attention_paged: page")
    table = torch.randn(32, 64, generator=gen)
    _raises_alike(lambda: tk.rope(q, table, table, torch.arange(10.0)), TypeError,
                  "tonp.rope: positions must be an integer tensor")
    x = randn(3, 64, gen=gen)
    for t in (torch.tensor([1.0, 2.0, 3.0]), torch.tensor([True, False, True])):
        _raises_alike(lambda: tk.token_logprobs(x, t), TypeError,
                      "tonp.token_logprobs: targets must be an integer tensor")
        with pytest.raises(TypeError, match="tonp.sample: request_ids must be an integer"):
            tk.sample(x, temperature=1.0, seed=0, request_ids=t, positions=_ids(3))


# --- 0-d inputs ---------------------------------------------------------------------------------
def test_zero_dim_inputs_name_the_op_and_the_argument(gen):
    s, x, ids = torch.tensor(1.0), randn(3, 64, gen=gen), _ids(3)
    q, k = randn(10, 4, 64, gen=gen), randn(10, 2, 64, gen=gen)
    cases = [
        ("linear", "x", lambda: tk.linear(s, x)),
        ("linear", "weight", lambda: tk.linear(x, s)),
        ("rms_norm", "x", lambda: tk.rms_norm(s, x[0], 1e-6)),
        ("attention_varlen", "q", lambda: tk.attention_varlen(s, k, k, ids, scale=0.1)),
        ("attention_varlen", "k", lambda: tk.attention_varlen(q, s, s, ids, scale=0.1)),
        ("attention_varlen", "cu_seqlens", lambda: tk.attention_varlen(q, k, k, ids[0], scale=.1)),
        ("rope", "x", lambda: tk.rope(s, x, x, ids)),
        ("moe_route", "router_logits", lambda: tk.moe_route(s, 1, True)),
        ("moe_combine", "weights", lambda: tk.moe_combine(s, x[None])),
        ("moe_experts", "x", lambda: tk.moe_experts(s, ids[:, None], x[None], x[None])),
        ("logsumexp", "logits", lambda: tk.logsumexp(s)),
        ("log_softmax", "logits", lambda: tk.log_softmax(s)),
        ("lse_partial", "logits", lambda: tk.lse_partial(s)),
        ("token_logprobs", "logits", lambda: tk.token_logprobs(s, ids[0])),
        ("argmax", "logits", lambda: tk.argmax(s)),
        ("max_with_index", "logits", lambda: tk.max_with_index(s)),
        ("sample", "logits", lambda: tk.sample(s, temperature=1.0, seed=0, request_ids=ids,
                                               positions=ids)),
    ]
    for op, arg, fn in cases:
        for msg in _raises_alike(fn, ValueError, f"tonp.{op}: "):
            assert arg in msg and "tuple index" not in msg, msg
