"""Claims: which worker is taking which measurement, so workers sharing a storage never
take one twice.

Several processes (``--workers N``, or one ``partune tune`` per machine on a shared
PostgreSQL) walk the same candidates. Before measuring a key a worker claims it. A claim
stays once the measurement is stored (a done claim never expires), so a worker whose
view of the store is stale still cannot take it again. One class per kind of storage:
``SqlClaims`` beside Optuna's tables, ``InProcessClaims`` for the in-memory store.
"""

from __future__ import annotations

import math
import os
import socket
from abc import ABC, abstractmethod

DONE = math.inf  # the expiry of a claim whose measurement is stored


def worker_id() -> str:
    """This process, as other workers see it in the claims table."""
    return f"{socket.gethostname()}:{os.getpid()}"


def alive(owner: str) -> bool:
    """Whether a claim's owner may still be working: always, for a worker on another host."""
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return True
    return pid_alive(int(pid))


def pid_alive(pid: int) -> bool:
    """Whether a process of this machine is still there (one we may not signal counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Claims(ABC):
    """Atomic claims on measurement keys: one worker takes each key, once."""

    owner: str

    @abstractmethod
    def claim(self, key: str) -> bool:
        """True when this worker may take ``key`` now: nobody had it, or its claim expired."""

    @abstractmethod
    def done(self, key: str) -> None:
        """The measurement under ``key`` is stored: nobody takes it again."""

    @abstractmethod
    def release(self, key: str) -> None:
        """Give up a claim without a measurement (another worker may take it at once)."""

    @abstractmethod
    def is_done(self, key: str) -> bool:
        """Whether the measurement under ``key`` is stored (by any worker)."""

    @abstractmethod
    def holder(self, key: str) -> str | None:
        """Who holds ``key`` (None when nobody does)."""

    def sweep(self) -> int:
        """Release claims left in progress by workers that are gone (killed), so nothing
        looks held that nobody holds; how many. Nothing to do where claims die with
        their process."""
        return 0
