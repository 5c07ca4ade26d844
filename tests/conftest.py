"""Shared helpers for the tonp tests: bitwise assertions, row-invariance checks, thread control.

The invariance helpers take an op over "row-aligned" inputs (dim 0 of every input is the row,
e.g. tokens) and check that a row's output depends on that row only: not on how many rows share
the call, where the row sits in the batch, or what the other rows hold.
"""
from __future__ import annotations

import contextlib
import os
from typing import Callable, Sequence, Tuple, Union

import pytest
import torch

import tonp_kernels as tk

# The suite tests the C++ kernels: a missing or broken build fails the session here, loudly
# (ImportError saying how to build), rather than test by test or as skips.
ISA = tk.isa()

DTYPES = (torch.float32, torch.bfloat16)
# Row counts of a batch: 1 to several hundred, mostly odd (vector tails, uneven thread splits).
ROW_COUNTS = (1, 2, 3, 7, 16, 33, 100, 257, 301)

Tensors = Union[torch.Tensor, Tuple[torch.Tensor, ...]]


def as_tuple(x: Tensors) -> Tuple[torch.Tensor, ...]:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def describe_difference(actual: torch.Tensor, expected: torch.Tensor) -> str:
    """A one-line account of how two tensors differ (shape, dtype, where and by how much)."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return (f"shape/dtype {tuple(actual.shape)}/{actual.dtype} vs "
                f"{tuple(expected.shape)}/{expected.dtype}")
    actual, expected = actual.detach(), expected.detach()
    if actual.is_floating_point():
        a, e = actual.double(), expected.double()
        bad = ~((a == e) | (a.isnan() & e.isnan()))
    else:
        a, e = actual, expected
        bad = a != e
    n = int(bad.sum())
    first = tuple(int(i) for i in bad.nonzero()[0]) if n else ()
    if not n:
        return "equal"
    diff = (a - e).abs()[bad]
    return (f"{n}/{bad.numel()} elements differ; first at {first}: {a[first].item()!r} vs "
            f"{e[first].item()!r}; max |diff| {float(diff.max()):.3e}")


def assert_bitwise(actual: Tensors, expected: Tensors, what: str = "") -> None:
    """torch.equal on every output (tensors or tuples of tensors), with a readable failure."""
    for j, (a, e) in enumerate(zip(as_tuple(actual), as_tuple(expected), strict=True)):
        if not torch.equal(a, e):
            tag = f"{what} (output {j})" if what else f"output {j}"
            raise AssertionError(f"{tag} is not bitwise equal: {describe_difference(a, e)}")


def rows_of(inputs: Sequence[torch.Tensor], idx) -> Tuple[torch.Tensor, ...]:
    return tuple(t[idx] for t in inputs)


def cat_rows(*parts: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    return tuple(torch.cat(ts, 0) for ts in zip(*parts))


def sample_rows(M: int, gen: torch.Generator, n: int = 6) -> list:
    """The first and last rows plus a few random ones: calling the op once per row of a
    301-row batch would cost more than it tells."""
    picks = {0, M - 1} | set(torch.randint(0, M, (n,), generator=gen).tolist())
    return sorted(picks)


def check_row_invariance(op: Callable[..., Tensors],
                         make_inputs: Callable[[int], Sequence[torch.Tensor]], M: int, *,
                         seed: int = 0) -> Tuple[torch.Tensor, ...]:
    """Assert that op's rows do not depend on their batch. Returns op(make_inputs(M)).

    op(*inputs) -> Tensor or tuple of Tensors, all with the rows on dim 0.
    make_inputs(n) -> tuple of n-row inputs (fresh random rows for each call).
    Checks, bitwise: each sampled row alone; the M rows embedded between other rows at two
    offsets; the rows permuted; the batch cut in two at a random point.
    """
    gen = torch.Generator().manual_seed(seed)
    X = tuple(make_inputs(M))
    full = as_tuple(op(*X))
    for i in sample_rows(M, gen):
        assert_bitwise(op(*rows_of(X, slice(i, i + 1))), tuple(f[i:i + 1] for f in full),
                       f"row {i} of M={M} computed alone")
    for before, after in ((3, 0), (M % 7 + 1, 2 * M + 5)):
        big = cat_rows(make_inputs(before), X, make_inputs(after))
        got = as_tuple(op(*big))
        assert_bitwise(tuple(g[before:before + M] for g in got), full,
                       f"M={M} rows embedded at offset {before} of {before + M + after}")
    perm = torch.randperm(M, generator=gen)
    assert_bitwise(op(*rows_of(X, perm)), tuple(f[perm] for f in full), f"M={M} permuted rows")
    if M > 1:
        cut = int(torch.randint(1, M, (1,), generator=gen))
        parts = [as_tuple(op(*rows_of(X, slice(a, b)))) for a, b in ((0, cut), (cut, M))]
        assert_bitwise(tuple(torch.cat(p, 0) for p in zip(*parts)), full,
                       f"M={M} split at row {cut}")
    return full


def rows_differ_somewhere(op: Callable[..., Tensors],
                          make_inputs: Callable[[int], Sequence[torch.Tensor]],
                          row_counts: Sequence[int], *, seed: int = 0) -> bool:
    """True if some row of op's batch differs from the same row computed alone or in a prefix
    (used by the twins that prove stock torch breaks an invariance the kernels keep)."""
    for M in row_counts:
        X = tuple(make_inputs(M))
        full = as_tuple(op(*X))
        for m in range(1, M + 1):
            part = as_tuple(op(*rows_of(X, slice(0, m))))
            if any(not torch.equal(p, f[:m]) for p, f in zip(part, full)):
                return True
    return False


@contextlib.contextmanager
def num_threads(n: int):
    """Run a block with torch's intra-op thread count set to n (restored afterwards)."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def check_thread_invariance(op: Callable[..., Tensors], *inputs: torch.Tensor,
                            what: str = "") -> None:
    """op(*inputs) gives the same bits with 1 and 2 threads."""
    with num_threads(1):
        one = as_tuple(op(*inputs))
    with num_threads(2):
        two = as_tuple(op(*inputs))
    assert_bitwise(two, one, f"{what} 2 threads vs 1 thread")


@contextlib.contextmanager
def env(name: str, value: str | None):
    """Set (or unset, with None) an environment variable for a block."""
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, dtype: torch.dtype,
                 scale: float = 1.0, what: str = "") -> None:
    """Accuracy against a reference: fp32 tight, bf16 at about one rounding of the output.

    scale: a typical magnitude of the values (tolerances are relative to it)."""
    if dtype == torch.float32:
        rtol, atol = 1e-5, 1e-5 * scale
    else:
        rtol, atol = 1.6e-2, 1e-2 * scale
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol,
                               msg=lambda m: f"{what}: {m}")


def randn(*shape, dtype=torch.float32, gen: torch.Generator | None = None,
          scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded generator, fresh per test, so every test is reproducible on its own."""
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def torch_mode():
    """Run the test body with the stock-torch ops (the twins that show stock torch breaks)."""
    with tk.use("torch"):
        yield


@pytest.fixture(autouse=True)
def _invariant_mode_and_threads():
    """Every test starts in invariant mode with the session's thread count, and leaves them so."""
    threads = torch.get_num_threads()
    with tk.use("invariant"):
        yield
    torch.set_num_threads(threads)
