"""Claims in the same SQL database as the measurements (SQLite, PostgreSQL): workers in
many processes, or on many machines, sharing one storage.

A claim is one row in a small table beside Optuna's, inserted under the key as primary
key, so exactly one insert wins whatever the database. A claim in progress expires
after ``ttl_s``: a worker killed mid-measurement holds its keys only that long.
"""

from __future__ import annotations

import time

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from partune.store.claims import DONE, Claims, alive, worker_id
from partune.store.outage import patiently


class SqlClaims(Claims):
    """Atomic claims on measurement keys, in the same database as the measurements."""

    def __init__(
        self,
        engine: sa.engine.Engine,
        ttl_s: float = 600.0,
        owner: str | None = None,
        namespace: str = "",
        outage_s: float = 0.0,
    ) -> None:
        """``namespace``: the device whose measurements these claims guard. Measurements are
        kept per device, so one device's done claim must not stop another from measuring.
        ``outage_s``: how long each call waits for a database that went away
        (``partune.store.outage``; every call here is safe to repeat)."""
        self.engine, self.ttl_s, self.owner = engine, ttl_s, owner or worker_id()
        for name in ("claim", "done", "release", "is_done", "holder", "sweep"):
            setattr(self, name, patiently(getattr(self, name), outage_s))
        self.prefix = f"{namespace}/" if namespace else ""
        meta = sa.MetaData()
        self.table = sa.Table(
            "partune_claims",
            meta,
            sa.Column("key", sa.String(512), primary_key=True),
            sa.Column("owner", sa.String(128), nullable=False),
            sa.Column("expires", sa.Float, nullable=False),
        )
        meta.create_all(engine, checkfirst=True)

    def claim(self, key: str) -> bool:
        """True when this worker may take ``key`` now: nobody had it, or its claim expired."""
        t, now, key = self.table, time.time(), self.prefix + key
        try:
            with self.engine.begin() as c:
                c.execute(t.insert().values(key=key, owner=self.owner, expires=now + self.ttl_s))
            return True
        except IntegrityError:
            pass
        holder = self._holder(key)
        if holder == self.owner:  # ours already: an insert whose answer was lost, then repeated
            return True
        dead = holder is not None and not alive(holder)
        with self.engine.begin() as c:  # take over an expired claim, or a dead worker's, atomically
            stale = (t.c.expires < now) | (
                (t.c.owner == holder) & (t.c.expires < DONE) if dead else False
            )
            r = c.execute(
                t.update()
                .where(t.c.key == key, stale)
                .values(owner=self.owner, expires=now + self.ttl_s)
            )
            return r.rowcount == 1

    def done(self, key: str) -> None:
        """The measurement under ``key`` is stored: nobody takes it again."""
        with self.engine.begin() as c:
            c.execute(
                self.table.update()
                .where(self.table.c.key == self.prefix + key)
                .values(expires=DONE)
            )

    def release(self, key: str) -> None:
        """Give up a claim without a measurement (another worker may take it at once)."""
        t = self.table
        with self.engine.begin() as c:
            c.execute(
                t.delete().where(
                    t.c.key == self.prefix + key, t.c.owner == self.owner, t.c.expires < DONE
                )
            )

    def is_done(self, key: str) -> bool:
        """Whether the measurement under ``key`` is stored (by any worker)."""
        with self.engine.connect() as c:
            return (
                c.execute(
                    sa.select(self.table.c.expires).where(self.table.c.key == self.prefix + key)
                ).scalar()
                == DONE
            )

    def holder(self, key: str) -> str | None:
        """Who holds ``key`` (None when nobody does)."""
        return self._holder(self.prefix + key)

    def _holder(self, key: str) -> str | None:
        with self.engine.connect() as c:
            return c.execute(sa.select(self.table.c.owner).where(self.table.c.key == key)).scalar()

    def sweep(self) -> int:
        """Delete in-progress claims whose owner died on this host or whose time ran out."""
        t, now = self.table, time.time()
        with self.engine.connect() as c:
            rows = c.execute(
                sa.select(t.c.key, t.c.owner, t.c.expires).where(
                    t.c.expires < DONE, t.c.key.startswith(self.prefix)
                )
            ).all()
        gone = [(key, owner) for key, owner, expires in rows if expires < now or not alive(owner)]
        with self.engine.begin() as c:
            for key, owner in gone:
                c.execute(t.delete().where(t.c.key == key, t.c.owner == owner, t.c.expires < DONE))
        return len(gone)
