"""The measurement store: every measurement, kept in Optuna storage, never taken twice.

Measurements are the expensive asset of a search. Each is written the moment it is
taken, as a trial of one study per device (``partune-measurements/<device>``), keyed
by the region's structural key + SEScope + device fingerprint. Any run, of any model,
on the same device and storage, finds it there. SQLite by default; any Optuna RDB URL
(PostgreSQL for many workers) works.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable

import optuna
import sqlalchemy

from partune.core import PartuneError
from partune.runners import Measurement
from partune.store.claims import Claims
from partune.store.in_process_claims import InProcessClaims
from partune.store.outage import OUTAGE_S, patient, patiently
from partune.store.sql_claims import SqlClaims

STUDY_PREFIX = "partune-measurements/"
# A new database: workers starting together race to create its tables and index (on a loaded
# machine three tries at a second apart were not always enough in CI).
OPEN_ATTEMPTS = 8
MEMORY = "memory"  # a storage URL: measurements kept in this process only (tests, one-off runs)
POLL_S = 2.0  # how often a worker waiting on another worker's measurement looks again
# A wait on another worker's claim looks again after this, then twice as long each time, up
# to POLL_S: what another worker is measuring usually lands within a second, and
# a worker that slept POLL_S before each look would trail it by seconds at every such wait.
FIRST_POLL_S = 0.05
OPTUNA_SCHEMA = "v3.2.0.a"  # the version of Optuna's tables that a store writes itself (put)
BATCH = 10_000  # trials read per query by a poll that has much to catch up on
# Partune's index beside Optuna's on its user attributes: the "key" attribute's value, so a
# key is found without reading the device's trials (created by the first store to open).
KEY_INDEX = "ix_partune_trial_user_attributes_key"


class MeasurementStore:
    """A dict-like view of the measurements on one device, backed by Optuna storage.

    On a SQL storage nothing is loaded up front: a key is looked up in the database the
    first time it is asked for (one indexed query, ``KEY_INDEX``), and the answer, stored
    or not, is kept in a bounded cache (``CACHE`` keys, least recently used go first).
    ``refresh`` reads only the trials stored since the last one, and updates the cache
    with them, so a key cached as not stored is seen once another worker stores it.
    Opening, looking up and polling cost the same on a store of a million measurements
    as on an empty one, and the memory is bounded. An in-memory storage is kept whole."""

    RECHECK = 1000  # trial ids below the newest seen that a poll reads again (late commits)
    CACHE = 100_000  # keys (stored or known not stored) kept in memory, on a SQL storage (~60 MB)

    def __init__(
        self,
        storage_url: str,
        device: str,
        claim_ttl_s: float = 1800.0,
        heartbeat_s: int | None = 60,
        retry_failed: bool = False,
    ) -> None:
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
            heartbeat = {
                "heartbeat_interval": heartbeat_s,
                "grace_period": 2 * heartbeat_s,
                "heartbeat_stale_trial_callback": optuna.storages.RetryHeartbeatStaleTrialCallback(
                    max_retry=2
                ),
            }
        self.storage, self.claims = _open(storage_url, heartbeat, claim_ttl_s, device)
        self.device = device
        self.study = optuna.create_study(
            study_name=STUDY_PREFIX + device, storage=self.storage, load_if_exists=True
        )
        self._sql = isinstance(self.storage, optuna.storages.RDBStorage)
        # A server database may go away for a while (a restart): reads and writes wait for it.
        wait_s = outage_wait(storage_url)
        self._add_trial = patiently(self.study.add_trial, wait_s)
        self._rows_since = patiently(self._sql_rows_since, wait_s)
        self._rows_of = patiently(self._sql_rows_of, wait_s)
        self._scalar = patiently(self._sql_scalar, wait_s)
        self._ids_since = patiently(self._sql_ids_since, wait_s)
        self._insert = patiently(self._sql_insert, wait_s)
        dialect = self.storage.engine.dialect.name if self._sql else ""
        self._postgres = dialect == "postgresql"
        # Measurements are written straight into Optuna's tables where they are the ones this
        # code knows (``_sql_insert``); elsewhere through Optuna.
        self._direct = (
            dialect in ("sqlite", "postgresql")
            and self.storage.get_current_version() == OPTUNA_SCHEMA
        )
        self._cache: OrderedDict[str, Measurement | None] = OrderedDict()  # None: not stored
        self.rows_read = 0  # by the last refresh: what a poll costs
        self.rows_loaded = 0  # by this store since it opened (open, lookups, polls)
        self.retry_failed = retry_failed
        self._retried: set[str] = set()
        # Failed measurements stored per key when this run began (trial ids up to
        # ``_started``): counted when a key is first retried.
        self._failures_at_start: dict[str, int] = {}
        self._seen: set[int] = set()  # ids of the device's trials a poll need not read (a window)
        if self._sql:
            patiently(lambda: _ensure_key_index(self.storage.engine), wait_s)()
            # Ids are shared by all studies: the newest of any bounds what this run may have
            # missed. What is stored now is looked up when asked for: a poll skips it.
            self._newest = self._scalar("SELECT coalesce(max(trial_id), -1) FROM trials")
            self._saw(self._ids_since(self._newest - self.RECHECK))
        else:  # in this process only: read whole (an in-memory storage starts empty)
            self._newest = -1
            for trial_id, key, m in self._optuna_rows():
                self._take(trial_id, key, m)
                if not Measurement(**m).ok:
                    self._failures_at_start[key] = self._failures_at_start.get(key, 0) + 1
        self._started = self._newest
        self.claims.sweep()  # what killed workers of this host left in progress

    def refresh(self, full: bool = False) -> None:
        """Read what other runs and workers stored since we last looked (the latest
        measurement of a key wins: a retried failure is replaced).

        On a SQL storage a poll reads the device's trials above the newest it has seen, and
        those it has not seen among the ``RECHECK`` ids below (a trial whose transaction
        committed after later ones), so it costs the same on a store of a million
        measurements as on an empty one. ``full`` reads every trial of the device again, in
        batches (its cost grows with the store: never on a poll)."""
        ids: list[int] = []  # a poll's window, when it is listed
        if not self._sql:
            batches = [self._optuna_rows()]
        elif full:
            batches = self._batches(-1)
        else:
            # What is new lies above the newest seen; a late commit, in the window below it,
            # shows as one trial more there than seen (trials are never deleted one by one).
            low, start = self._newest - self.RECHECK, self._newest
            there = self._scalar(
                "SELECT count(*) FROM trials WHERE study_id = :study AND trial_id > :low "
                "AND trial_id <= :newest",
                study=self.study._study_id,
                low=low,
                newest=start,
            )
            if there != sum(1 for i in self._seen if low < i <= start):
                ids = self._ids_since(low)
                start = min((i - 1 for i in ids if i not in self._seen), default=start)
            batches = self._batches(start)
        self.rows_read = 0
        for rows in batches:
            self.rows_read += len(rows)
            for trial_id, key, m in rows:
                self._take(trial_id, key, m)
        self.rows_loaded += self.rows_read
        self._saw(ids)

    def _saw(self, ids: list[int]) -> None:
        """``ids`` (in order) need not be read by a poll again (a trial without a measurement
        neither); the ids below the poll's window are forgotten."""
        self._seen.update(ids)
        if ids:
            self._newest = max(self._newest, ids[-1])
        low = self._newest - self.RECHECK
        self._seen = {i for i in self._seen if i > low}

    def _batches(self, after: int):
        """This device's trials above id ``after``, in id order, ``BATCH`` at a time."""
        while rows := self._rows_since(after, limit=BATCH):
            yield rows
            if len(rows) < BATCH:
                return
            after = rows[-1][0]

    def _take(self, trial_id: int, key: str | None, m: dict | None) -> None:
        if key and m:
            self._remember(key, Measurement(**m))
        self._newest = max(self._newest, trial_id)
        self._seen.add(trial_id)

    def _remember(self, key: str, m: Measurement | None) -> None:
        self._cache[key] = m
        self._cache.move_to_end(key)
        if self._sql and len(self._cache) > self.CACHE:  # (the database still has it)
            self._cache.popitem(last=False)

    def _lookup(self, key: str) -> Measurement | None:
        """The latest measurement of ``key``: from the cache, else from the database."""
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        if not self._sql:
            return None
        rows = self._rows_of(key)
        self.rows_loaded += len(rows)
        m = Measurement(**rows[-1][1]) if rows else None
        self._remember(key, m)
        return m

    def _failures_before_run(self, key: str) -> int:
        """How many failed measurements of ``key`` were stored when this run began."""
        if self._sql and key not in self._failures_at_start:
            rows = self._rows_of(key)
            self.rows_loaded += len(rows)
            self._failures_at_start[key] = sum(
                1 for trial_id, m in rows if trial_id <= self._started and not Measurement(**m).ok
            )
        return self._failures_at_start.get(key, 0)

    def _optuna_rows(self) -> list[tuple[int, str, dict]]:
        """(trial id, key, measurement) of every trial of the device, through Optuna."""
        return [
            (t._trial_id, t.user_attrs["key"], t.user_attrs["m"])
            for t in self.study.get_trials(deepcopy=False)
            if t.user_attrs.get("key") and t.user_attrs.get("m")
        ]

    _JOINS = (
        "FROM trials t "
        "JOIN trial_user_attributes k ON k.trial_id = t.trial_id AND k.key = 'key' "
        "JOIN trial_user_attributes m ON m.trial_id = t.trial_id AND m.key = 'm' "
    )

    def _sql_rows_since(self, after: int, limit: int | None = None) -> list[tuple[int, str, dict]]:
        """(trial id, key, measurement) of this device's trials above ``after``, in id order
        (the first ``limit``), straight from Optuna's tables."""
        query = sqlalchemy.text(
            "SELECT t.trial_id, k.value_json, m.value_json "
            + self._JOINS
            + "WHERE t.study_id = :study AND t.trial_id > :after ORDER BY t.trial_id"
            + (f" LIMIT {int(limit)}" if limit else "")
        )
        with self.storage.engine.connect() as c:
            found = c.execute(query, {"study": self.study._study_id, "after": after}).all()
        return [(trial_id, json.loads(key), json.loads(m)) for trial_id, key, m in found]

    def _sql_ids_since(self, after: int) -> list[int]:
        """The ids of this device's trials above ``after``, in order (ids only: a poll's list)."""
        query = sqlalchemy.text(
            "SELECT trial_id FROM trials WHERE study_id = :study AND trial_id > :after "
            "ORDER BY trial_id"
        )
        with self.storage.engine.connect() as c:
            return list(c.execute(query, {"study": self.study._study_id, "after": after}).scalars())

    def _sql_rows_of(self, key: str) -> list[tuple[int, dict]]:
        """(trial id, measurement) of every trial of this device stored under ``key``, in id
        order (a few at most: a retried failure adds one), through ``KEY_INDEX``."""
        # The key's attribute row first (the index), then its trial and measurement by id;
        # CROSS JOIN keeps SQLite, which has no statistics, to that order.
        query = sqlalchemy.text(
            "SELECT k.trial_id, m.value_json FROM trial_user_attributes k "
            "CROSS JOIN trials t CROSS JOIN trial_user_attributes m "
            f"WHERE k.key = 'key' AND {_key_match(self.storage.engine)} "
            "AND t.trial_id = k.trial_id AND t.study_id = :study "
            "AND m.trial_id = k.trial_id AND m.key = 'm' ORDER BY k.trial_id"
        )
        with self.storage.engine.connect() as c:
            found = c.execute(query, {"study": self.study._study_id, "key": json.dumps(key)}).all()
        return [(trial_id, json.loads(m)) for trial_id, m in found]

    def _sql_scalar(self, sql: str, **params):
        with self.storage.engine.connect() as c:
            return c.execute(sqlalchemy.text(sql), params).scalar_one()

    def __contains__(self, key: str) -> bool:
        return self._lookup(key) is not None

    def __len__(self) -> int:
        """How many keys are stored (on a SQL storage: counted there, a query over the device)."""
        if not self._sql:
            return sum(m is not None for m in self._cache.values())
        return self._scalar(
            "SELECT count(DISTINCT k.value_json) " + self._JOINS + "WHERE t.study_id = :study",
            study=self.study._study_id,
        )

    def get(self, key: str) -> Measurement | None:
        return self._lookup(key)

    def put(self, key: str, m: Measurement, label: str = "", replace: bool = False) -> None:
        """Write one measurement now (a kill a moment later loses nothing)."""
        if not replace and key in self:
            return
        attrs = {
            "key": key,
            "m": m.to_json(),
            "label": label,
            "pid": os.getpid(),
            "worker": self.claims.owner,
        }
        if self._direct:
            self._seen.add(self._insert(m, attrs))  # (a poll need not read it back)
        else:
            state = optuna.trial.TrialState.COMPLETE if m.ok else optuna.trial.TrialState.FAIL
            self._add_trial(
                optuna.trial.create_trial(
                    state=state, value=m.cost_s if m.ok else None, user_attrs=attrs
                )
            )
        self._remember(key, m)

    def _sql_insert(self, m: Measurement, attrs: dict) -> int:
        """Store one measurement as ``study.add_trial`` does: the same rows, in one
        transaction. Less its trial number's cost: Optuna counts the study's earlier trials
        (a time that grows with the store); here the number is the previous trial's plus
        one, taken under the same lock (the study's row; SQLite locks the whole database).
        The new trial's id."""
        sql = sqlalchemy.text
        ids = {"study": self.study._study_id}
        now = datetime.datetime.now(datetime.UTC).replace(
            tzinfo=None
        )  # as Optuna keeps it: naive UTC
        insert = sql(
            "INSERT INTO trials (number, study_id, state, datetime_start, datetime_complete) "
            "VALUES (NULL, :study, :state, :at, :at)"
            + (" RETURNING trial_id" if self._postgres else "")
        ).bindparams(sqlalchemy.bindparam("at", type_=sqlalchemy.DateTime()))
        with self.storage.engine.begin() as c:
            if self._postgres:
                c.execute(
                    sql("SELECT study_id FROM studies WHERE study_id = :study FOR UPDATE"), ids
                )
            done = c.execute(insert, ids | {"state": "COMPLETE" if m.ok else "FAIL", "at": now})
            ids["id"] = done.scalar_one() if self._postgres else done.lastrowid
            c.execute(
                sql(
                    "UPDATE trials SET number = coalesce((SELECT p.number + 1 FROM trials p "
                    "WHERE p.study_id = :study AND p.trial_id < :id "
                    "ORDER BY p.trial_id DESC LIMIT 1), 0) "
                    "WHERE trial_id = :id"
                ),
                ids,
            )
            if m.ok:
                value, kind = m.cost_s, "FINITE" if math.isfinite(m.cost_s) else "INF_POS"
                c.execute(
                    sql(
                        "INSERT INTO trial_values (trial_id, objective, value, value_type) "
                        "VALUES (:id, 0, :value, :kind)"
                    ),
                    {"id": ids["id"], "value": value if kind == "FINITE" else None, "kind": kind},
                )
            c.execute(
                sql(
                    "INSERT INTO trial_user_attributes (trial_id, key, value_json) "
                    "VALUES (:id, :key, :value)"
                ),
                [{"id": ids["id"], "key": k, "value": json.dumps(v)} for k, v in attrs.items()],
            )
        return ids["id"]

    def obtain(
        self,
        key: str,
        take: Callable[[], Measurement],
        label: str = "",
        deadline: float | None = None,
        wait: bool = True,
    ) -> tuple[Measurement | None, bool]:
        """The measurement under ``key`` and whether this call took it.

        Stored already: returned. Otherwise this worker claims the key and takes it, or,
        when another worker holds the claim, waits for that worker's result (or for its
        claim to expire). None when ``deadline`` (``time.monotonic``) passes first, or at
        once when another worker holds the key and ``wait`` is False (move on; come back).
        """
        while True:
            cached = self._lookup(key)
            retry = (
                self.retry_failed
                and cached is not None
                and not cached.ok
                and key not in self._retried
            )
            if cached is not None and not retry:
                return cached, False
            # A retry claims the attempt after the failures seen when this run began, so
            # workers retrying together take it once.
            claim = f"{key}#retry{self._failures_before_run(key)}" if retry else key
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
                seen = self._cache.get(key)
                if self._sql and (seen is None or (retry and not seen.ok)):
                    # Committed out of order, or long ago: ask the database for this key.
                    self._cache.pop(key, None)
                if retry:
                    self._retried.add(key)
                if self._lookup(key) is not None:
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


def _open(
    url: str, heartbeat: dict, claim_ttl_s: float, device: str
) -> tuple[optuna.storages.BaseStorage, Claims]:
    """The Optuna storage at ``url`` and its claims (``MEMORY``: both in this process)."""
    if url == MEMORY:
        return optuna.storages.InMemoryStorage(), InProcessClaims()
    url = with_driver(url)
    for attempt in range(OPEN_ATTEMPTS):
        try:
            storage = optuna.storages.RDBStorage(
                url, engine_kwargs=_engine_kwargs(url), **heartbeat
            )
            if outage_wait(url):
                patient(storage.engine, outage_wait(url))
            return storage, SqlClaims(
                storage.engine, claim_ttl_s, namespace=device, outage_s=outage_wait(url)
            )
        except Exception as e:  # noqa: BLE001 - sqlalchemy raises many kinds
            if not _racing(e) or attempt + 1 == OPEN_ATTEMPTS:
                raise PartuneError(
                    f"cannot open storage {shown(url)}: {str(e).splitlines()[0][:160]}"
                ) from e
            time.sleep(0.5 + attempt * 0.5)
    raise AssertionError("unreachable")


def _racing(e: Exception) -> bool:
    """Whether opening a storage failed because another worker was creating its tables at the
    same moment (PostgreSQL: a unique violation, "relation already exists"; SQLite: "database
    is locked"), or the server is busy (too many connections, starting up): worth another try,
    where a wrong path or password is not."""
    if isinstance(e, sqlalchemy.exc.IntegrityError):
        return True
    why = str(e).lower()
    return isinstance(e, sqlalchemy.exc.DBAPIError) and any(
        w in why for w in ("already exists", "duplicate", "locked", "too many", "starting up")
    )


def _ensure_key_index(engine: sqlalchemy.engine.Engine) -> None:
    """Create ``KEY_INDEX`` unless it is there: a partial index on Optuna's
    ``trial_user_attributes`` (rows of the attribute "key" only), on SQLite and PostgreSQL
    (elsewhere a lookup goes without). Optuna's own schema is left as it is (its migrations
    do not know the index, and need not). PostgreSQL indexes the MD5 of the value: an index
    entry there has a size limit that a long key could pass."""
    dialect = engine.dialect.name
    if dialect not in ("sqlite", "postgresql"):
        return
    exists = (
        sqlalchemy.text("SELECT count(*) FROM sqlite_master WHERE type = 'index' AND name = :name")
        if dialect == "sqlite"
        else sqlalchemy.text("SELECT count(*) FROM pg_indexes WHERE indexname = :name")
    )
    column = "value_json" if dialect == "sqlite" else "md5(value_json)"
    create = (
        f"CREATE INDEX IF NOT EXISTS {KEY_INDEX} ON trial_user_attributes ({column}) "
        "WHERE key = 'key'"
    )
    with engine.connect() as c:
        if c.execute(exists, {"name": KEY_INDEX}).scalar_one():
            return
    try:
        with engine.begin() as c:
            c.execute(sqlalchemy.text(create))
    except sqlalchemy.exc.DBAPIError as e:
        with engine.connect() as c:
            if c.execute(exists, {"name": KEY_INDEX}).scalar_one():
                return  # workers opening a store together raced to create it (PostgreSQL's
                # IF NOT EXISTS is not atomic): one of them did
        if isinstance(e, sqlalchemy.exc.OperationalError | sqlalchemy.exc.InterfaceError):
            raise  # the database went away (the caller waits for it), or is locked
        # Not the tables' owner (a PostgreSQL role allowed to read and write only): it works
        # without, each lookup reading the table.
        logging.getLogger("partune.store").warning(
            "no index on the stored keys (%s): every lookup reads the whole table; the tables' "
            "owner can add it: %s",
            str(e.orig).strip().splitlines()[0][:120],
            create,
        )


def _key_match(engine: sqlalchemy.engine.Engine) -> str:
    """The condition on ``k`` (a "key" attribute row) that finds ``:key`` through ``KEY_INDEX``."""
    if engine.dialect.name == "postgresql":
        return "md5(k.value_json) = md5(:key) AND k.value_json = :key"
    return "k.value_json = :key"


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
    return (
        {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}
    )
