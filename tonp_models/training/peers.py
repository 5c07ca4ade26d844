"""A collective that failed because a peer rank died, stalled or dropped its connection, told
in one line instead of a gloo traceback (`cli.run_script` prints it):

    register_peers(groups)        # once, on every rank (cli.launch does it)
    ...
    except Exception as e:
        line = peer_failure(e)    # "rank 1 (pid 123) died; rank 0 stopped: ..." or None

gloo's transport errors reach Python as plain RuntimeErrors ("[.../gloo/transport/tcp/pair.cc:537]
Read error ...: Connection reset by peer", "... Timed out waiting 5000ms ..."); NCCL's and the
store's as torch.distributed.DistError. Dead ranks are named when they ran on this host.
"""
from __future__ import annotations

import os
import socket
import time
from typing import Any, Dict, List, Optional, Tuple

import torch


_PEERS: Dict[int, Tuple[str, int]] = {}     # rank -> (host, pid), filled by `register_peers`


def _host() -> str:
    """This machine: its hostname and boot id (containers on two nodes may share a hostname)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{socket.gethostname()}/{f.read().strip()}"
    except OSError:
        return socket.gethostname()


def register_peers(groups) -> None:
    """Collective under torchrun: every rank learns every rank's host and pid (so that a rank
    whose peer died can name it). `cli.launch` calls it."""
    _PEERS.clear()
    if groups.world_size > 1:
        table: List[Any] = [None] * groups.world_size
        torch.distributed.all_gather_object(table, (_host(), os.getpid()))
        _PEERS.update(enumerate(table))


def _alive(pid: int) -> bool:
    if os.path.exists("/proc/self/stat"):       # Linux: a zombie (exited, not reaped) is dead
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return False
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _dead_peers(wait: float = 0.5) -> List[Tuple[int, int]]:
    """(rank, pid) of the peers on this host that are gone; a peer whose socket closed is
    exiting, so look again for up to `wait` seconds."""
    host, me = _host(), os.getpid()
    local = [(r, pid) for r, (h, pid) in _PEERS.items() if h == host and pid != me]
    deadline = time.monotonic() + wait
    while True:
        dead = [(r, pid) for r, pid in local if not _alive(pid)]
        if dead or time.monotonic() > deadline:
            return dead
        time.sleep(0.02)


def _collective_error(e: BaseException) -> Optional[BaseException]:
    """The error of a failed collective in e's chain: torch's DistError (NCCL, the store) or a
    gloo transport error, which torch raises as a plain RuntimeError "[.../gloo/...] ..."."""
    seen = 0
    while e is not None and seen < 8:
        text = str(e)
        if isinstance(e, torch.distributed.DistError) or (
                isinstance(e, RuntimeError) and text.startswith("[") and
                "gloo" in text.split("]", 1)[0]):
            return e
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def peer_failure(e: BaseException) -> Optional[str]:
    """One line for an error that is a collective failing because a peer rank died, stalled or
    dropped its connection (naming the dead ranks that ran on this host); None otherwise."""
    cause = _collective_error(e)
    if cause is None:
        return None
    text = str(cause)
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]           # gloo's source location
    detail = (text.split(". This is typically")[0].strip().splitlines() or [""])[0]  # no advice
    me = torch.distributed.get_rank() if torch.distributed.is_initialized() else \
        int(os.environ.get("RANK", "0"))
    dead = _dead_peers()
    if dead:
        who = ", ".join(f"rank {r} (pid {pid})" for r, pid in dead)
        return f"{who} died; rank {me} stopped: its collective failed ({detail})"
    low = detail.lower()
    if "timed out" in low or "timeout" in low:
        return (f"rank {me}: a collective waited longer than --dist-timeout for a peer rank that "
                f"is stalled or gone ({detail}); see the other ranks' output")
    if any(w in low for w in ("connection", "closed", "reset", "broken pipe", "read error",
                              "write error", "got 0 bytes")):
        return (f"rank {me}: a collective failed: a peer rank died or dropped its connection "
                f"({detail}); see the other ranks' output")
    return None                                 # another backend error: not a peer's death
