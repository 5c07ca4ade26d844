"""Helpers of the rollout-service tests: a tiny checkpoint with a byte-level tokenizer and a chat
template, and a server process started on a free loopback port and always torn down.

    ckpt = tiny_checkpoint(tmp_path)                      # -> directory (model + tokenizer)
    with ServerProcess(["--hf", ckpt]) as srv:            # python -m tonp_models.serve ...
        srv.url                                           # http://127.0.0.1:<port>

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
from typing import Dict, List, Optional

import torch

REPO = Path(__file__).resolve().parents[1]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


def save_tokenizer(path) -> None:
    """A byte-level tokenizer (byte b = id b; <|endoftext|> 256, <|im_end|> 257 = eos,
    <|im_start|> 258) with a ChatML template, written where AutoTokenizer finds it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    vocab.update({"<|endoftext|>": 256, "<|im_end|>": 257, "<|im_start|>": 258})
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                   eos_token="<|im_end|>", chat_template=CHAT_TEMPLATE)
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    fast.save_pretrained(path)


def tiny_checkpoint(path, model=None, tokenizer: bool = True) -> str:
    """Save `model` (default: test_generation's tiny model) and the tokenizer to `path`."""
    from test_generation import tiny_model
    model = model if model is not None else tiny_model(torch.float32)
    model.save_pretrained(path)
    if tokenizer:
        save_tokenizer(path)
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
