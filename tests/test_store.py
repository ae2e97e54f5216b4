"""The measurement store and its claims, on SQLite and on a real PostgreSQL.

``storage_url`` runs each test on both (``pytest -k postgres`` selects PostgreSQL; the
server is started by ``tests/conftest.py``). The in-memory store is tested on its own.
"""

from __future__ import annotations

import pytest

from partune.core.errors import PartuneError
from partune.runners.timing import Measurement
from partune.store.measurements import MEMORY, MeasurementStore
from partune.store.sql_claims import SqlClaims

OK = Measurement(1e-3, 1e-5, 1e-3, 5, 10)


def test_store_dedups_and_persists(storage_url):
    store = MeasurementStore(storage_url, "dev1")
    store.put("k1", OK, "first")
    store.put("k1", Measurement(2e-3, 0, 2e-3, 5, 10), "again")  # already there: ignored
    store.put("k2", Measurement.failed("boom"))
    assert len(store) == 2 and store.get("k1") == OK
    again = MeasurementStore(storage_url, "dev1")
    assert again.get("k1") == OK and again.get("k2").error == "boom"
    assert again.get("k2").cost_s == float("inf")
    assert len(again.study.get_trials()) == 2
    assert MeasurementStore(storage_url, "other-device").get("k1") is None


def test_a_stored_failure_is_retried_once_when_asked(storage_url):
    MeasurementStore(storage_url, "dev").put("k", Measurement.failed("machine was busy"))
    calls = []

    def take() -> Measurement:
        calls.append(1)
        return Measurement(1e-3, 0.0, 1e-3, 1, 1, best_s=1e-3)

    assert not MeasurementStore(storage_url, "dev").obtain("k", take)[0].ok  # kept by default
    retrying = MeasurementStore(storage_url, "dev", retry_failed=True)
    m, took = retrying.obtain("k", take)
    assert took and m.ok and retrying.obtain("k", take) == (m, False)
    assert (
        MeasurementStore(storage_url, "dev").get("k").ok and len(calls) == 1
    )  # the latest wins, for everyone


def test_claims_are_taken_once_released_and_done(storage_url):
    store = MeasurementStore(storage_url, "dev")
    mine, other = (
        store.claims,
        SqlClaims(store.storage.engine, ttl_s=600.0, owner="elsewhere:1", namespace="dev"),
    )
    assert mine.claim("k") and not other.claim("k") and other.holder("k") == mine.owner
    mine.release("k")
    assert mine.holder("k") is None and other.claim("k") and not mine.claim("k")
    other.done("k")
    other.release("k")  # a done claim is never given up
    assert mine.is_done("k") and not mine.claim("k")


def test_an_expired_claim_is_taken_over(storage_url):
    store = MeasurementStore(storage_url, "dev")
    gone = SqlClaims(
        store.storage.engine, ttl_s=-1.0, owner="elsewhere:2", namespace="dev"
    )  # expires at once
    assert (
        gone.claim("k")
        and store.claims.claim("k")
        and store.claims.holder("k") == store.claims.owner
    )


def test_an_unreachable_storage_is_one_line(tmp_path):
    with pytest.raises(PartuneError, match="cannot open storage") as info:
        MeasurementStore(f"sqlite:///{tmp_path}/no/such/dir/m.db", "dev")
    assert "\n" not in str(info.value)


def test_the_in_memory_store_takes_each_key_once_and_keeps_nothing():
    store = MeasurementStore(MEMORY, "dev")
    calls = []

    def take() -> Measurement:
        calls.append(1)
        return Measurement(1e-3, 0.0, 1e-3, 1, 1)

    m, took = store.obtain("k", take)
    assert took and store.obtain("k", take) == (m, False) and len(calls) == 1
    claims = store.claims
    assert claims.claim("x") and not claims.claim("x") and claims.holder("x") == claims.owner
    claims.release("x")
    assert claims.holder("x") is None and claims.claim("x")
    claims.done("x")
    claims.release("x")  # a done claim is never given up
    assert claims.is_done("x") and not claims.claim("x")
    assert MeasurementStore(MEMORY, "dev").get("k") is None  # each in-memory store is its own


def test_a_plain_postgresql_url_finds_the_installed_driver(postgres_url):
    """SQLAlchemy's default for postgresql:// is psycopg 3; Partune installs psycopg2."""
    plain = postgres_url.replace("postgresql+psycopg2://", "postgresql://")
    MeasurementStore(plain, "dev").put("k", OK)
    assert MeasurementStore(postgres_url, "dev").get("k") == OK


def test_status_reads_a_plain_postgresql_url(postgres_url, capsys):
    from partune.cli import main

    MeasurementStore(postgres_url, "dev").put("k", OK)
    assert (
        main(
            ["status", "--storage", postgres_url.replace("postgresql+psycopg2://", "postgresql://")]
        )
        == 0
    )
    assert "1 measurements on 1 device(s)" in capsys.readouterr().out


def test_a_worker_moves_on_from_a_key_another_holds(storage_url):
    """``wait=False``: a key another worker is measuring is left at once (and taken over
    by nobody); waiting, its result is read once that worker stores it."""
    import threading

    mine, theirs = MeasurementStore(storage_url, "dev"), MeasurementStore(storage_url, "dev")
    theirs.claims = SqlClaims(
        theirs.storage.engine, ttl_s=600.0, owner="elsewhere:3", namespace="dev"
    )
    assert theirs.claims.claim("k")
    taken = []
    assert (
        mine.obtain("k", lambda: taken.append(1) or OK, wait=False) == (None, False) and not taken
    )

    def finish() -> None:
        theirs.put("k", OK)
        theirs.claims.done("k")

    threading.Timer(0.2, finish).start()
    assert mine.obtain("k", lambda: taken.append(1) or OK) == (OK, False) and not taken


def test_each_device_measures_its_own(storage_url):
    """One storage, two devices (say 1 thread and all cores): a key one device measured is
    still the other's to measure (claims are per device, like the measurements)."""
    one, other = MeasurementStore(storage_url, "dev-1t"), MeasurementStore(storage_url, "dev-2t")
    assert one.obtain("k", lambda: OK) == (OK, True)
    slower = Measurement(2e-3, 0.0, 2e-3, 1, 1)
    assert other.obtain("k", lambda: slower, deadline=0.0) == (slower, True)
    assert MeasurementStore(storage_url, "dev-1t").get("k") == OK


def test_a_postgres_outage_is_waited_out_and_nothing_is_lost(postgres_server, postgres_url):
    """PostgreSQL stops for a few seconds while a worker stores and claims: the calls wait,
    reconnect, and every measurement is there afterwards, once."""
    import threading
    import time

    store = MeasurementStore(postgres_url, device="d")
    store.put("before", Measurement(1e-3, 0, 1e-3, 5, 10))
    postgres_server.stop()
    restart = threading.Timer(4.0, postgres_server.start)
    restart.start()
    try:
        started = time.monotonic()
        m, took = store.obtain(
            "during", lambda: Measurement(2e-3, 0, 2e-3, 5, 10)
        )  # claims and stores while down
        waited = time.monotonic() - started
    finally:
        restart.join()
    assert took and m.ok and waited >= 2.0  # it did wait for the server
    again = MeasurementStore(postgres_url, device="d")
    assert again.get("before").median_s == 1e-3 and again.get("during").median_s == 2e-3
    keys = [t.user_attrs["key"] for t in again.study.get_trials()]
    assert sorted(keys) == ["before", "during"]
    assert again.claims.is_done("during")


def test_a_bad_postgres_password_or_a_truncated_sqlite_file_is_one_line(tmp_path, capsys):
    """Exit 2 and one line naming the storage, never a traceback, and never a wait: a
    wrong password will not get better by waiting for it."""
    import contextlib
    import time

    from partune.cli import main
    from tests.postgres import local_postgres, postgres_bin

    broken = tmp_path / "cut.db"
    broken.write_bytes(b"SQLite format 3\x00" + bytes(3000))
    urls = [f"sqlite:///{broken}"]
    with contextlib.ExitStack() as stack:
        if postgres_bin() is not None:
            urls.append(stack.enter_context(local_postgres(password="right")).url(password="wrong"))
        for url in urls:
            started = time.monotonic()
            assert main(["status", "--storage", url]) == 2
            err = capsys.readouterr().err.strip()
            assert err.count("\n") == 0 and err.startswith("partune: error: cannot open storage"), (
                err
            )
            assert "Traceback" not in err and time.monotonic() - started < 30
            assert "wrong" not in err  # a password is never printed


def test_a_dead_workers_claims_are_swept_when_a_store_opens(storage_url):
    """kill -9 leaves a claim in progress; the next worker to open the store releases it,
    so `no claim is held forever` holds without waiting for its expiry."""
    store = MeasurementStore(storage_url, "dev")
    import socket

    dead = SqlClaims(
        store.storage.engine, owner=f"{socket.gethostname()}:999999999", namespace="dev"
    )
    elsewhere = SqlClaims(store.storage.engine, owner="another-host:1", namespace="dev")
    assert dead.claim("left-by-the-dead") and elsewhere.claim("held-elsewhere")
    MeasurementStore(storage_url, "dev")  # a new worker opens the store
    assert store.claims.holder("left-by-the-dead") is None
    assert store.claims.holder("held-elsewhere") == "another-host:1"  # maybe alive: left alone


def test_a_poll_reads_only_what_is_new(storage_url, monkeypatch):
    """refresh() on a SQL storage reads the trials near and above the newest it has seen,
    not the whole device: its cost does not grow with the store (issue 19, part 3)."""
    monkeypatch.setattr(MeasurementStore, "RECHECK", 5)
    writer, reader = MeasurementStore(storage_url, "dev"), MeasurementStore(storage_url, "dev")
    for i in range(40):
        writer.put(f"k{i}", Measurement(1e-3 + i * 1e-6, 0, 1e-3, 5, 10))
    reader.refresh()
    assert len(reader) == 40 and reader.rows_read == 40  # the first poll sees all that is new
    writer.put("late", Measurement(2e-3, 0, 2e-3, 5, 10))
    reader.refresh()
    assert "late" in reader and reader.rows_read <= 5 + 1  # the overlap and the new one, not 41
    reader.refresh(full=True)
    assert reader.rows_read == 41 and reader.get("k7") == writer.get("k7")
