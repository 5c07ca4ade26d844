"""Weights from a trainer to a running server without a disk round trip (SGLang's protocol).

Trainer side (rank 0 of a separate process group with every server rank):

    sender = WeightSender("http://127.0.0.1:8000")          # joins the group (HTTP + rendezvous)
    sender.push(state_dict_hub(model), weight_version=3)    # full HF-named tensors, in buckets
    sender.close()

Server side (`WeightReceiver`, one per rank, driven by EngineService between two steps): the
group is its own world (a TCPStore at the trainer + a PrefixStore per group name; gloo on CPU,
NCCL on GPU), never the server's default group. Each /update_weights_from_distributed bucket is
received whole, checked (every name the model's, every shape its full HF shape, every dtype
castable exactly or to bf16, every value finite) and kept as this rank's regions (the checkpoint
table's TP slices and experts). Nothing changes until every tensor of the model is staged: then
the update drains like /update_weights and the staged regions are copied between two steps. A
bucket that fails a check is refused with nothing changed (its tensors are still received, so
the group stays in step with the trainer) and the push's staged buckets are dropped: the next
push starts over.
"""
from __future__ import annotations

import datetime
import ipaddress
import threading
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ..qwen3_moe.checkpoint import hub_layout, slot_region, slot_target
from ..qwen3_moe.checkpoint_files import cast_problem
from .service import WeightsRefused

DEFAULT_GROUP = "weight_update_group"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (SGLang's spelling in `dtypes`)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """"bfloat16" / "torch.bfloat16" -> torch.bfloat16; WeightsRefused for another dtype."""
    d = _DTYPES.get(str(name).removeprefix("torch."))
    if d is None:
        raise WeightsRefused(f"dtypes: {str(name)[:40]!r} is not one of {sorted(_DTYPES)}")
    return d


def new_group(master_address: str, master_port: int, rank: int, world_size: int,
              group_name: str, backend: str, timeout_s: float, store=None):
    """A process group of its own (not the default one): a TCPStore at master_address (rank 0
    hosts it, or pass `store`), a PrefixStore per group name, gloo or NCCL."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0,
                              timeout=timeout, wait_for_workers=False)
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    loopback = _is_loopback(master_address)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1") if loopback
                     else dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(prefixed, rank, world_size, opts)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _broadcast(pg, t: torch.Tensor) -> None:
    pg.broadcast([t], _root0()).wait()


def _root0():
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    return opts


class WeightReceiver:
    """The server side on one rank: its weight-update groups and the staged tensors.

    Args:
        model: the served model (its shards are what a push fills).
        server_group: the server's own group (None = one process): its rank is this rank's
            place after `rank_offset` in a weight-update group.
        timeout_s: the longest a rendezvous or one tensor's broadcast may take.
    """

    def __init__(self, model, server_group=None, timeout_s: float = 120.0):
        self.model, self.timeout_s = model, timeout_s
        self.rank = dist.get_rank(server_group) if server_group is not None else 0
        self.ranks = dist.get_world_size(server_group) if server_group is not None else 1
        self.groups: Dict[str, Tuple[Any, str]] = {}       # name -> (process group, backend)
        self.full, self.mine = hub_layout(model)
        self.params = dict(model.named_parameters())
        self.staged: Dict[str, torch.Tensor] = {}          # HF name -> this rank's region
        self.received: set = set()                         # every HF name staged this push
        self._joined: Optional[str] = None                 # the group the last init joined

    def init_group(self, master_address: str, master_port: int, rank_offset: int,
                   world_size: int, group_name: str, backend: str) -> str:
        self._joined = None
        if group_name in self.groups:
            raise WeightsRefused(f"group_name: a weight-update group {group_name!r} exists "
                                 f"(destroy it first)")
        if backend not in ("gloo", "nccl"):
            raise WeightsRefused(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise WeightsRefused("backend 'nccl' needs CUDA; this server runs on CPU: use gloo")
        if rank_offset < 1 or rank_offset + self.ranks > world_size:
            raise WeightsRefused(f"rank_offset={rank_offset}, world_size={world_size}: this "
                                 f"server's {self.ranks} ranks need ranks rank_offset.."
                                 f"rank_offset+{self.ranks - 1} below world_size, after the "
                                 f"trainer's rank 0")
        try:
            pg = new_group(master_address, master_port, rank_offset + self.rank, world_size,
                           group_name, backend, self.timeout_s)
        except Exception as e:  # noqa: BLE001 -- nothing changed: a refusal
            raise WeightsRefused(f"init_weights_update_group: the rendezvous at "
                                 f"{master_address}:{master_port} failed ({type(e).__name__}: "
                                 f"{str(e)[:200]})") from None
        self.groups[group_name] = (pg, backend)
        self._joined = group_name
        return f"joined {group_name!r} as ranks {rank_offset}..{rank_offset + self.ranks - 1}"

    def destroy_group(self, group_name: str) -> str:
        if self.groups.pop(group_name, None) is None:
            raise WeightsRefused(f"group_name: no weight-update group {group_name!r}")
        self.drop_staged()
        return f"destroyed {group_name!r}"

    def undo(self, op: str, *args) -> None:
        """After `op(*args)` failed on some rank: leave every rank as if none had run it (a
        group some ranks joined is left; a refused bucket drops the push's staged ones)."""
        if op == "init_group" and self._joined == args[4]:   # joined by that very call
            self.groups.pop(args[4], None)
        elif op == "receive":
            self.drop_staged()

    def drop_staged(self) -> None:
        self.staged, self.received = {}, set()

    def receive(self, names: List[str], dtypes: List[str], shapes: List[List[int]],
                group_name: str) -> Union[str, Callable[[], None]]:
        """Receive one bucket (every rank, in the order of `names`), check it and stage it.
        Returns a message, or, once every tensor of the model is staged, the commit (copy)
        that EngineService applies after the drain. WeightsRefused: nothing staged from it."""
        if group_name not in self.groups:
            raise WeightsRefused(f"group_name: no weight-update group {group_name!r} (call "
                                 f"/init_weights_update_group first)")
        pg, backend = self.groups[group_name]
        try:
            validate_meta(names, dtypes, shapes, limit=2 * self._full_bytes() + 2**20)
        except WeightsRefused as e:   # what the trainer sends is unknown: the group is done
            self.groups.pop(group_name, None)
            self.drop_staged()
            raise WeightsRefused(f"{e}; the group {group_name!r} is closed (init a new one)") \
                from None
        dts = [parse_dtype(d) for d in dtypes]
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" \
            else torch.device("cpu")
        problems, bucket = [], {}
        for name, dt, shape in zip(names, dts, shapes):
            buf = torch.empty(shape, dtype=dt, device=device)
            try:
                _broadcast(pg, buf)
            except Exception as e:  # noqa: BLE001 -- nothing changed; the group is unusable
                self.groups.pop(group_name, None)
                self.drop_staged()
                raise WeightsRefused(f"update_weights_from_distributed: receiving {name} "
                                     f"failed ({type(e).__name__}); the group {group_name!r} "
                                     f"is closed, nothing changed: init a new one") from None
            why = self._problem(name, dt, tuple(shape), buf)
            if why:
                problems.append(why)
            elif name in self.mine:   # another EP rank's experts: received, not kept here
                s = self.mine[name]
                bucket[name] = slot_region(s, buf).to(slot_target(self.params, s).dtype,
                                                      copy=True)
        if problems:
            raise WeightsRefused(f"update_weights_from_distributed: {len(problems)} of "
                                 f"{len(names)} tensors refused, nothing changed: "
                                 + "; ".join(problems[:8]) + (" ..." if len(problems) > 8
                                                              else ""))
        self.staged.update(bucket)
        self.received.update(names)
        if len(self.received) < len(self.full):
            return f"staged {len(self.received)} of {len(self.full)} tensors"
        return self._commit

    def _problem(self, name: str, dt: torch.dtype, shape, buf: torch.Tensor) -> Optional[str]:
        if name not in self.full:
            return f"{name[:120]!r} is not a tensor of this model"
        if shape != self.full[name]:
            return f"{name}: pushed {list(shape)}, model {list(self.full[name])}"
        why = cast_problem(name, dt, self.model.dtype)
        if why:
            return why
        if not bool(torch.isfinite(buf).all()):
            return f"{name} holds NaN / inf values"
        return None

    def _full_bytes(self) -> int:
        n = 1
        for shape in self.full.values():
            k = 1
            for d in shape:
                k *= d
            n += k
        return n * 4

    @torch.no_grad()
    def _commit(self) -> None:
        """Copy every staged region into the model (memory only: nothing here can refuse)."""
        for name, t in self.staged.items():
            s = self.mine[name]
            slot_target(self.params, s).copy_(t)
        self.drop_staged()


def validate_meta(names, dtypes, shapes, limit: Optional[int] = None) -> None:
    """The metadata a trainer posts: WeightsRefused unless it says what will be sent (and it
    is at most `limit` bytes)."""
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise WeightsRefused(f"names, dtypes and shapes must be non-empty lists of one length, "
                             f"got {len(names)}, {len(dtypes)}, {len(shapes)}")
    if len(set(names)) != len(names):
        raise WeightsRefused("names: a tensor is named twice in one bucket")
    for i, s in enumerate(shapes):
        if not all(isinstance(d, int) and 0 <= d < 2**40 for d in s):
            raise WeightsRefused(f"shapes[{i}]: dimensions must be ints >= 0")
    total = 0
    for s, d in zip(shapes, dtypes):
        n = parse_dtype(d).itemsize
        for k in s:
            n *= k
        total += n
    if limit is not None and total > limit:
        raise WeightsRefused(f"the bucket is {total} bytes, more than twice this model's "
                             f"weights")


class WeightSender:
    """The trainer's side: rank 0 of a weight-update group with every rank of a tonp (or
    SGLang) server at `url`; `push` sends full HF-named tensors (e.g. `state_dict_hub(model)`).

    Args:
        url: the server (http://host:port).
        server_ranks: the server's rank count (its TP x EP world).
        master_address / master_port: where this process hosts the group's store (port 0: a
            free one); the server ranks connect to it.
        backend: "gloo" (CPU tensors) or "nccl" (CUDA tensors).
        bucket_bytes: a push posts one bucket of tensors at a time, up to this size.
        timeout_s: the longest a rendezvous, one broadcast or one HTTP call may take.
        drain_timeout_s: how long the last bucket's reply may take (the server first lets its
            running requests finish).
    """

    def __init__(self, url: str, server_ranks: int = 1, *, master_address: str = "127.0.0.1",
                 master_port: int = 0, backend: str = "gloo", group_name: str = DEFAULT_GROUP,
                 bucket_bytes: int = 512 * 2**20, timeout_s: float = 120.0,
                 drain_timeout_s: float = 3600.0):
        import httpx     # the trainer's dependency (requirements-test.txt), not the server's
        self.url, self.group_name, self.backend = url.rstrip("/"), group_name, backend
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self.wait_s = timeout_s + drain_timeout_s
        self.http = httpx.Client(timeout=timeout_s)
        world = 1 + server_ranks
        store = dist.TCPStore(master_address, master_port, world, is_master=True,
                              timeout=datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        body = {"master_address": master_address, "master_port": store.port, "rank_offset": 1,
                "world_size": world, "group_name": group_name, "backend": backend}
        self.store, self.pg = store, None
        self.pg = self._post_while("/init_weights_update_group", body, lambda: new_group(
            master_address, store.port, 0, world, group_name, backend, timeout_s, store=store))

    def _post_while(self, path: str, body: dict, work: Callable[[], Any]) -> Any:
        """POST body to path while `work()` (the rendezvous, the broadcasts) runs in a thread;
        work's result, or a RuntimeError with the server's message. When the server answered
        without taking part in `work` (it refused before receiving), work cannot finish: the
        group is then unusable and this sender says so on its next call."""
        if self.pg is None and path != "/init_weights_update_group":
            raise RuntimeError("WeightSender: the group is closed or broken (an earlier call "
                               "failed half-way): make a new WeightSender")
        out: Dict[str, Any] = {}

        def run():
            try:
                out["result"] = work()
            except Exception as e:  # noqa: BLE001 -- reported below
                out["error"] = e
        t = threading.Thread(target=run, daemon=True)
        t.start()
        try:
            read = self.wait_s if path.endswith("distributed") else self.timeout_s
            out["r"] = self.http.post(self.url + path, json=body, timeout=(
                self.timeout_s, read, self.timeout_s, self.timeout_s))
        except Exception as e:  # noqa: BLE001 -- reported below
            out["e"] = e
        r = out.get("r")
        ok = r is not None and r.status_code == 200 and r.json().get("success")
        t.join(self.wait_s if ok else min(self.timeout_s, 10.0))
        if t.is_alive() or "error" in out:
            self.pg = None          # a collective the server never joined, or a broken group
            why = "did not finish" if t.is_alive() else \
                f"{type(out['error']).__name__}: {out['error']}"
            raise RuntimeError(f"{path}: the {'rendezvous' if 'init' in path else 'broadcast'}"
                               f" {why}; server: {_reply(out)}")
        if not ok:
            raise RuntimeError(f"{path} failed: {_reply(out)}")
        self.last_reply = r.json()
        return out["result"]

    def push(self, tensors: Union[Mapping[str, torch.Tensor],
                                  Iterable[Tuple[str, torch.Tensor]]],
             weight_version: Optional[int] = None) -> dict:
        """Send every tensor (full, unsharded, HF names) in buckets; the server applies them
        all at once (between two steps, after draining) when the last bucket arrives. Returns
        the server's last reply ({"success", "message", "weight_version", ...})."""
        items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
        buckets, size = [[]], 0
        for name, t in items:
            n = t.numel() * t.element_size()
            if buckets[-1] and size + n > self.bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append((name, t))
            size += n
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" \
            else torch.device("cpu")
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            body = {"names": [n for n, _ in bucket],
                    "dtypes": [dtype_name(t.dtype) for _, t in bucket],
                    "shapes": [list(t.shape) for _, t in bucket],
                    "group_name": self.group_name, "flush_cache": last}
            if last and weight_version is not None:
                body["weight_version"] = weight_version

            def send(bucket=bucket):
                for _, t in bucket:
                    _broadcast(self.pg, t.detach().to(device).contiguous())
            self._post_while("/update_weights_from_distributed", body, send)
        return self.last_reply

    def close(self) -> None:
        """Destroy the group on the server and here."""
        try:
            self.http.post(self.url + "/destroy_weights_update_group",
                           json={"group_name": self.group_name})
        finally:
            self.pg = self.store = None
            self.http.close()

    def __enter__(self) -> "WeightSender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _reply(out: Dict[str, Any]) -> str:
    if "e" in out:
        return f"{type(out['e']).__name__}: {out['e']}"
    r = out.get("r")
    if r is None:
        return "no reply"
    try:
        return f"{r.status_code} {r.json().get('message', r.text)[:500]}"
    except ValueError:
        return f"{r.status_code} {r.text[:200]}"
