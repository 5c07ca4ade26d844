"""Fuzz every public kernel op in both modes with bad inputs: wrong dtypes, ranks and devices, 0-d,
empty, non-contiguous, NaN / inf, huge values, out-of-range ids, bad sizes and scalars.

Each call must end in one of two ways: a clean error (ValueError, TypeError, IndexError or
RuntimeError, the op named in the message), or a correct result (kernels/reference.py, with NaN
and inf exactly where the reference has them: never a silent NaN). Where both modes refuse an
input they refuse it with the same exception type. Seeded; every op and mutation in a few seconds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import pytest
import torch

import tonp_kernels as tk
from tonp_kernels import reference

MODES = ("invariant", "torch")
CLEAN = (ValueError, TypeError, IndexError, RuntimeError)
# Inputs one backend accepts and the other refuses by design (both outcomes are checked).
ONE_MODE_REFUSES = {("attention_paged", "k_cache", "non-contiguous"),
                    ("attention_paged", "v_cache", "non-contiguous")}
NAMED_AS = {"linear_partial": "linear"}  # linear_partial is linear(out_dtype=float32)


@dataclass
class Op:
    """A public op: good arguments, how to call it, and what a correct result is."""
    make: Callable[[torch.Generator], Dict]       # good arguments by name
    call: Callable[[Dict], object]
    expect: Callable[[Dict, object], None]        # raises AssertionError on a wrong result
    kinds: Dict[str, str]                          # argument -> float | int | size | real | list


def _close(got, want, what, nan_in=False):
    """No NaN the reference does not have (never a silent NaN), inf where the reference has it,
    finite values within a bf16-sized tolerance. nan_in: an input holds NaN / inf, which may
    spread further than in the reference (dense attention multiplies a masked key's zero
    probability by its value: stock SDPA spreads a NaN there, the reference or the kernel not)."""
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    assert nan_in or not bool((got.isnan() & ~want.isnan()).any()), \
        f"{what}: NaN where the reference has none"
    inf = (got.isinf() | want.isinf()) & ~(want.isnan() | got.isnan())
    assert torch.equal(got[inf], want[inf]), f"{what}: inf where the reference is finite"
    fin = ~(got.isnan() | want.isnan() | inf)
    scale = float(want[fin].abs().max()) if bool(fin.any()) else 1.0
    torch.testing.assert_close(got[fin], want[fin], rtol=2e-2, atol=2e-2 * max(scale, 1.0),
                               msg=lambda m: f"{what}: {m}")


def _nan_in(kw):
    return any(isinstance(v, torch.Tensor) and v.is_floating_point() and
               not bool(v.isfinite().all()) for v in kw.values())


def _ref(fn, *names):
    def expect(kw, got):
        want = fn(*[kw[n] for n in names])
        for i, (g, w) in enumerate(zip(*(x if isinstance(x, tuple) else (x,)
                                         for x in (got, want)), strict=True)):
            _close(g, w, f"output {i}", _nan_in(kw))
    return expect


def _randn(gen, *shape, scale=1.0):
    return torch.randn(*shape, generator=gen) * scale


def _pages(gen):
    k, v = _randn(gen, 3, 16, 2, 64), _randn(gen, 3, 16, 2, 64)
    return dict(q=_randn(gen, 5, 4, 64), k_cache=k, v_cache=v,
                page_table=torch.tensor([[2, 0, 1]], dtype=torch.int32),
                q_seq=torch.zeros(5, dtype=torch.int64), q_pos=torch.tensor([0, 7, 16, 30, 47]),
                scale=0.125)


def _lse_partial_expect(kw, got):
    m, s = got
    _close(m + s.log(), reference.logsumexp(kw["logits"], kw["temperature"]), "m + log s")


def _max_expect(kw, got, skip_nan=False):
    """argmax: the reference's; max_with_index skips NaN (an all-NaN row: (NaN, 0))."""
    x = kw["logits"].float()
    if skip_nan:
        none = x.isnan().all(-1)
        x = x.nan_to_num(nan=-math.inf, posinf=math.inf, neginf=-math.inf)
        assert bool(got[0][none].isnan().all()) and not bool(got[1][none].any())
        x[none] = 0.0
        got = (torch.where(none, 0.0, got[0]), got[1])
    _close(got[0], x.amax(-1), "max")
    assert torch.equal(got[1], reference.argmax(x)), "index of the max"


def _sample_expect(kw, got):
    x = kw["logits"]
    assert got.dtype == torch.int64 and got.shape == x.shape[:1]
    if kw["temperature"] == 0:
        assert torch.equal(got, reference.argmax(x)), "greedy draws the argmax"
    assert bool(((got >= 0) & (got < x.shape[1])).all()), "a token id out of the vocabulary"
    assert bool(x.gather(1, got[:, None]).isfinite().all()), "drew a masked or non-finite token"


def _route_expect(kw, got):
    """Rows with a NaN or +inf logit: NaN weights (torch.softmax gives NaN too) and valid ids;
    other rows: k ids of the largest fp32 softmax probabilities (which of tied ones: stock torch
    does not say; the kernels' lower-id rule is tested in test_kernels_misc) and their weights."""
    x, k = kw["router_logits"], kw["top_k"]
    ids, w = got
    assert bool(((ids >= 0) & (ids < x.shape[1])).all()), "an expert id out of range"
    bad = (x.isnan() | (x == math.inf)).any(-1)
    assert bool(w[bad].isnan().all()), "a row with a non-finite logit lost its NaN"
    probs = torch.softmax(x[~bad].float(), -1)
    assert torch.equal(probs.gather(-1, ids[~bad]), probs.topk(k, -1).values), "not a top-k"
    _close(w[~bad], reference.moe_route(x[~bad], k, kw["normalize"])[1], "weights")


def _experts_ref(x, ids, gate_up, down, first_expert):
    return reference.moe_experts(x, ids, gate_up, down, first_expert)


OPS: Dict[str, Op] = {
    "linear": Op(lambda g: dict(x=_randn(g, 5, 64), weight=_randn(g, 24, 64), bias=_randn(g, 24),
                                chunks=8),
                 lambda kw: tk.linear(kw["x"], kw["weight"], kw["bias"], chunks=kw["chunks"]),
                 _ref(reference.linear, "x", "weight", "bias"),
                 dict(x="float", weight="float", bias="float", chunks="size")),
    "linear_partial": Op(lambda g: dict(x=_randn(g, 3, 32), weight=_randn(g, 8, 32), chunks=4),
                         lambda kw: tk.linear_partial(kw["x"], kw["weight"], chunks=kw["chunks"]),
                         _ref(lambda x, w: reference.linear(x, w, out_dtype=torch.float32),
                              "x", "weight"),
                         dict(x="float", weight="float", chunks="size")),
    "tree_sum": Op(lambda g: dict(partials=[_randn(g, 7) for _ in range(3)]),
                   lambda kw: tk.tree_sum(kw["partials"]),
                   _ref(lambda p: torch.stack(list(p)).sum(0), "partials"),
                   dict(partials="list")),
    "rms_norm": Op(lambda g: dict(x=_randn(g, 4, 40), weight=_randn(g, 40), eps=1e-6),
                   lambda kw: tk.rms_norm(kw["x"], kw["weight"], kw["eps"]),
                   _ref(reference.rms_norm, "x", "weight", "eps"),
                   dict(x="float", weight="float", eps="real")),
    "silu_mul": Op(lambda g: dict(gate=_randn(g, 4, 37), up=_randn(g, 4, 37)),
                   lambda kw: tk.silu_mul(kw["gate"], kw["up"]),
                   _ref(reference.silu_mul, "gate", "up"), dict(gate="float", up="float")),
    "attention_varlen": Op(
        lambda g: dict(q=_randn(g, 9, 4, 64), k=_randn(g, 9, 2, 64), v=_randn(g, 9, 2, 64),
                       cu_seqlens=torch.tensor([0, 4, 9]), scale=0.125, block=4),
        lambda kw: tk.attention_varlen(kw["q"], kw["k"], kw["v"], kw["cu_seqlens"],
                                       scale=kw["scale"], block=kw["block"]),
        _ref(reference.attention_varlen, "q", "k", "v", "cu_seqlens", "scale"),
        dict(q="float", k="float", v="float", cu_seqlens="int", scale="real", block="size")),
    "attention_paged": Op(
        _pages, lambda kw: tk.attention_paged(kw["q"], kw["k_cache"], kw["v_cache"],
                                              kw["page_table"], kw["q_seq"], kw["q_pos"],
                                              scale=kw["scale"]),
        _ref(reference.attention_paged, "q", "k_cache", "v_cache", "page_table", "q_seq", "q_pos",
             "scale"),
        dict(q="float", k_cache="float", v_cache="float", page_table="int", q_seq="int",
             q_pos="int", scale="real")),
    "rope": Op(lambda g: dict(x=_randn(g, 6, 2, 64), cos=_randn(g, 32, 64), sin=_randn(g, 32, 64),
                              positions=torch.tensor([0, 3, 31, 7, 7, 1])),
               lambda kw: tk.rope(kw["x"], kw["cos"], kw["sin"], kw["positions"]),
               _ref(reference.rope, "x", "cos", "sin", "positions"),
               dict(x="float", cos="float", sin="float", positions="int")),
    "moe_route": Op(lambda g: dict(router_logits=torch.randperm(8, generator=g).float()[None]
                                   .repeat(3, 1), top_k=2, normalize=True),
                    lambda kw: tk.moe_route(kw["router_logits"], kw["top_k"], kw["normalize"]),
                    _route_expect,
                    dict(router_logits="float", top_k="size")),
    "moe_combine": Op(lambda g: dict(weights=torch.rand(4, 2, generator=g),
                                     expert_out=_randn(g, 4, 2, 24)),
                      lambda kw: tk.moe_combine(kw["weights"], kw["expert_out"]),
                      _ref(reference.moe_combine, "weights", "expert_out"),
                      dict(weights="float", expert_out="float")),
    "moe_experts": Op(lambda g: dict(x=_randn(g, 4, 32), expert_ids=torch.tensor([[1, 2]] * 4),
                                     gate_up=_randn(g, 3, 32, 32, scale=0.2),
                                     down=_randn(g, 3, 32, 16, scale=0.2), first_expert=0,
                                     chunks=8),
                      lambda kw: tk.moe_experts(kw["x"], kw["expert_ids"], kw["gate_up"],
                                                kw["down"], first_expert=kw["first_expert"],
                                                chunks=kw["chunks"]),
                      _ref(_experts_ref, "x", "expert_ids", "gate_up", "down", "first_expert"),
                      dict(x="float", expert_ids="int", gate_up="float", down="float",
                           first_expert="size", chunks="size")),
}
_VOCAB = dict(logits="float", temperature="real", chunks="size")


def _vocab_op(fn, ref, **extra):
    def make(g):
        kw = dict(logits=_randn(g, 3, 64, scale=3.0), temperature=0.7, chunks=8)
        if "targets" in extra:
            kw["targets"] = torch.tensor([0, 63, 17])
        return kw
    return Op(make, fn, ref, {**_VOCAB, **extra})


OPS.update({
    "logsumexp": _vocab_op(lambda kw: tk.logsumexp(kw["logits"], temperature=kw["temperature"],
                                                   chunks=kw["chunks"]),
                           _ref(reference.logsumexp, "logits", "temperature")),
    "log_softmax": _vocab_op(lambda kw: tk.log_softmax(kw["logits"],
                                                       temperature=kw["temperature"],
                                                       chunks=kw["chunks"]),
                             _ref(reference.log_softmax, "logits", "temperature")),
    "lse_partial": _vocab_op(lambda kw: tk.lse_partial(kw["logits"],
                                                       temperature=kw["temperature"],
                                                       chunks=kw["chunks"]), _lse_partial_expect),
    "token_logprobs": _vocab_op(lambda kw: tk.token_logprobs(kw["logits"], kw["targets"],
                                                             temperature=kw["temperature"],
                                                             chunks=kw["chunks"]),
                                _ref(reference.token_logprobs, "logits", "targets", "temperature"),
                                targets="int"),
    "target_logit": _vocab_op(lambda kw: tk.target_logit(kw["logits"], kw["targets"],
                                                         temperature=kw["temperature"]),
                              _ref(lambda x, t, T: x.float().gather(-1, t[:, None])[:, 0] / T,
                                   "logits", "targets", "temperature"), targets="int"),
    "argmax": Op(lambda g: dict(logits=_randn(g, 3, 64)), lambda kw: tk.argmax(kw["logits"]),
                 lambda kw, o: _max_expect(kw, (kw["logits"].float().amax(-1), o)),
                 dict(logits="float")),
    "max_with_index": Op(lambda g: dict(logits=_randn(g, 3, 64)),
                         lambda kw: tk.max_with_index(kw["logits"]),
                         lambda kw, o: _max_expect(kw, o, skip_nan=True),
                         dict(logits="float")),
    "lse_finish": Op(lambda g: dict(maxes=_randn(g, 2, 3), sums=torch.rand(2, 3, generator=g) + 1),
                     lambda kw: tk.lse_finish(kw["maxes"], kw["sums"]),
                     _ref(lambda m, s: (m + s.log()).logsumexp(0), "maxes", "sums"),
                     dict(maxes="float", sums="float")),
    "sample": Op(lambda g: dict(logits=_randn(g, 3, 64), temperature=0.8, seed=7,
                                request_ids=torch.arange(3), positions=torch.tensor([0, 5, 9]),
                                top_k=20, top_p=0.9),
                 lambda kw: tk.sample(kw["logits"], temperature=kw["temperature"], seed=kw["seed"],
                                      request_ids=kw["request_ids"], positions=kw["positions"],
                                      top_k=kw["top_k"], top_p=kw["top_p"]),
                 _sample_expect,
                 dict(logits="float", temperature="real", seed="size", request_ids="int",
                      positions="int", top_k="size", top_p="real")),
})


def _tensor_mutations(t: torch.Tensor, kind: str, gen: torch.Generator) -> Dict[str, object]:
    out = {"0-d": t.reshape(-1)[0].clone() if t.numel() else torch.tensor(1.0),
           "extra dim": t[None], "meta": t.to("meta"), "list": t.tolist(),
           "non-contiguous": t.transpose(0, -1).contiguous().transpose(0, -1) if t.dim() > 1
           else t.repeat_interleave(2)[::2]}
    if t.dim() >= 1:
        out["one dim less"] = t[0]
        out["empty"] = t[:0]
    if kind == "float":
        i = int(torch.randint(0, max(t.numel(), 1), (1,), generator=gen))
        for name, v in (("nan", math.nan), ("+inf", math.inf), ("-inf", -math.inf)):
            bad = t.clone()
            bad.view(-1)[i] = v
            out[name] = bad
        out["huge"] = t * 1e30
        for dt in (torch.float16, torch.float64, torch.int64, torch.bool):
            out[str(dt)] = t.to(dt)
        out["bfloat16"] = t.bfloat16()
    else:
        for name, v in (("+2**40", 2 ** 40), ("-1", None), ("+10**6", 10 ** 6)):
            out[name] = t + v if v is not None else t - t.max() - 1
        out["float"], out["bool"] = t.float(), t > 0
        out["int32"] = t.int()
    return out


def _scalar_mutations(kind: str) -> Dict[str, object]:
    common = {"str": "8", "None": None, "bool": True, "tensor": torch.tensor(2)}
    if kind == "size":
        return {**common, "-1": -1, "0": 0, "3": 3, "1.5": 1.5, "2**40": 2 ** 40, "2**64": 2 ** 64}
    return {**common, "nan": math.nan, "inf": math.inf, "-1": -1.0, "0": 0.0, "1e-300": 1e-300,
            "1e300": 1e300}


def _mutations(op: Op, gen: torch.Generator):
    """(argument, mutation name, arguments) for one bad argument at a time."""
    good = op.make(gen)
    for arg, kind in op.kinds.items():
        if kind == "list":
            ps = good[arg]
            cases = {"empty": [], "tensor list of one": ps[:1], "a non-tensor": ps[:2] + [1.0],
                     "shapes differ": ps[:2] + [ps[2][:3]], "stacked": torch.stack(ps)}
        elif kind in ("float", "int"):
            cases = _tensor_mutations(good[arg], kind, gen)
        else:
            cases = _scalar_mutations(kind)
        for name, value in cases.items():
            yield arg, name, {**good, arg: value}


def _outcome(op_name: str, op: Op, kw: Dict, mode: str):
    """None for a correct result, else the exception type; fails on anything unclean."""
    with tk.use(mode):
        try:
            got = op.call(kw)
        except CLEAN as e:
            name = NAMED_AS.get(op_name, op_name)
            assert f"tonp.{name}" in str(e) or f"tonp::{name}" in str(e), \
                f"{type(e).__name__} without the op's name: {e}"
            return type(e)
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"unclean {type(e).__name__}: {e}") from e
    if any(isinstance(v, torch.Tensor) and v.is_meta for v in kw.values()):
        return None  # stock torch on the meta device: shapes only
    op.expect(kw, got)
    return None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("op_name", sorted(OPS))
def test_bad_inputs_give_a_clean_error_or_a_correct_result(op_name):
    op, gen = OPS[op_name], torch.Generator().manual_seed(sum(map(ord, op_name)))
    failures: List[str] = []
    for arg, name, kw in _mutations(op, gen):
        outcomes: List[Optional[type]] = []
        for mode in MODES:
            try:
                outcomes.append(_outcome(op_name, op, kw, mode))
            except AssertionError as e:
                failures.append(f"{arg}={name} ({mode}): {str(e).splitlines()[0][:200]}")
                outcomes.append("failed")
        a, b = (o if o in (None, "failed") else next(c for c in CLEAN if issubclass(o, c))
                for o in outcomes)  # NotImplementedError counts as the RuntimeError it is
        if None not in outcomes and "failed" not in outcomes and a is not b:
            failures.append(f"{arg}={name}: {a.__name__} in invariant mode, {b.__name__} in "
                            "torch mode")
        elif (a is None) != (b is None) and "failed" not in outcomes and \
                (op_name, arg, name) not in ONE_MODE_REFUSES and name != "meta":
            failures.append(f"{arg}={name}: invariant {a}, torch {b} (one mode refuses)")
    assert not failures, "\n".join(failures)
