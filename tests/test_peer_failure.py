"""A rank that dies or stalls under a multi-process run ends every other rank with one clear line
and exit status 1, not a gloo traceback: pretrain.py on 2 ranks (torchrun's environment, gloo on
loopback), rank 1 killed with SIGKILL, or stopped with SIGSTOP under --dist-timeout 5, in the
middle of training."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tonp_parallel.launch import free_port

from test_examples import EXAMPLES, TINY


def _start(tmp_path, name):
    out = tmp_path / name
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1",
           "GLOO_SOCKET_IFNAME": "lo"}
    env.pop("TONP_TRACEBACK", None)
    cmd = [sys.executable, os.path.join(EXAMPLES, "pretrain.py"), *TINY, "--steps", "100000",
           "--save-every", "0", "--eval-every", "0", "--no-export", "--out", str(out),
           "--dist-timeout", "5"]
    procs = []
    for r in (0, 1):
        logs = (open(tmp_path / f"{name}{r}.out", "w"), open(tmp_path / f"{name}{r}.err", "w"))
        procs.append(subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                      stdout=logs[0], stderr=logs[1]))
    deadline = time.monotonic() + 180             # until rank 0 has logged a training step
    metrics = out / "metrics.jsonl"
    while not (metrics.exists() and metrics.stat().st_size > 0):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            _stop(procs)
            pytest.fail(f"the run did not start: {(tmp_path / f'{name}0.err').read_text()[-2000:]}"
                        f"{(tmp_path / f'{name}1.err').read_text()[-2000:]}")
        time.sleep(0.2)
    return procs


def _stop(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(30)


@pytest.mark.timeout(500)
def test_a_dead_or_stalled_peer_is_one_line_on_the_other_rank(tmp_path):
    for name, sig, want in [
            ("killed", signal.SIGKILL,
             r"pretrain\.py: error: rank 1 \(pid {pid}\) died; rank 0 stopped: its collective "
             r"failed \(.*\)"),
            ("stalled", signal.SIGSTOP,
             r"pretrain\.py: error: rank 0: a collective waited longer than --dist-timeout for a "
             r"peer rank that is stalled or gone \(.*[Tt]imed out.*\); see the other ranks' "
             r"output")]:
        procs = _start(tmp_path, name)
        try:
            t0 = time.monotonic()
            os.kill(procs[1].pid, sig)
            rc = procs[0].wait(120)
            took = time.monotonic() - t0
        finally:
            _stop(procs)
        err = (tmp_path / f"{name}0.err").read_text()
        assert rc == 1, (name, rc, err[-3000:])
        assert "Traceback" not in err, (name, err[-3000:])
        lines = err.strip().splitlines()
        assert re.fullmatch(want.format(pid=procs[1].pid), lines[-1]), (name, err[-3000:])
        assert len(lines) == 1, (name, err[-3000:])
        assert took < 60, (name, took)
