"""Helpers of the rollout-service tests: a tiny checkpoint with a byte-level tokenizer and a chat
template, and a server process started on a free loopback port and always torn down.

    ckpt = tiny_checkpoint(tmp_path)                      # -> directory (model + tokenizer)
    with ServerProcess(["--hf", ckpt]) as srv:            # python -m tonp_models.serve ...
        srv.url                                           # http://127.0.0.1:<port>
    ckpt, server, http, oai = module_server(ARGS)         # one server for a module's tests

The process prints its address once it serves; the context manager waits for that line (with a
timeout), and on exit sends SIGTERM, waits for a clean exit and kills the process otherwise.
"""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import httpx
import openai
import pytest
import torch

from tonp_models.integrations.tokenizer import byte_tokenizer

REPO = Path(__file__).resolve().parents[1]


def tiny_checkpoint(path, model=None, tokenizer: bool = True) -> str:
    """Save `model` (default: test_generation's tiny model) and the tokenizer to `path`."""
    from test_generation import tiny_model
    model = model if model is not None else tiny_model(torch.float32)
    model.save_pretrained(path)
    if tokenizer:
        byte_tokenizer().save_pretrained(path)
    return str(path)


class ServerProcess:
    """`python -m tonp_models.serve <args> --port 0` (or one rank of it, with `env`), as a
    context manager; `url` once it serves. `ready_timeout` bounds the start."""

    def __init__(self, args: List[str], env: Optional[Dict[str, str]] = None,
                 ready_timeout: float = 90.0, announce: bool = True, threads: int = 1):
        self.args, self.ready_timeout, self.announce = args, ready_timeout, announce
        self.env = {**os.environ, "OMP_NUM_THREADS": str(threads), **(env or {})}
        self.url: Optional[str] = None
        self.proc: Optional[subprocess.Popen] = None
        self.lines: "queue.Queue[str]" = queue.Queue()
        self.output: List[str] = []

    def __enter__(self) -> "ServerProcess":
        cmd = [sys.executable, "-m", "tonp_models.serve", "--host", "127.0.0.1", "--port", "0",
               "--threads", self.env["OMP_NUM_THREADS"], *self.args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=self.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=self._read, daemon=True).start()
        if self.announce:
            try:
                self.url = self._wait_for("tonp serve: listening on ").split(" on ")[1].strip()
            except BaseException:
                self.stop()
                raise
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)

    def _wait_for(self, prefix: str) -> str:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {self.proc.returncode}:\n"
                                       + "".join(self.output))
                continue
            if line.startswith(prefix):
                return line
        raise TimeoutError(f"no {prefix!r} within {self.ready_timeout}s:\n" + "".join(self.output))

    def stop(self, timeout: float = 30.0) -> Optional[int]:
        """SIGTERM, wait for the exit, kill after `timeout`; the exit code (None if killed)."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            return None

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def log(self) -> str:
        return "".join(self.output)


def module_server(args: List[str], make_ckpt: Optional[Callable[[Path], str]] = None,
                  extra: Optional[Callable[[str], List[str]]] = None, hf: bool = True,
                  http_timeout: float = 60.0):
    """Module-scoped fixtures (ckpt, server, http, oai) of one server all of a module's tests
    share: `ckpt, server, http, oai = module_server(ARGS)` at module level.

    ckpt: a tiny checkpoint in a fresh directory (`make_ckpt(dir)` builds it there instead);
    server: ServerProcess(["--hf", ckpt, *args, *extra(ckpt)]), or ServerProcess(args) with
    `hf=False` (a preset: no checkpoint); http: an httpx.Client; oai: the official `openai`
    client of its /v1."""
    @pytest.fixture(scope="module", name="ckpt")
    def ckpt_(tmp_path_factory):
        d = tmp_path_factory.mktemp("tiny_ckpt")
        return make_ckpt(d) if make_ckpt is not None else tiny_checkpoint(d)

    def served(cmd: List[str]):
        with ServerProcess(cmd) as srv:
            yield srv

    if hf:
        @pytest.fixture(scope="module", name="server")
        def server_(ckpt):
            yield from served(["--hf", str(ckpt), *args, *(extra(str(ckpt)) if extra else [])])
    else:
        @pytest.fixture(scope="module", name="server")
        def server_():
            yield from served(args)

    @pytest.fixture(scope="module", name="http")
    def http_(server):
        with httpx.Client(timeout=http_timeout) as c:
            yield c

    @pytest.fixture(scope="module", name="oai")
    def oai_(server):
        return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=http_timeout,
                             max_retries=0)

    return ckpt_, server_, http_, oai_


def rank_env(rank: int, port: int, world: int = 2) -> Dict[str, str]:
    """The environment torchrun gives `rank` of `world` ranks on this host (gloo, loopback)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo"}


def metrics(client, url: str) -> Dict[str, float]:
    """/metrics as {name (with labels): value}."""
    text = client.get(f"{url}/metrics").text
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines()
                                     if line and not line.startswith("#"))}


def wait_until(cond, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout}s")
        time.sleep(0.05)
