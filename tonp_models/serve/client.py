"""`RolloutClient`: `generate` through a running tonp server (its token-id /generate), and its
weight updates. Standard library only (urllib), so an RL trainer needs nothing more.

    client = RolloutClient("http://127.0.0.1:8000")     # api_key: default the env TONP_API_KEY
    client.update_weights(model_dir)               # after model.save_pretrained(model_dir)
    out = client.generate(prompts, 32, temperature=1.0, seed=7, eos_token_id=eos,
                          request_ids=range(len(prompts)))   # a ServedOutput
    out.weight_versions                            # per request: the weights that generated it

With the same weights and arguments, `out` (a tonp_models.GenerationOutput) is bit for bit what
`tonp_models.generate` returns (tokens, fp32 logprobs, finish reasons): the server's engine is
the same, and JSON carries each fp32 logprob exactly.
"""
from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Sequence, Union

import torch

from ..generation import GenerationOutput, GenerationStats


class ServerError(RuntimeError):
    """The server answered with an error status; `.status` and the server's message."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


@dataclass
class ServedOutput(GenerationOutput):
    """`GenerationOutput` with, per request, the server's weight version that generated it
    (an update drains the running requests first: one version per request)."""
    weight_versions: List[int] = field(default_factory=list)


class RolloutClient:
    """A server's client; `api_key` (default: the env TONP_API_KEY) is sent as a bearer token."""

    def __init__(self, url: str, timeout: float = 600.0, api_key: Optional[str] = None):
        self.url, self.timeout = url.rstrip("/"), timeout
        self.api_key = api_key if api_key is not None else os.environ.get("TONP_API_KEY")

    def _call(self, path: str, body: Optional[dict] = None):
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            try:
                text = json.loads(text).get("error", {}).get("message", text)
            except (ValueError, AttributeError):
                pass
            raise ServerError(e.code, text) from None

    def wait_ready(self, timeout: float = 60.0) -> dict:
        """Poll /health until the server answers ok."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._call("/health")
            except (urllib.error.URLError, ConnectionError, ServerError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def update_weights(self, path: str) -> dict:
        """Load a checkpoint directory on every rank of the server (between steps, after the
        running requests finish; the prefix cache is cleared). Raises ServerError if refused."""
        return self._call("/update_weights", {"model_path": str(path)})

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 temperature: float = 0.0, top_k: Optional[int] = None,
                 top_p: Optional[float] = None, seed: int = 0,
                 eos_token_id: Union[int, Sequence[int], None] = None,
                 stop_token_ids: Optional[Sequence[int]] = None,
                 request_ids: Optional[Iterable[int]] = None) -> ServedOutput:
        """`tonp_models.generate`'s arguments and result, rolled out by the server; the result
        also names each request's weight version."""
        start = time.perf_counter()
        prompts = [[int(t) for t in p] for p in prompts]
        eos = _ids(eos_token_id)
        stop = _ids(stop_token_ids)
        params = dict(max_new_tokens=int(max_new_tokens), temperature=float(temperature),
                      top_k=-1 if top_k is None else int(top_k),
                      top_p=1.0 if top_p is None else float(top_p), seed=int(seed),
                      stop_token_ids=sorted(eos | stop), ignore_eos=True)
        body = dict(input_ids=prompts, sampling_params=params, return_logprob=True)
        if request_ids is not None:
            body["request_ids"] = [int(i) for i in request_ids]
        results = self._call("/generate", body) if prompts else []
        seqs, lps, reasons, versions = [], [], [], []
        stats = GenerationStats(prompt_tokens=sum(map(len, prompts)))
        for p, res in zip(prompts, results):
            ids, meta = res["output_ids"], res["meta_info"]
            seqs.append(torch.tensor(p + ids, dtype=torch.int64))
            lps.append(torch.tensor([x[0] for x in meta["output_token_logprobs"]],
                                    dtype=torch.float32))
            kind = meta["finish_reason"]["type"]
            if kind == "stop":
                kind = "eos" if ids[-1] in eos else "stop"
            elif kind != "length":
                raise ServerError(500, f"request {res['index']} ended with {meta['finish_reason']}")
            reasons.append(kind)
            versions.append(int(meta["weight_version"]))
            stats.cached_tokens += meta["cached_tokens"]
            stats.prefill_tokens += len(p) - meta["cached_tokens"]   # as the engine counts
            stats.decode_tokens += max(len(ids) - 1, 0)              # (without preemption)
            stats.new_tokens += len(ids)
        stats.seconds = time.perf_counter() - start
        return ServedOutput(seqs, lps, [len(p) for p in prompts], reasons, stats, versions)


def _ids(x) -> set:
    if x is None:
        return set()
    if isinstance(x, int) or getattr(x, "ndim", 1) == 0:
        return {int(x)}
    return {int(v) for v in x}
