"""The measurement store at fleet size (issue 19, part 3): opening a store, looking a key up
and polling read a bounded number of rows, whatever the store holds; nothing is lost.

Each test runs on SQLite and on a real PostgreSQL (``storage_url``, ``tests/conftest.py``).
The big stores are written straight into Optuna's tables, as ``MeasurementStore.put``
writes them (``experiments/bench_store.py`` does the same at 10^6).
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

import optuna
import pytest
import sqlalchemy as sa

from partune.runners.timing import Measurement
from partune.store.measurements import KEY_INDEX, STUDY_PREFIX, MeasurementStore
from partune.store.sql_claims import SqlClaims

N = 1500  # measurements already stored


def ok(i: int) -> Measurement:
    return Measurement(1e-3 + i * 1e-6, 0.0, 1e-3, 5, 10)


def failed(i: int) -> Measurement:
    return Measurement.failed(f"boom {i}")


def bulk_store(
    url: str, device: str, items: list[tuple[str, Measurement]], first: int | None = None
) -> None:
    """Store ``items`` (key, measurement) in one transaction, rows as ``put`` writes them
    (trial ids from ``first``, else after the highest)."""
    engine = MeasurementStore(url, device).storage.engine
    meta = sa.MetaData()
    trials, values, attrs = (
        sa.Table(name, meta, autoload_with=engine)
        for name in ("trials", "trial_values", "trial_user_attributes")
    )
    when = datetime.now(UTC).replace(tzinfo=None)
    with engine.begin() as c:
        study = c.execute(
            sa.text("SELECT study_id FROM studies WHERE study_name = :n"),
            {"n": STUDY_PREFIX + device},
        ).scalar_one()
        if first is None:
            first = (
                c.execute(sa.text("SELECT coalesce(max(trial_id), 0) FROM trials")).scalar_one() + 1
            )
        number = c.execute(
            sa.text("SELECT count(*) FROM trials WHERE study_id = :s"), {"s": study}
        ).scalar_one()
        rows = [(first + j, number + j, key, m) for j, (key, m) in enumerate(items)]
        c.execute(
            trials.insert(),
            [
                {
                    "trial_id": t,
                    "number": n,
                    "study_id": study,
                    "state": "COMPLETE" if m.ok else "FAIL",
                    "datetime_start": when,
                    "datetime_complete": when,
                }
                for t, n, _, m in rows
            ],
        )
        if done := [
            {"trial_id": t, "objective": 0, "value": m.cost_s, "value_type": "FINITE"}
            for t, _, _, m in rows
            if m.ok
        ]:
            c.execute(values.insert(), done)
        c.execute(
            attrs.insert(),
            [
                {"trial_id": t, "key": name, "value_json": json.dumps(value)}
                for t, _, key, m in rows
                for name, value in (
                    ("key", key),
                    ("m", m.to_json()),
                    ("label", "bulk"),
                    ("pid", 1),
                    ("worker", "elsewhere:1"),
                )
            ],
        )
        if engine.dialect.name == "postgresql":  # ids given by hand: move the sequences past them
            for table, pk in (
                ("trials", "trial_id"),
                ("trial_values", "trial_value_id"),
                ("trial_user_attributes", "trial_user_attribute_id"),
            ):
                c.execute(
                    sa.text(
                        f"SELECT setval(pg_get_serial_sequence('{table}', '{pk}'), "
                        f"(SELECT max({pk}) FROM {table}))"
                    )
                )
    engine.dispose()


@pytest.fixture
def big(storage_url):
    """A store of N measurements of "dev": k0..k{N-1}, every 10th a failure; k7 failed
    first and was retried (two trials, the latest ok)."""
    items = [(f"k{i}", failed(i) if i % 10 == 0 else ok(i)) for i in range(N)]
    bulk_store(storage_url, "dev", [("k7", failed(7))] + items)
    return storage_url


@pytest.fixture
def no_full_reads(monkeypatch):
    """Reading every trial of a study through Optuna fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("read every trial of the device")

    monkeypatch.setattr(optuna.storages.RDBStorage, "get_all_trials", refuse)
    monkeypatch.setattr(optuna.storages.RDBStorage, "_get_trials", refuse)  # (under Optuna's cache)


def test_a_big_store_opens_and_answers_reading_only_what_it_is_asked(big, no_full_reads):
    store = MeasurementStore(big, "dev")
    assert store.rows_loaded == 0  # nothing read at open
    assert store.get("k3") == ok(3) and "k1234" in store and store.get("k20") == failed(20)
    assert store.get("k7") == ok(7)  # the latest of a key wins
    assert store.get("nope") is None and "nope" not in store
    assert store.rows_loaded <= 6  # one row per stored trial of the keys asked for
    assert store.obtain("k1499", lambda: pytest.fail("measured again")) == (ok(1499), False)
    assert len(store) == N
    assert MeasurementStore(big, "other").get("k3") is None  # each device its own


def test_a_poll_reads_what_is_new_and_updates_what_was_looked_up(big, no_full_reads, monkeypatch):
    monkeypatch.setattr(MeasurementStore, "RECHECK", 20)
    reader, writer = MeasurementStore(big, "dev"), MeasurementStore(big, "dev")
    assert reader.get("new") is None and reader.get("k10") == failed(10)
    writer.put("new", ok(1))
    writer.put("k10", ok(10), replace=True)  # a retried failure
    reader.refresh()
    assert reader.rows_read == 2  # the two new ones, not the overlap, not N
    before = reader.rows_loaded
    assert reader.get("new") == ok(1) and reader.get("k10") == ok(10)
    assert reader.rows_loaded == before  # from the poll, not asked again
    assert MeasurementStore(big, "dev").get("k10") == ok(10)


def test_a_poll_reads_a_late_commit_below_the_newest_it_saw(big, no_full_reads):
    """A trial whose transaction commits after a later one's (a lower id, stored late) is
    read by the next poll, and the latest trial of a key (by id) still wins."""
    reader = MeasurementStore(big, "dev")
    top = reader._newest
    bulk_store(big, "dev", [("lk", ok(1))], first=top + 10)
    assert reader.get("late") is None
    reader.refresh()
    assert reader.get("lk") == ok(1) and reader.rows_read == 1
    bulk_store(big, "dev", [("late", ok(2)), ("lk", failed(1))], first=top + 5)  # committed late
    reader.refresh()
    assert reader.get("late") == ok(2) and reader.get("lk") == ok(1)
    assert reader.rows_read <= 3  # the late ones, and what lies above them
    reader.refresh()
    assert reader.rows_read == 0


def test_the_cache_is_bounded_and_forgets_nothing(big, no_full_reads, monkeypatch):
    monkeypatch.setattr(MeasurementStore, "CACHE", 10)
    store = MeasurementStore(big, "dev")
    assert store.get("gone") is None  # cached as not stored ...
    for i in range(1, 60):
        assert store.get(f"k{i}") == (failed(i) if i % 10 == 0 else ok(i))
    assert len(store._cache) <= 10
    MeasurementStore(big, "dev").put("gone", ok(2))  # ... then stored by another worker
    assert store.get("k1") == ok(1) and store.get("gone") == ok(2)  # asked again: found


def test_a_key_stored_out_of_the_polls_sight_is_found_when_its_claim_is_done(
    big, no_full_reads, monkeypatch
):
    """A measurement committed late, below the ids a poll reads again: the worker waiting
    on its claim asks the database for that key, not for the whole device."""
    monkeypatch.setattr(MeasurementStore, "RECHECK", 0)
    reader, writer = MeasurementStore(big, "dev"), MeasurementStore(big, "dev")
    assert reader.get("late") is None
    reader._newest += 10**6  # the poll will not see it
    elsewhere = SqlClaims(writer.storage.engine, owner="elsewhere:3", namespace="dev")
    assert elsewhere.claim("late")
    writer.put("late", ok(5))
    elsewhere.done("late")
    assert reader.obtain("late", lambda: pytest.fail("measured again")) == (ok(5), False)


def test_a_failure_is_retried_once_counting_the_failures_stored_before(big, no_full_reads):
    """retry_failed: the claim of the retry counts the key's failures stored when the run
    began (two for k30 here), read for that key alone."""
    bulk_store(big, "dev", [("k30", failed(30))])
    retrying = MeasurementStore(big, "dev", retry_failed=True)
    m, took = retrying.obtain("k30", lambda: ok(30))
    assert took and m == ok(30) and retrying.claims.is_done("k30#retry2")
    assert retrying.obtain("k30", lambda: pytest.fail("retried twice")) == (ok(30), False)
    other = MeasurementStore(big, "dev", retry_failed=True)  # began after the retry: k30 is fine
    assert other.obtain("k30", lambda: pytest.fail("measured again")) == (ok(30), False)


def test_a_lookup_goes_through_the_key_index(big):
    """The query that looks a key up can use Partune's index (SQLite, which keeps no
    statistics, is made to; PostgreSQL is asked to plan it without table scans)."""
    store = MeasurementStore(big, "dev")
    seen = []
    sa.event.listen(
        store.storage.engine,
        "before_cursor_execute",
        lambda conn, cursor, statement, parameters, context, many: seen.append(
            (statement, parameters)
        ),
    )
    assert store.get("k77") == ok(77)
    ((statement, parameters),) = [s for s in seen if "trial_user_attributes" in s[0]]
    with store.storage.engine.connect() as c:
        if c.dialect.name == "postgresql":
            c.exec_driver_sql("SET enable_seqscan = off")
            plan = " ".join(r[0] for r in c.exec_driver_sql("EXPLAIN " + statement, parameters))
        else:
            plan = " ".join(
                r[-1] for r in c.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, parameters)
            )
    assert KEY_INDEX in plan, plan
    assert "Seq Scan" not in plan and "SCAN" not in plan, plan  # no table read whole


def test_a_measurement_put_by_the_store_reads_back_through_optuna_as_optunas_own(storage_url):
    """``put`` writes Optuna's tables itself (not counting the study's trials for the new
    trial's number): Optuna reads what it wrote as a trial it stored itself."""
    store = MeasurementStore(storage_url, "dev")
    assert store._direct  # (the schema this Partune knows)
    store.put("a", ok(1), "first")
    store._direct = False  # the same through Optuna
    store.put("b", ok(1), "first")
    store._direct = True
    store.put("c", failed(3), "third")
    trials = optuna.load_study(study_name=STUDY_PREFIX + "dev", storage=storage_url).get_trials()
    assert [t.number for t in trials] == [0, 1, 2]
    mine, optunas, failure = trials
    for t in (mine, optunas):
        assert t.state == optuna.trial.TrialState.COMPLETE and t.value == ok(1).cost_s
        assert t.datetime_start == t.datetime_complete and t.datetime_start is not None
    assert (
        abs((mine.datetime_start - optunas.datetime_start).total_seconds()) < 60
    )  # both local time
    assert {k: v for k, v in mine.user_attrs.items() if k != "key"} == {
        k: v for k, v in optunas.user_attrs.items() if k != "key"
    }
    assert failure.state == optuna.trial.TrialState.FAIL and failure.value is None
    assert failure.user_attrs["m"] == failed(3).to_json()
    assert MeasurementStore(storage_url, "dev").get("c") == failed(3)


def test_a_role_that_may_not_add_the_index_still_opens_the_store_postgres(postgres_url, caplog):
    """A PostgreSQL role allowed to read and write Optuna's tables, not to own them, cannot
    add Partune's index: the store says so once and works without it."""
    MeasurementStore(postgres_url, "dev").put("k", ok(1))
    engine = sa.create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as c:
        c.exec_driver_sql(f"DROP INDEX {KEY_INDEX}")
        c.exec_driver_sql(
            "DO $$ BEGIN CREATE ROLE partune_worker LOGIN; "
            "EXCEPTION WHEN duplicate_object THEN NULL; END $$"
        )
        c.exec_driver_sql(
            "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO partune_worker"
        )
        c.exec_driver_sql("GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO partune_worker")
    engine.dispose()
    worker_url = postgres_url.replace("://postgres@", "://partune_worker@")
    assert worker_url != postgres_url
    # MetaSchedule, run by earlier tests in this process, may configure logging with
    # dictConfig, which disables every logger that exists then (this one included).
    logging.getLogger("partune.store").disabled = False
    store = MeasurementStore(worker_url, "dev")
    assert "no index on the stored keys" in caplog.text
    assert store.get("k") == ok(1) and store.obtain("new", lambda: ok(2)) == (ok(2), True)
    assert MeasurementStore(postgres_url, "dev").get("new") == ok(2)  # (its owner adds the index)
