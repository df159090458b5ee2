"""The frozen copies a caller process holds for its ``fork`` environments: one LRU pool
with two caps, ``pool_size`` per instance and ``RTREES_FORK_POOL`` (default 64) in the
process in all (``train.envs.fork``'s docstring, "Bounds"). An evicted copy is asked to
exit (``stop_frozen``) and its handles restore by replay.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import signal
import socket
import threading
from collections import OrderedDict
from dataclasses import dataclass

from train.envs.fork_worker import recv, send

POOL_ENV = "RTREES_FORK_POOL"
DEFAULT_POOL = 64


def pool_cap() -> int:
    """The most frozen copies this process holds in all (``RTREES_FORK_POOL``, default 64)."""
    raw = os.environ.get(POOL_ENV, "")
    try:
        cap = int(raw) if raw else DEFAULT_POOL
    except ValueError:
        raise ValueError(f"{POOL_ENV}={raw!r}: a number of frozen processes >= 0") from None
    if cap < 0:
        raise ValueError(f"{POOL_ENV}={raw!r}: a number of frozen processes >= 0")
    return cap


@dataclass
class Frozen:
    hid: str
    path: str
    token: str
    pid: int
    owner: str


class FrozenPool:
    """Every frozen copy of this process, least recently used first (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, Frozen] = OrderedDict()

    def add(self, entry: Frozen, owner_cap: int, global_cap: int) -> list[Frozen]:
        """Hold ``entry``; the entries evicted to keep both caps (the caller stops them)."""
        with self._lock:
            self._entries[entry.hid] = entry
            evicted = []
            mine = [e for e in self._entries.values() if e.owner == entry.owner]
            for e in mine[:max(0, len(mine) - owner_cap)]:
                evicted.append(self._entries.pop(e.hid))
            while len(self._entries) > global_cap:
                evicted.append(self._entries.popitem(last=False)[1])
            return evicted

    def take(self, owner: str, hid: str, token: str) -> Frozen | None:
        with self._lock:
            e = self._entries.get(hid)
            if e is None or e.owner != owner or not hmac.compare_digest(e.token, token):
                return None
            self._entries.move_to_end(hid)
            return e

    def discard(self, hid: str) -> None:
        with self._lock:
            self._entries.pop(hid, None)

    def drop_owner(self, owner: str) -> list[Frozen]:
        with self._lock:
            gone = [e for e in self._entries.values() if e.owner == owner]
            for e in gone:
                del self._entries[e.hid]
            return gone

    def pids(self, owner: str) -> list[int]:
        with self._lock:
            return [e.pid for e in self._entries.values() if e.owner == owner]


POOL = FrozenPool()


def stop_frozen(e: Frozen, timeout: float) -> None:
    """Ask an evicted copy to exit; kill it when it accepts but does not answer."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(e.path)
            send(s, {"op": "exit", "token": e.token})
            recv(s)
    except (FileNotFoundError, ConnectionRefusedError):
        return  # already gone
    except (OSError, EOFError, ValueError):
        with contextlib.suppress(OSError):
            os.kill(e.pid, signal.SIGKILL)



__all__ = ["DEFAULT_POOL", "POOL", "POOL_ENV", "Frozen", "FrozenPool", "pool_cap", "stop_frozen"]
