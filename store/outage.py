"""Riding out a database outage: a worker waits for its storage to come back and loses nothing.

An overnight job on a shared PostgreSQL outlives restarts, failovers and network blips.
Two layers keep it going. An engine made ``patient`` replaces dead pooled connections
(``pool_pre_ping``) and, while the server is down, keeps retrying each new connection
instead of failing it, so every storage call that starts during an outage simply waits.
``patiently`` retries one call that failed because the server went away mid-query: the
calls it wraps (storing a measurement, claiming a key) are safe to repeat.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TypeVar

import optuna
import sqlalchemy as sa

OUTAGE_S = 600.0  # how long a worker waits for its storage before the error is the user's
_FIRST_PAUSE_S, _MAX_PAUSE_S = 0.5, 5.0
_LOST = (sa.exc.OperationalError, sa.exc.InterfaceError, optuna.exceptions.StorageInternalError)
_log = logging.getLogger("partune.store")

T = TypeVar("T")


def _attempts(wait_s: float):
    """One attempt now, then more, each after a longer pause, until ``wait_s`` has passed."""
    deadline, pause = time.monotonic() + wait_s, _FIRST_PAUSE_S
    yield
    while time.monotonic() < deadline:
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(2 * pause, _MAX_PAUSE_S)
        yield


def patient(engine: sa.engine.Engine, wait_s: float = OUTAGE_S) -> sa.engine.Engine:
    """``engine``, retrying each new connection for up to ``wait_s`` while the server is down."""

    @sa.event.listens_for(engine, "do_connect")
    def _connect(dialect, conn_rec, cargs, cparams):
        error: Exception | None = None
        for _ in _attempts(wait_s):
            try:
                return dialect.dbapi.connect(*cargs, **cparams)
            except dialect.dbapi.OperationalError as e:
                if error is None:
                    _log.warning(
                        "storage unreachable, waiting up to %.0f s: %s",
                        wait_s,
                        str(e).strip()[:120],
                    )
                error = e
        raise error  # type: ignore[misc] - at least one attempt was made

    return engine


def patiently(call: Callable[..., T], wait_s: float = OUTAGE_S) -> Callable[..., T]:
    """``call``, tried again while its storage is unreachable (it must be safe to repeat)."""

    @functools.wraps(call)
    def wrapper(*args, **kwargs) -> T:
        error: Exception | None = None
        for _ in _attempts(wait_s):
            try:
                return call(*args, **kwargs)
            except _LOST as e:
                error = e
        raise error  # type: ignore[misc] - at least one attempt was made

    return wrapper
