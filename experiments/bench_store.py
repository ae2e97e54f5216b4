"""The measurement store at fleet size (issue 19, part 3): does a poll, a lookup or a new
measurement cost more on a store of a million measurements than on an empty one?

For each size N (an empty store, 10^4, 10^5, 10^6 measurements of one device) a database is
built by inserting the rows straight into Optuna's tables (trials, trial_values,
trial_user_attributes), exactly as ``MeasurementStore.put`` stores them (a few are read back
through ``MeasurementStore`` and compared), and opened once (a new Partune adds its index on
the first open: timed apart). Then each of ``--repeat`` fresh processes times (medians kept):

- open: ``MeasurementStore(url, device)``;
- hit: ``obtain()`` of a stored key, first look in this process (median of 200 random keys);
- miss: ``obtain()`` of a new key (claims, "measures" at once, stores; median of 30);
- refresh: ``refresh()`` after another writer added 10 rows (median of 10; rows read);
- the peak resident memory of that process (VmHWM).

"Empty" holds the 100 rows the hits are drawn from. SQLite on local disk by default; with
``--postgres`` also a local PostgreSQL (``tests/postgres.py``). Writes
experiments/results/store_scale.md (``--json`` keeps the raw numbers; ``--before FILE``
adds the numbers of an earlier run, e.g. of the code before a change, as rows).

    python experiments/bench_store.py [--sizes 0,10000,100000,1000000] [--postgres]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "experiments" / "results"
DEVICE = "bench-device"
EMPTY_ROWS = 100  # "empty": the rows the hits are drawn from
HITS, MISSES, REFRESHES, WRITTEN_PER_REFRESH = 200, 30, 10, 10
FAIL_EVERY = 50  # every 50th stored measurement is a failure (a FAIL trial, no value)
SCOPES = [
    {
        "backend": b,
        "device_type": "cpu",
        "memory_scope": "global",
        "target": {"kind": "llvm", "num-cores": 1},
        "virtual_device_id": 0,
    }
    for b in ("tvm", "torch", "onnxruntime", "openvino")
]


# -- the rows ------------------------------------------------------------------------------


def key_of(i: int) -> str:
    """The i-th stored key: shaped like a candidate key (``partune.core.keys.candidate_key``)."""
    digest = hashlib.sha256(str(i // len(SCOPES)).encode()).hexdigest()[:24]
    return f"region:{digest}:" + json.dumps(SCOPES[i % len(SCOPES)], sort_keys=True)


def measurement_of(i: int) -> dict:
    """The i-th stored measurement, as ``Measurement.to_json`` writes it."""
    if i % FAIL_EVERY == FAIL_EVERY - 1:
        return {
            "median_s": float("inf"),
            "spread_s": 0.0,
            "cpu_s": float("inf"),
            "repeats": 0,
            "number": 0,
            "error": f"backend failed on region {i}",
            "load": None,
            "best_s": None,
            "peak_bytes": None,
        }
    s = 1e-4 + (i % 997) * 1e-6
    return {
        "median_s": s,
        "spread_s": s / 20,
        "cpu_s": s,
        "repeats": 21,
        "number": 86,
        "error": None,
        "load": 1.5,
        "best_s": s * 0.9,
        "peak_bytes": None,
    }


def rows_of(i: int, trial_id: int, number: int, study_id: int, when: str):
    """The rows ``MeasurementStore.put`` stores for measurement i (``optuna.study.add_trial``):
    one trial, its value when it completed, and its five user attributes (JSON)."""
    m = measurement_of(i)
    ok = m["error"] is None
    trial = (trial_id, number, study_id, "COMPLETE" if ok else "FAIL", when, when)
    value = (trial_id, 0, m["best_s"], "FINITE") if ok else None
    attrs = [
        (trial_id, "key", json.dumps(key_of(i))),
        (trial_id, "m", json.dumps(m)),
        (trial_id, "label", json.dumps(f"bench region {i}")),
        (trial_id, "pid", json.dumps(4242)),
        (trial_id, "worker", json.dumps("bench-host:4242")),
    ]
    return trial, value, attrs


def insert(url: str, first: int, n: int) -> None:
    """Store measurements ``first`` .. ``first + n - 1`` as another writer would (one transaction
    per 50,000): rows straight into Optuna's tables of the device study."""
    import sqlalchemy as sa

    from partune.store.measurements import STUDY_PREFIX, with_driver

    engine = sa.create_engine(with_driver(url))
    try:
        with engine.connect() as c:
            study_id = c.execute(
                sa.text("SELECT study_id FROM studies WHERE study_name = :n"),
                {"n": STUDY_PREFIX + DEVICE},
            ).scalar_one()
            trial_id = c.execute(
                sa.text("SELECT coalesce(max(trial_id), 0) FROM trials")
            ).scalar_one()
            number = c.execute(
                sa.text("SELECT count(*) FROM trials WHERE study_id = :s"), {"s": study_id}
            ).scalar_one()
        when = datetime.now(UTC).replace(tzinfo=None).isoformat(sep=" ")
        for start in range(first, first + n, 50_000):
            trials, values, attrs = [], [], []
            for i in range(start, min(start + 50_000, first + n)):
                trial_id, number = trial_id + 1, number + 1
                t, v, a = rows_of(i, trial_id, number - 1, study_id, when)
                trials.append(t)
                if v is not None:
                    values.append(v)
                attrs.extend(a)
            _insert_rows(engine, trials, values, attrs)
    finally:
        engine.dispose()


def _insert_rows(engine, trials: list, values: list, attrs: list) -> None:
    tables = [
        ("trials", "trial_id, number, study_id, state, datetime_start, datetime_complete", trials),
        ("trial_values", "trial_id, objective, value, value_type", values),
        ("trial_user_attributes", "trial_id, key, value_json", attrs),
    ]
    raw = engine.raw_connection()
    try:
        cur = raw.cursor()
        if engine.dialect.name == "sqlite":
            for table, columns, rows in tables:
                marks = ", ".join("?" * len(columns.split(",")))
                cur.executemany(f"INSERT INTO {table} ({columns}) VALUES ({marks})", rows)
        else:  # PostgreSQL: COPY, then move the id sequences past what was inserted
            import csv
            import io

            for table, columns, rows in tables:
                buf = io.StringIO()
                csv.writer(buf).writerows(rows)
                buf.seek(0)
                cur.copy_expert(f"COPY {table} ({columns}) FROM STDIN WITH (FORMAT csv)", buf)
            for table, pk in (
                ("trials", "trial_id"),
                ("trial_values", "trial_value_id"),
                ("trial_user_attributes", "trial_user_attribute_id"),
            ):
                cur.execute(
                    f"SELECT setval(pg_get_serial_sequence('{table}', '{pk}'), "
                    f"(SELECT coalesce(max({pk}), 1) FROM {table}))"
                )
        raw.commit()
    finally:
        raw.close()


# -- one measured process ------------------------------------------------------------------


def child(url: str, n: int) -> dict:
    """Everything timed on a store of ``n`` (+ EMPTY_ROWS) measurements, in this process."""
    from partune.runners.timing import Measurement
    from partune.store.measurements import MeasurementStore

    total = n + EMPTY_ROWS
    start = time.perf_counter()
    store = MeasurementStore(url, DEVICE)
    open_s = time.perf_counter() - start
    rss_open = _rss_mb()

    rng = random.Random(19)
    hits = []
    for i in rng.sample(range(total), min(HITS, total)):
        start = time.perf_counter()
        m, took = store.obtain(key_of(i), _never)
        hits.append(time.perf_counter() - start)
        assert not took and m == Measurement(**measurement_of(i)), (i, m)  # read back as stored

    misses = []
    for j in range(MISSES):
        start = time.perf_counter()
        m, took = store.obtain(
            f"bench:new:{os.getpid()}:{j}",
            lambda: Measurement(1e-3, 0.0, 1e-3, 5, 10),
            "bench miss",
        )
        misses.append(time.perf_counter() - start)
        assert took

    refreshes, rows_read = [], []
    first = total + 1_000_000  # keys nobody else stores
    for r in range(REFRESHES):
        insert(url, first + r * WRITTEN_PER_REFRESH, WRITTEN_PER_REFRESH)  # another writer
        start = time.perf_counter()
        store.refresh()
        refreshes.append(time.perf_counter() - start)
        rows_read.append(store.rows_read)
    new = key_of(first + REFRESHES * WRITTEN_PER_REFRESH - 1)
    assert store.get(new) == Measurement(
        **measurement_of(first + REFRESHES * WRITTEN_PER_REFRESH - 1)
    )
    return {
        "n": n,
        "open_s": open_s,
        "hit_s": statistics.median(hits),
        "hit_max_s": max(hits),
        "miss_s": statistics.median(misses),
        "refresh_s": statistics.median(refreshes),
        "refresh_rows": statistics.median(rows_read),
        "rss_open_mb": rss_open,
        "peak_rss_mb": _rss_mb("VmHWM"),
    }


def _never():
    raise AssertionError("a stored key was measured again")


def _rss_mb(field: str = "VmRSS") -> float:
    """Resident memory now (VmHWM: at its peak). Not ``ru_maxrss``: that counts the parent's
    memory too, which the child shared until its ``exec``."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


# -- the runs ------------------------------------------------------------------------------


def bench(url: str, n: int, memory_limit_gb: float, repeat: int) -> dict:
    """Build a store of ``n`` (+ EMPTY_ROWS) measurements at ``url`` (empty), time it in
    ``repeat`` fresh processes (the median of each time, the largest memory)."""
    from partune.store import measurements
    from partune.store.measurements import MeasurementStore

    engine = MeasurementStore(url, DEVICE).storage.engine  # Optuna's schema, the study, the claims
    if index := getattr(measurements, "KEY_INDEX", None):  # as a Partune before the index left it
        with engine.begin() as c:
            c.exec_driver_sql(f"DROP INDEX IF EXISTS {index}")
    engine.dispose()
    start = time.perf_counter()
    insert(url, 0, n + EMPTY_ROWS)
    build_s = time.perf_counter() - start
    if "postgresql" in url:
        _vacuum(url)  # what autovacuum (and a checkpoint) would do after a bulk load
    start = time.perf_counter()
    first = _run_child(url, n, memory_limit_gb, first_open=True)  # the first open of this Partune
    first_open_s = time.perf_counter() - start
    runs = [_run_child(url, n, memory_limit_gb) for _ in range(repeat)]
    row = next((r for r in runs if "error" in r), None) or {
        field: (max if field.endswith("_mb") else statistics.median)(r[field] for r in runs)
        for field in runs[0]
    }
    row.update(
        build_s=build_s,
        first_open_s=first.get("open_s", first_open_s),
        first_error=first.get("error"),
    )
    print(json.dumps(row), flush=True)
    return row


def _run_child(url: str, n: int, memory_limit_gb: float, first_open: bool = False) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        url,
        "--n",
        str(n),
        "--memory-limit-gb",
        str(memory_limit_gb),
    ]
    if first_open:
        cmd.append("--open-only")
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["?"])[-1]
        return {"n": n, "error": f"exit {done.returncode}: {tail[:200]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _vacuum(url: str) -> None:
    import sqlalchemy as sa

    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    with engine.connect() as c:
        c.exec_driver_sql("VACUUM ANALYZE")
        c.exec_driver_sql("CHECKPOINT")  # the bulk load's writes done before anything is timed
    engine.dispose()


def table(rows: list[dict], before: dict[int, dict] | None) -> list[str]:
    base = next((r for r in rows if r["n"] == 0 and "error" not in r), None)

    def cell(r: dict, field: str, scale: float, fmt: str) -> str:
        if "error" in r:
            return "failed"
        v = r[field]
        ratio = f" ({v / base[field]:.2f}x)" if base and r is not base and base[field] else ""
        return format(v * scale, fmt) + ratio

    head = [
        (
            "| measurements | open ms | first open ms | hit µs | miss ms | refresh ms (rows read) "
            "| RSS after open MB | peak RSS MB |"
        ),
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    out = []
    for r in rows:
        label = "empty" if r["n"] == 0 else f"{r['n']:,}"
        if "error" in r:
            out.append(f"| {label} | {r['error']} |  |  |  |  |  |  |")
            continue
        refresh = cell(r, "refresh_s", 1e3, ".2f") + f" ({r['refresh_rows']:.0f})"
        first = "failed" if r.get("first_error") else f"{r['first_open_s'] * 1e3:.0f}"
        out.append(
            f"| {label} | {cell(r, 'open_s', 1e3, '.0f')} | {first} | "
            f"{cell(r, 'hit_s', 1e6, '.0f')} | {cell(r, 'miss_s', 1e3, '.1f')} | {refresh} | "
            f"{r['rss_open_mb']:.0f} | {cell(r, 'peak_rss_mb', 1, '.0f')} |"
        )
        if before and r["n"] in before:
            b = before[r["n"]]
            if "error" in b:
                out.append(f"| (before) | {b['error']} |  |  |  |  |  |  |")
            else:
                out.append(
                    f"| (before) | {b['open_s'] * 1e3:.0f} |  | {b['hit_s'] * 1e6:.1f} | "
                    f"{b['miss_s'] * 1e3:.1f} | {b['refresh_s'] * 1e3:.2f} "
                    f"({b['refresh_rows']:.0f}) | {b['rss_open_mb']:.0f} | {b['peak_rss_mb']:.0f} |"
                )
    return head + out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="0,10000,100000,1000000")
    parser.add_argument(
        "--postgres", action="store_true", help="also on a local PostgreSQL (tests/postgres.py)"
    )
    parser.add_argument(
        "--memory-limit-gb",
        type=float,
        default=6.0,
        help="address-space limit of each measured process (a store that loads everything fails)",
    )
    parser.add_argument(
        "--repeat", type=int, default=3, help="measured processes per size (medians taken)"
    )
    parser.add_argument("--out", default=str(RESULTS / "store_scale.md"))
    parser.add_argument("--json", help="also write the raw rows here")
    parser.add_argument(
        "--before", help="raw rows (--json) of an earlier run, shown under each size"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--open-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        limit = int(args.memory_limit_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        if args.open_only:
            from partune.store.measurements import MeasurementStore

            start = time.perf_counter()
            MeasurementStore(args.child, DEVICE)
            print(json.dumps({"open_s": time.perf_counter() - start}))
        else:
            print(json.dumps(child(args.child, args.n)))
        return 0

    before = json.loads(Path(args.before).read_text()) if args.before else {}
    sizes = [int(s) for s in args.sizes.split(",")]
    results: dict[str, list[dict]] = {"sqlite": []}
    with tempfile.TemporaryDirectory(
        prefix="bench-store-", dir=os.environ.get("BENCH_STORE_DIR")
    ) as tmp:
        for n in sizes:
            results["sqlite"].append(
                bench(f"sqlite:///{tmp}/store-{n}.db", n, args.memory_limit_gb, args.repeat)
            )
            os.remove(f"{tmp}/store-{n}.db")
    if args.postgres:
        from tests.postgres import local_postgres

        results["postgres"] = []
        with local_postgres() as server:
            for n in sizes:
                results["postgres"].append(
                    bench(
                        server.create_database(f"bench_{n}"), n, args.memory_limit_gb, args.repeat
                    )
                )
                with contextlib.suppress(Exception):
                    server.create_database(f"bench_{n}")  # dropped (and left empty): disk back
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    lines = [
        "# The measurement store at fleet size (issue 19, part 3)",
        "",
        f"`python experiments/bench_store.py` on {os.cpu_count()} cores "
        f"({platform.processor() or platform.machine()}), Python {platform.python_version()}, run "
        f"under `nice -n 19` beside another benchmark. Each size: {args.repeat} fresh processes "
        "open the store and time it (the median of their medians, the largest memory); ratios are "
        "against the empty store. Hit: `obtain()` of a stored key, its first look in the process "
        f"(median of {HITS}); miss: `obtain()` of a new key, which claims, takes (at once) and "
        f"stores it (median of {MISSES}); refresh: `refresh()` after another writer stored "
        f"{WRITTEN_PER_REFRESH} (median of {REFRESHES}). First open: the first open by this "
        f"Partune of a store written before it (it adds an index). Every {FAIL_EVERY}th "
        f'measurement is a failure; "empty" holds the {EMPTY_ROWS} rows the hits come from. Each '
        f"process may map {args.memory_limit_gb:g} GB (a store that loads everything fails: "
        "MemoryError)."
        + (
            (
                ' Rows "(before)": the same benchmark, run earlier on the code before a change '
                "(`--before`)."
            )
            if before
            else ""
        ),
        "",
    ]
    for kind, rows in results.items():
        where = (
            "SQLite, a file on local disk"
            if kind == "sqlite"
            else "PostgreSQL on loopback (tests/postgres.py, fsync off)"
        )
        lines += [f"## {where}", ""]
        lines += table(rows, {r["n"]: r for r in before.get(kind, [])})
        lines.append("")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
