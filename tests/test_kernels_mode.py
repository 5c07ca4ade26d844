"""The kernel mode belongs to a thread / context, and a `with` block restores exactly what it
replaced: a thread switching to stock torch ops never changes another thread's bits.

The interleaving of two threads (A enters "torch", B enters "invariant", A exits, B exits) left the
whole process on stock kernels when the mode was one global; so did any generate running while
another thread compared modes. Both are run here, the second with the real `generate`.
"""
from __future__ import annotations

import contextvars
import threading

import pytest
import torch
import torch.nn.functional as F

import tonp_kernels as tk
from conftest import assert_bitwise, randn
from tonp_models import generate
from model_helpers import tiny_model

TIMEOUT = 60  # seconds any wait of these tests may take before it fails


def _run_threads(*targets):
    """Run each target in its own thread; re-raise the first failure (or a hang) here."""
    errors = []

    def wrap(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001  (handed to the test thread)
                errors.append(e)
        return run

    threads = [threading.Thread(target=wrap(t), daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
        assert not t.is_alive(), "a thread of the test hung"
    if errors:
        raise errors[0]


def _in_new_thread(fn):
    out = []
    _run_threads(lambda: out.append(fn()))
    return out[0]


def test_mode_switch_in_one_thread(gen):
    assert tk.get_mode() == "invariant"
    x = randn(4, 16, gen=gen, scale=4.0)
    with tk.use("torch"):
        assert tk.get_mode() == "torch"
        assert_bitwise(tk.silu_mul(x, x), F.silu(x) * x, "torch mode is stock")
        with tk.use("invariant"):
            assert tk.get_mode() == "invariant"
        assert tk.get_mode() == "torch"
    assert tk.get_mode() == "invariant"
    tk.use("torch")                      # without `with`: sets the current context's mode
    try:
        assert tk.get_mode() == "torch"
    finally:
        tk.use("invariant")
    assert tk.get_mode() == "invariant"
    with pytest.raises(ValueError, match="mode must be one of"):
        tk.use("fast")


def test_with_restores_exactly_what_it_replaced():
    outer = tk.use("torch")              # a bare switch, then a block, then the bare one undone
    with tk.use("invariant"):
        tk.use("torch")                  # a bare switch inside the block ...
        assert tk.get_mode() == "torch"
    assert tk.get_mode() == "torch"      # ... is undone by the block's exit
    outer.__exit__(None, None, None)
    assert tk.get_mode() == "invariant"


def test_an_interleaving_of_two_threads_leaves_every_thread_as_it_was():
    """A enters torch, B enters invariant, A exits, B exits: nobody ends on stock kernels."""
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def thread_a():
        with tk.use("torch"):
            a_in.set()
            assert b_in.wait(TIMEOUT)
            seen["A inside"] = tk.get_mode()
        a_out.set()
        seen["A after"] = tk.get_mode()

    def thread_b():
        assert a_in.wait(TIMEOUT)
        with tk.use("invariant"):
            b_in.set()
            assert a_out.wait(TIMEOUT)
            seen["B inside"] = tk.get_mode()
        seen["B after"] = tk.get_mode()

    _run_threads(thread_a, thread_b)
    assert seen == {"A inside": "torch", "A after": "invariant", "B inside": "invariant",
                    "B after": "invariant"}
    assert tk.get_mode() == "invariant", "the test's own thread was switched"
    assert _in_new_thread(tk.get_mode) == "invariant", "the process default changed"


def test_a_new_thread_starts_invariant_and_a_copied_context_carries_the_mode():
    with tk.use("torch"):
        assert _in_new_thread(tk.get_mode) == "invariant"
        ctx = contextvars.copy_context()
        assert _in_new_thread(lambda: ctx.run(tk.get_mode)) == "torch"


def test_a_kernel_loop_keeps_its_bits_while_another_thread_switches(gen):
    """Lock-step: each step of the 'generator' runs while the other thread sits inside
    `with tk.use("torch")` (and, every other step, after a bare tk.use("torch"))."""
    x, w = randn(5, 2048, gen=gen), randn(96, 2048, gen=gen, scale=0.03)
    t = torch.randint(0, 96, (5,), generator=gen)

    def step():
        y = tk.linear(x, w)
        return y, tk.token_logprobs(y, t, temperature=0.7)

    want = step()
    with tk.use("torch"):
        stock = step()
    assert not torch.equal(stock[0], want[0]), "the twin: stock F.linear must differ here"
    steps, inside, done = 20, threading.Semaphore(0), threading.Semaphore(0)
    got, switcher_saw = [], []

    def generator():
        for _ in range(steps):
            assert inside.acquire(timeout=TIMEOUT)
            got.append(step())
            done.release()

    def switcher():
        for i in range(steps):
            with tk.use("torch"):
                if i % 2:
                    tk.use("torch")
                # (not compared with `stock`: stock bits depend on the calling thread's
                # OpenMP thread count, the invariant ones do not)
                switcher_saw.append(tk.get_mode() == "torch" and
                                    not torch.equal(tk.linear(x, w), want[0]))
                inside.release()
                assert done.acquire(timeout=TIMEOUT)

    _run_threads(generator, switcher)
    assert all(switcher_saw), "the switching thread ran stock ops"
    for i, g in enumerate(got):
        assert_bitwise(g, want, f"step {i} of the loop")


def test_generate_keeps_its_bits_while_another_thread_compares_modes():
    model = tiny_model("mlp_only", seed=3)
    prompts = [torch.arange(1, 9), torch.arange(20, 25)]
    kw = dict(max_new_tokens=12, temperature=0.8, seed=5)
    with torch.no_grad():
        want = generate(model, prompts, **kw)
        with tk.use("torch"):
            stock = generate(model, prompts, **kw)
    assert not all(torch.equal(a, b) for a, b in zip(stock.logprobs, want.logprobs)), \
        "the twin: stock kernels must change the logprobs"
    finished, got = threading.Event(), []

    def rollout():
        with torch.no_grad():
            got.append(generate(model, prompts, **kw))
        finished.set()

    x = torch.randn(3, 64)

    def comparer():  # what a user measuring the two modes side by side does
        while not finished.is_set():
            with tk.use("torch"):
                tk.linear(x, model.lm_head.weight)
            tk.use("invariant")

    _run_threads(rollout, comparer)
    for a, b in zip(got[0].logprobs, want.logprobs):
        assert_bitwise(a, b, "generate's logprobs while another thread switched modes")
    for a, b in zip(got[0].sequences, want.sequences):
        assert_bitwise(a, b, "generate's tokens")
