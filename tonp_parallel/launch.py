"""Run a function on N local spawned ranks (gloo, free port, timeout) and get their results back.

Used by the tests, the benchmarks and `make demo` (a TP=2 world in two local processes).

    from tonp_parallel.launch import run_distributed

    def _check(scale):                      # module level, so spawned processes can import it
        rank = dist.get_rank()              # the gloo process group is already initialised
        return torch.full((2,), rank * scale)

    outs = run_distributed(_check, 4, 3.0, timeout=60)   # -> [rank 0's value, ..., rank 3's]

* Ranks are spawned processes (multiprocessing "spawn"), so `fn` and its arguments must be
  picklable: define `fn` at module level. Each rank gets torchrun's environment (RANK,
  WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT on a free port), `threads` torch threads, and
  by default an initialised process group (`init=False` leaves that to `fn`, e.g. to test
  `tonp_parallel.init_parallel`). Return values travel back through torch.save, so tensors,
  lists, dicts and dataclasses of plain values all work.
* Failing fast: when a rank raises, the others are terminated at once and `DistributedError`
  carries that rank's traceback; a rank that dies without reporting (segfault, os._exit) fails
  the same way; if the whole run exceeds `timeout` seconds, every rank is terminated and
  `TimeoutError` names the ranks that did not finish. Collectives also time out after
  `timeout` seconds inside the ranks (init_process_group's timeout).
* Keyword arguments: pass `functools.partial(fn, key=value)` (picklable when fn is).
* Each spawn costs a few seconds (importing torch): batch many checks into one run.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from .groups import destroy_parallel


class DistributedError(RuntimeError):
    """A rank raised (or died); `.rank` is its rank and the message holds its traceback."""

    def __init__(self, rank: int, message: str):
        super().__init__(f"rank {rank} failed:\n{message}")
        self.rank = rank


def free_port() -> int:
    """A TCP port that was free a moment ago (bind to port 0 and let the OS choose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, args, backend, init, threads, timeout, env, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    os.environ.update(env)
    torch.set_num_threads(threads)
    try:
        if init:
            dist.init_process_group(backend, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout))
        out = fn(*args)
        buf = io.BytesIO()
        torch.save(out, buf)
        if dist.is_initialized():
            dist.barrier()  # nobody tears down the store while another rank still uses it
            destroy_parallel()
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 -- every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))


def _stop(procs: List[mp.Process]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0,
                    backend: str = "gloo", init: bool = True, threads: int = 1,
                    env: Optional[Dict[str, str]] = None) -> List[Any]:
    """Run `fn(*args)` on `world_size` spawned ranks -> [result of rank 0, ..., rank N-1].

    Raises DistributedError (with the failing rank's traceback) as soon as any rank fails, and
    TimeoutError when the run takes longer than `timeout` seconds (spawn time included).
    """
    if world_size < 1:
        raise ValueError(f"run_distributed: world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    env = {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"), **(env or {})}
    procs = [ctx.Process(target=_worker, daemon=True, name=f"rank{r}",
                         args=(fn, r, world_size, port, args, backend, init, threads, timeout,
                               env, results))
             for r in range(world_size)]
    deadline = time.monotonic() + timeout
    done: Dict[int, Any] = {}
    try:
        for p in procs:
            p.start()
        while len(done) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r in range(world_size) if r not in done]
                raise TimeoutError(f"run_distributed({getattr(fn, '__name__', fn)}): ranks "
                                   f"{missing} did not finish within {timeout:.0f}s")
            try:
                rank, ok, payload = results.get(timeout=min(left, 0.2))
            except queue.Empty:
                _check_dead(procs, done, results)
                continue
            if not ok:
                raise DistributedError(rank, payload)
            done[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        _stop(procs)
    return [done[r] for r in range(world_size)]


def _check_dead(procs, done, results) -> None:
    """Fail when a rank exited without reporting (its report may still be in flight: wait a bit)."""
    for r, p in enumerate(procs):
        if r in done or p.is_alive():
            continue
        try:  # a rank that put its result and exited: the item is in the pipe
            rank, ok, payload = results.get(timeout=1.0)
        except queue.Empty:
            raise DistributedError(r, f"process exited with code {p.exitcode} without "
                                      f"reporting a result (crashed or killed)") from None
        if not ok:
            raise DistributedError(rank, payload)
        done[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        return
