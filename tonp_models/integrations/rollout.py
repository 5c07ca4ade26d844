"""Where an RL framework's rollouts come from: tonp's engine in process, or a tonp server.

    gen = InProcessGenerator(model)                    # the same module: no weight copy
    gen = ServerGenerator("http://127.0.0.1:8000", is_main=rank == 0)
    gen.sync(model, step)                              # the server: push this step's weights
    completions, logprobs = gen.generate(prompts, request_ids, max_new_tokens=..., ...)
    gen.close()

Both give, per prompt, the completion's token ids and their fp32 sampling logprobs as Python
lists (an fp32 value survives float() and JSON exactly), bit for bit the same for the same
weights, request ids and settings (tests/test_serve.py). The server path pushes the weights
through SGLang's distributed update (`WeightSender`: /init_weights_update_group once, then
/update_weights_from_distributed, gloo on CPU / NCCL on GPU, no disk), or, given weights_dir,
through /update_weights from a checkpoint directory written by tonp's HF saver (inside the
server's --allowed-weights-dir); either way every result must carry the weight version that
push returned.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

from ..generation import generate
from ..qwen3_moe.checkpoint import state_dict_hub
from ..serve.client import RolloutClient, ServerError

Rollouts = Tuple[List[List[int]], List[List[float]]]


def _sampling(temperature: float, top_k: Optional[int], top_p: Optional[float], seed: int,
              eos_token_ids: Sequence[int]) -> dict:
    return dict(temperature=float(temperature), top_k=top_k, top_p=top_p, seed=int(seed),
                eos_token_id=[int(t) for t in eos_token_ids])


def _lists(out) -> Rollouts:
    """A GenerationOutput's completions and logprobs as lists (fp32 values survive float())."""
    return [c.tolist() for c in out.completions], [lp.tolist() for lp in out.logprobs]


class InProcessGenerator:
    """`tonp_models.generate` on the training model itself (its current weights, no copy)."""

    weight_version: Optional[int] = None

    def __init__(self, model, max_batch_size: Optional[int] = None):
        self.model, self.max_batch_size = model, max_batch_size

    def sync(self, model, step: int) -> None:
        if model is not self.model:
            raise ValueError("InProcessGenerator: it generates with the model it was built on")

    def close(self) -> None:
        pass

    def generate(self, prompts: Sequence[Sequence[int]], request_ids: Sequence[int], *,
                 max_new_tokens: int, temperature: float, top_k: Optional[int] = None,
                 top_p: Optional[float] = None, seed: int = 0,
                 eos_token_ids: Sequence[int] = ()) -> Rollouts:
        out = generate(self.model, [list(p) for p in prompts], max_new_tokens,
                       request_ids=list(request_ids), max_batch_size=self.max_batch_size,
                       **_sampling(temperature, top_k, top_p, seed, eos_token_ids))
        return _lists(out)


class ServerGenerator:
    """A tonp server (`python -m tonp_models.serve`) as the generator.

    url: the server; server_ranks: its TP x EP world (the weight-update group's size - 1);
    weights_dir: None = push through the distributed update (`WeightSender`, gloo: the
    trainer's tensors on the CPU), else the directory `sync` writes the policy to (tonp's HF
    saver) for `/update_weights` to load (the server must see it, inside its
    --allowed-weights-dir); is_main: the one training process that pushes; share_version: how
    the other processes learn the version the main one got (e.g. a broadcast; None = one
    process). timeout: seconds per request.
    """

    def __init__(self, url: str, weights_dir: Optional[str] = None, *, server_ranks: int = 1,
                 is_main: bool = True,
                 share_version: Optional[Callable[[Optional[int]], int]] = None,
                 timeout: float = 600.0):
        self.url, self.server_ranks, self.timeout = url, server_ranks, timeout
        self.client = RolloutClient(url, timeout=timeout)
        self.weights_dir, self.is_main, self.share_version = weights_dir, is_main, share_version
        self.weight_version: Optional[int] = None
        self.sender = None

    def sync(self, model, step: int) -> None:
        """Push `model`'s weights (every process calls it; the main one pushes)."""
        version = None
        if self.is_main:
            if self.weights_dir is not None:
                model.save_pretrained(self.weights_dir)
                res = self.client.update_weights(self.weights_dir)
            else:
                if self.sender is None:
                    from ..serve.weight_sync import WeightSender
                    self.sender = WeightSender(self.url, self.server_ranks,
                                               timeout_s=min(self.timeout, 600.0))
                res = self.sender.push(state_dict_hub(model))
            if not res.get("success"):
                raise ServerError(500, f"the weight update at step {step} was refused: {res}")
            version = int(res["weight_version"])
        self.weight_version = self.share_version(version) if self.share_version else version

    def close(self) -> None:
        """Leave the weight-update group (if a push made one)."""
        if self.sender is not None:
            self.sender, sender = None, self.sender
            sender.close()

    def generate(self, prompts: Sequence[Sequence[int]], request_ids: Sequence[int], *,
                 max_new_tokens: int, temperature: float, top_k: Optional[int] = None,
                 top_p: Optional[float] = None, seed: int = 0,
                 eos_token_ids: Sequence[int] = ()) -> Rollouts:
        """RolloutClient.generate (the server's token-id /generate); raises if a result was
        generated with other weights than the last `sync` pushed."""
        request_ids = [int(i) for i in request_ids]
        out = self.client.generate(prompts, max_new_tokens, request_ids=request_ids,
                                   **_sampling(temperature, top_k, top_p, seed, eos_token_ids))
        for rid, version in zip(request_ids, out.weight_versions):
            if self.weight_version is not None and version != self.weight_version:
                raise RuntimeError(f"ServerGenerator: request {rid} was generated with weight "
                                   f"version {version}, not the {self.weight_version} this step "
                                   f"pushed")
        return _lists(out)


__all__ = ["InProcessGenerator", "ServerGenerator"]
