"""The measurement store: every measurement, kept in Optuna storage, never taken twice.

Measurements are the expensive asset of a search. Each is written the moment it is
taken, as a trial of one study per device (``partune-measurements/<device>``), keyed
by the region's structural key + SEScope + device fingerprint. Any run, of any model,
on the same device and storage, finds it there. SQLite by default; any Optuna RDB URL
(PostgreSQL for many workers) works.
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from collections.abc import Callable

import optuna
import sqlalchemy

from partune.core.errors import PartuneError
from partune.runners.timing import Measurement
from partune.store.claims import Claims
from partune.store.in_process_claims import InProcessClaims
from partune.store.outage import OUTAGE_S, patient, patiently
from partune.store.sql_claims import SqlClaims

STUDY_PREFIX = "partune-measurements/"
OPEN_ATTEMPTS = 3  # a new database: workers starting together race to create its tables
MEMORY = "memory"  # a storage URL: measurements kept in this process only (tests, one-off runs)
POLL_S = 2.0  # how often a worker waiting on another worker's measurement looks again


class MeasurementStore:
    """A dict-like view of the measurements on one device, backed by Optuna storage."""

    def __init__(self, storage_url: str, device: str, claim_ttl_s: float = 1800.0,
                 heartbeat_s: int | None = 60, retry_failed: bool = False) -> None:
        """``claim_ttl_s``: how long a key claimed by a worker that died stays blocked.
        ``retry_failed``: a stored failure is taken again, once per key and run (after a
        fix, or when the failure was the machine's, not the candidate's).
        ``heartbeat_s``: Optuna heartbeats for studies run on this storage (refinement),
        so a trial left RUNNING by a killed worker is failed and retried."""
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        logging.getLogger("alembic").setLevel(logging.WARNING)
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        heartbeat = {}
        if heartbeat_s:
            heartbeat = {"heartbeat_interval": heartbeat_s, "grace_period": 2 * heartbeat_s,
                         "heartbeat_stale_trial_callback": optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=2)}
        self.storage, self.claims = _open(storage_url, heartbeat, claim_ttl_s, device)
        self.device = device
        self.study = optuna.create_study(study_name=STUDY_PREFIX + device, storage=self.storage,
                                         load_if_exists=True)
        # A server database may go away for a while (a restart): reads and writes wait for it.
        wait_s = outage_wait(storage_url)
        self._trials = patiently(lambda: self.study.get_trials(deepcopy=False), wait_s)
        self._add_trial = patiently(self.study.add_trial, wait_s)
        self._rows_since = patiently(self._sql_rows_since, wait_s)
        self._cache: dict[str, Measurement] = {}
        self._newest = -1  # the highest trial id read
        self.rows_read = 0  # by the last refresh: what a poll costs
        self.retry_failed = retry_failed
        self._retried: set[str] = set()
        failures: dict[str, int] = {}
        for t in self._trials():
            self._take(t._trial_id, t.user_attrs.get("key"), t.user_attrs.get("m"))
            if t.user_attrs.get("m") and not self._cache[t.user_attrs["key"]].ok:
                failures[t.user_attrs["key"]] = failures.get(t.user_attrs["key"], 0) + 1
        self._failures_at_start = failures  # failed measurements stored per key, when this run began
        self.claims.sweep()  # what killed workers of this host left in progress

    def refresh(self, full: bool = False) -> None:
        """Read what other runs and workers stored since we last looked (the latest
        measurement of a key wins: a retried failure is replaced).

        On a SQL storage only the trials from ``RECHECK`` ids below the newest seen are
        read, so a poll costs the same on a store of a million measurements as on an empty
        one; the overlap catches a trial whose transaction committed after later ones.
        ``full`` reads everything (a key known stored but not seen)."""
        rows = None if full else self._rows_since(self._newest - self.RECHECK)
        if rows is None:
            trials = self._trials()
            rows = [(t._trial_id, t.user_attrs.get("key"), t.user_attrs.get("m")) for t in trials]
        self.rows_read = len(rows)
        for trial_id, key, m in rows:
            self._take(trial_id, key, m)

    RECHECK = 1000

    def _take(self, trial_id: int, key: str | None, m: dict | None) -> None:
        if key and m:
            self._cache[key] = Measurement(**m)
        self._newest = max(self._newest, trial_id)

    def _sql_rows_since(self, after: int) -> list[tuple[int, str, dict]] | None:
        """(trial id, key, measurement) of this device's trials above ``after``, in id order,
        straight from Optuna's tables; None where the storage is not SQL."""
        if not isinstance(self.storage, optuna.storages.RDBStorage):
            return None
        query = sqlalchemy.text(
            "SELECT t.trial_id, k.value_json, m.value_json FROM trials t "
            "JOIN trial_user_attributes k ON k.trial_id = t.trial_id AND k.key = 'key' "
            "JOIN trial_user_attributes m ON m.trial_id = t.trial_id AND m.key = 'm' "
            "WHERE t.study_id = :study AND t.trial_id > :after ORDER BY t.trial_id")
        with self.storage.engine.connect() as c:
            found = c.execute(query, {"study": self.study._study_id, "after": after}).all()
        return [(trial_id, json.loads(key), json.loads(m)) for trial_id, key, m in found]

    def __contains__(self, key: str) -> bool:
        return key in self._cache

    def __len__(self) -> int:
        return len(self._cache)

    def get(self, key: str) -> Measurement | None:
        return self._cache.get(key)

    def put(self, key: str, m: Measurement, label: str = "", replace: bool = False) -> None:
        """Write one measurement now (a kill a moment later loses nothing)."""
        if key in self._cache and not replace:
            return
        state = optuna.trial.TrialState.COMPLETE if m.ok else optuna.trial.TrialState.FAIL
        trial = optuna.trial.create_trial(
            state=state, value=m.cost_s if m.ok else None,
            user_attrs={"key": key, "m": m.to_json(), "label": label, "pid": os.getpid(), "worker": self.claims.owner})
        self._add_trial(trial)
        self._cache[key] = m

    def obtain(self, key: str, take: Callable[[], Measurement], label: str = "",
               deadline: float | None = None, wait: bool = True) -> tuple[Measurement | None, bool]:
        """The measurement under ``key`` and whether this call took it.

        Stored already: returned. Otherwise this worker claims the key and takes it, or,
        when another worker holds the claim, waits for that worker's result (or for its
        claim to expire). None when ``deadline`` (``time.monotonic``) passes first, or at
        once when another worker holds the key and ``wait`` is False (move on; come back).
        """
        while True:
            cached = self._cache.get(key)
            retry = self.retry_failed and cached is not None and not cached.ok and key not in self._retried
            if cached is not None and not retry:
                return cached, False
            # A retry claims the attempt after the failures seen when this run began, so
            # workers retrying together take it once.
            claim = f"{key}#retry{self._failures_at_start.get(key, 0)}" if retry else key
            if self.claims.claim(claim):
                try:
                    m = take()
                except BaseException:
                    self.claims.release(claim)
                    raise
                self.put(key, m, label, replace=retry)
                self.claims.done(claim)
                self._retried.add(key)
                return m, True
            if self.claims.is_done(claim):  # another worker stored it (or retried it): read it now
                self.refresh()
                if key not in self._cache or (retry and key not in self._retried and not self._cache[key].ok):
                    self.refresh(full=True)  # committed out of order, or long ago: read it all
                if retry:
                    self._retried.add(key)
                if key in self._cache:
                    continue
            if not wait or (deadline is not None and time.monotonic() > deadline):
                return None, False
            time.sleep(POLL_S)
            self.refresh()


def read_measurements(storage, study_name: str) -> dict[str, Measurement]:
    """Every measurement a device study holds, key -> the latest (as a store sees them),
    read without opening a ``MeasurementStore`` (which would create studies and claims)."""
    out: dict[str, Measurement] = {}
    for t in optuna.load_study(study_name=study_name, storage=storage).get_trials(deepcopy=False):
        if (key := t.user_attrs.get("key")) and "m" in t.user_attrs:
            out[key] = Measurement(**t.user_attrs["m"])
    return out


def _open(url: str, heartbeat: dict, claim_ttl_s: float, device: str) -> tuple[optuna.storages.BaseStorage, Claims]:
    """The Optuna storage at ``url`` and its claims (``MEMORY``: both in this process)."""
    if url == MEMORY:
        return optuna.storages.InMemoryStorage(), InProcessClaims()
    url = with_driver(url)
    for attempt in range(OPEN_ATTEMPTS):
        try:
            storage = optuna.storages.RDBStorage(url, engine_kwargs=_engine_kwargs(url), **heartbeat)
            if outage_wait(url):
                patient(storage.engine, outage_wait(url))
            return storage, SqlClaims(storage.engine, claim_ttl_s, namespace=device, outage_s=outage_wait(url))
        except Exception as e:  # noqa: BLE001 - sqlalchemy raises many kinds
            # Workers starting together on a new database race to create its tables.
            racing = isinstance(e, sqlalchemy.exc.IntegrityError | sqlalchemy.exc.OperationalError)
            if not racing or attempt + 1 == OPEN_ATTEMPTS:
                raise PartuneError(f"cannot open storage {shown(url)}: {str(e).splitlines()[0][:160]}") from e
            time.sleep(1.0)
    raise AssertionError("unreachable")


def shown(url: str) -> str:
    """A storage URL as printed: its password hidden (messages end up in logs)."""
    try:
        return sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a URL SQLAlchemy reads: nothing to hide
        return url


def with_driver(url: str) -> str:
    """A plain ``postgresql://`` URL with the PostgreSQL driver that is installed: SQLAlchemy
    assumes psycopg (3), and fails with "Failed to import DB access module" when only
    psycopg2 is there (what Partune installs)."""
    scheme, sep, rest = url.partition("://")
    if scheme not in ("postgresql", "postgres") or not sep:
        return url
    import importlib.util

    for module, driver in (("psycopg", "psycopg"), ("psycopg2", "psycopg2")):
        if importlib.util.find_spec(module) is not None:
            return f"postgresql+{driver}://{rest}"
    raise PartuneError("a postgresql:// storage needs a driver: pip install psycopg2-binary")


def outage_wait(url: str) -> float:
    """How long a call waits for the database at ``url`` to come back: a server's restart is
    ridden out (``partune.store.outage``); a local SQLite file that fails will not recover."""
    return 0.0 if url == MEMORY or url.startswith("sqlite") else OUTAGE_S


def _engine_kwargs(url: str) -> dict:
    # SQLite: wait for a writer rather than fail when several workers share the file.
    # A server: check a pooled connection before use, so one the server dropped is replaced.
    return {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}
