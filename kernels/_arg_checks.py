"""The rules of one argument, shared by every op: scalars (temperature, seed, sizes, eps; checked
before the dispatch, so every mode refuses them alike), one tensor's dtype and rank, and the data
checks (ids in range, rows with a softmax). Each error names the op, the argument, the value and
the rule. _op_checks.py composes them into each op's rules over all its tensors."""
from __future__ import annotations

import math
import numbers
import operator

import torch

from ._library import FLOAT_DTYPES as FLOATS, MAX_CHUNKS

INTS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
# Temperatures the kernels can divide fp32 logits by: fp32 normal numbers. Below MIN_TEMPERATURE
# a temperature is 0 or a denormal in fp32 (NaN logprobs, junk tokens); above MAX it is inf.
MIN_TEMPERATURE = float(torch.finfo(torch.float32).tiny)  # 1.1754943508222875e-38
MAX_TEMPERATURE = float(torch.finfo(torch.float32).max)   # 3.4028234663852886e+38
# The doubles whose fp32 rounding (what the kernels divide by) is a normal number:
_T_LOW = MIN_TEMPERATURE - 2.0 ** -150    # rounds (ties to even) up to MIN_TEMPERATURE
_T_HIGH = MAX_TEMPERATURE + 2.0 ** 103    # the first double that rounds to inf (excluded)
SEED_LIMIT = 2 ** 64
_INT64 = 2 ** 63


def check_temperature(temperature, *, op: str, allow_zero: bool = False) -> float:
    """`temperature` as a float, if the kernels can divide fp32 logits by it.

    Refused (ValueError, TypeError for a non-number): non-finite or negative values, and
    positive values whose fp32 value is not a normal number (it would be 0, a denormal or inf
    outside [MIN_TEMPERATURE, MAX_TEMPERATURE]). 0 is allowed only where the op defines it
    (`sample`: greedy).
    """
    if type(temperature) is not float and type(temperature) is not int and (
            isinstance(temperature, bool) or not isinstance(temperature, numbers.Real)):
        raise TypeError(f"tonp.{op}: temperature must be a real number, got "
                        f"{type(temperature).__name__} {temperature!r}")
    t = float(temperature)
    if t == 0.0:
        if allow_zero:
            return 0.0
        raise ValueError(f"tonp.{op}: temperature 0 means greedy, which only sample defines; "
                         f"{op} needs a temperature in [{MIN_TEMPERATURE!r}, {MAX_TEMPERATURE!r}]")
    if not _T_LOW <= t < _T_HIGH:  # also catches NaN
        zero = "0 (greedy) or " if allow_zero else ""
        raise ValueError(f"tonp.{op}: temperature must be {zero}a number whose fp32 value is a "
                         f"normal float, in [{MIN_TEMPERATURE!r}, {MAX_TEMPERATURE!r}], got {t!r}")
    return t


def check_seed(seed, *, op: str) -> int:
    """A sampling seed in [0, 2**64), returned as the int64 with the same 64 bits."""
    s = _as_int(seed, op, "seed")
    if not 0 <= s < SEED_LIMIT:
        raise ValueError(f"tonp.{op}: seed must be in [0, 2**64), got {s}")
    return s - SEED_LIMIT if s >= _INT64 else s


def integer(value, *, op: str, name: str, low: int | None = None) -> int:
    """A Python integer argument (not a bool, not a float) that fits int64, optionally >= low."""
    if type(value) is not int:
        value = _as_int(value, op, name)
    if not -_INT64 <= value < _INT64 or (low is not None and value < low):
        rule = f">= {low}" if low is not None and value < low else "an int64"
        raise ValueError(f"tonp.{op}: {name} must be {rule}, got {value}")
    return value


def _as_int(value, op: str, name: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"tonp.{op}: {name} must be an integer, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"tonp.{op}: {name} must be an integer, got {type(value).__name__} "
                        f"{value!r}") from None


def real(value, *, op: str, name: str, low: float | None = None) -> float:
    """A finite real number argument (eps, scale), optionally >= low."""
    if type(value) is not float and type(value) is not int:  # (the ABC check costs ~0.5 us)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"tonp.{op}: {name} must be a real number, got "
                            f"{type(value).__name__} {value!r}")
    v = float(value)
    if not -math.inf < v < math.inf or (low is not None and v < low):
        rule = "finite" if low is None else f"a finite number >= {low}"
        raise ValueError(f"tonp.{op}: {name} must be {rule}, got {v!r}")
    return v


def tensor(t, *, op: str, name: str, dims: int | None = None, min_dims: int = 0,
           layout: str | None = None) -> torch.Size:
    """t is a tensor with exactly `dims` dimensions (or at least `min_dims`); returns its shape.
    layout: how the message names the expected shape (e.g. "[T, Hq, D]")."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tonp.{op}: {name} must be a tensor, got {type(t).__name__}")
    shape = t.shape
    if (len(shape) != dims) if dims is not None else (len(shape) < min_dims):
        want = layout or (f"{dims}-d" if dims is not None else f"at least {min_dims}-d")
        raise ValueError(f"tonp.{op}: {name} must be {want}, got shape {tuple(shape)}")
    return shape


def floats(t, *, op: str, name: str, dims: int | None = None, min_dims: int = 1,
           layout: str | None = None) -> torch.Size:
    """A float32 / bfloat16 tensor with `dims` (or at least `min_dims`) dimensions; its shape."""
    return _typed(t, FLOATS, "float32 or bfloat16", op, name, dims, min_dims, layout)


def integers(t, *, op: str, name: str, dims: int | None = None, min_dims: int = 0,
             layout: str | None = None) -> torch.Size:
    """An integer tensor (ids, positions, offsets: a float or bool one would be truncated)."""
    return _typed(t, INTS, "an integer tensor", op, name, dims, min_dims, layout)


def _typed(t, dtypes, what, op, name, dims, min_dims, layout) -> torch.Size:
    try:  # only torch tensors carry torch dtypes: the common case needs no isinstance
        shape = t.shape if t.dtype in dtypes else None
    except AttributeError:
        shape = None
    if shape is None or not isinstance(t, torch.Tensor):
        tensor(t, op=op, name=name)
        raise TypeError(f"tonp.{op}: {name} must be {what}, got {t.dtype}")
    if (len(shape) != dims) if dims is not None else (len(shape) < min_dims):
        tensor(t, op=op, name=name, dims=dims, min_dims=min_dims, layout=layout)
    return shape


def out_dtype(dtype, *, op: str) -> None:
    if dtype is not None and dtype not in FLOATS:
        raise TypeError(f"tonp.{op}: out_dtype must be float32 or bfloat16, got {dtype}")


_POWERS_OF_TWO = frozenset(2 ** i for i in range(MAX_CHUNKS.bit_length()))


def chunks(K: int, c, *, op: str) -> int:
    """The chunk count of a reduction over K: a power of two <= MAX_CHUNKS dividing K."""
    if type(c) is not int:
        c = integer(c, op=op, name="chunks")
    if c not in _POWERS_OF_TWO:
        raise ValueError(f"tonp.{op}: chunks must be a power of two in [1, {MAX_CHUNKS}], got {c}")
    if K % c:
        raise ValueError(f"tonp.{op}: the reduction size K={K} is not divisible by chunks={c} "
                         "(the chunk tree needs C | K)")
    return c


def ids_in_range(ids: torch.Tensor, high: int, *, op: str, name: str, low: int = 0) -> None:
    """Every entry of an integer tensor in [low, high) (IndexError naming the first bad one;
    a meta tensor has no entries to check)."""
    if ids.numel() and not ids.is_meta and (int(ids.min()) < low or int(ids.max()) >= high):
        bad = ids[(ids < low) | (ids >= high)][0]
        raise IndexError(f"tonp.{op}: {name} out of range [{low}, {high}): {int(bad)}")


def row_maxima(m: torch.Tensor, temperature: float, *, op: str, softmax: bool,
               sums: torch.Tensor | None = None) -> None:
    """Refuse rows whose maximum of logits / temperature (m, fp32 [...]) is +inf (an infinite
    logit or fp32 overflow) and, for a softmax (not a logsumexp), rows with no finite logit:
    their softmax is undefined. NaN rows pass: a NaN logit gives a NaN result. sums: the chunk
    tree's sums, where a NaN row has max -inf and sum NaN (torch's amax is NaN there)."""
    if m.is_meta:
        return
    what = "its softmax is undefined" if softmax else "no finite logsumexp"
    _first_bad(m == math.inf, op, "logits / temperature reach +inf (an infinite logit, or "
               f"fp32 overflow at temperature={temperature!r}); {what}")
    if softmax:
        masked = m == -math.inf
        _first_bad(masked if sums is None else masked & (sums == 0), op,
                   f"every logit is -inf; {what}")


def _first_bad(bad: torch.Tensor, op: str, why: str) -> None:
    if bool(bad.any()):
        row = tuple(bad.nonzero()[0].tolist())
        raise ValueError(f"tonp.{op}: row {row[0] if len(row) == 1 else row}: {why}")
