"""The persistent MetaSchedule tuning database: where it lives, repair, locking, snapshots.

Layout: ``<database_dir>/<target key>/`` holds MetaSchedule's two JSON-lines files
(``database_workload.json``, ``database_tuning_record.json``) and ``partune_tuning.json``
(the share each task got from a run that finished). One database per target
because MetaSchedule's lookup ignores the target: a record tuned for one target would be
applied to any other (checked on TVM 0.27: a CPU record answers a CUDA query).

Concurrency: tuning holds an exclusive ``flock`` on the target's database directory (the
kernel releases it when the holder dies); builds read a snapshot of complete lines
(``open_snapshot``) and need no lock.

Separate from the tuning (``tvm_tuning``), which writes the database: builds only read
snapshots of it (``tvm_tuned_backend``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import tvm
from tvm.s_tir import meta_schedule as ms

WORKLOAD_FILE = "database_workload.json"
RECORD_FILE = "database_tuning_record.json"
STATE_FILE = "partune_tuning.json"
LOCK_FILE = ".lock"


class TuningError(RuntimeError):
    """Tuning a region failed; the message is one line. Defined with the database, which
    ``tvm_tuning`` builds on, because waiting for the database's lock can fail too."""


def _plain(obj: Any) -> Any:
    """TVM containers (``Target.export()`` gives FFI maps and arrays) as plain JSON values."""
    if isinstance(obj, bool | int | float) or obj is None:
        return obj
    if isinstance(obj, str):
        return str(obj)
    if hasattr(obj, "items"):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple) or hasattr(obj, "__len__") and hasattr(obj, "__getitem__"):
        return [_plain(v) for v in obj]
    return str(obj)


def target_json(target: tvm.target.Target) -> dict:
    """``target`` as the JSON dict ``tvm.target.Target`` takes back."""
    return _plain(target.export())


def target_key(target: tvm.target.Target) -> str:
    """A directory name per target: kind plus a hash of every attribute (num-cores, mcpu...)."""
    text = json.dumps(target_json(target), sort_keys=True)
    return f"{target.kind.name}-{hashlib.sha1(text.encode()).hexdigest()[:12]}"


def database_path(database_dir: str, target: tvm.target.Target) -> str:
    """The directory of ``target``'s MetaSchedule database under ``database_dir``."""
    return os.path.join(database_dir, target_key(target))


def _complete_lines(data: bytes) -> bytes:
    """``data`` up to its last newline: a JSON-lines file without a partial last line."""
    return data[: data.rfind(b"\n") + 1]


def repair(path: str) -> None:
    """Cut a partial last line (a kill mid-write) off the database files, in place.

    Only under the exclusive lock: nobody else is appending then. Whole lines are always
    valid, since MetaSchedule writes a workload before any record that refers to it.
    """
    for name in (WORKLOAD_FILE, RECORD_FILE):
        file = os.path.join(path, name)
        if not os.path.exists(file):
            continue
        with open(file, "rb") as f:
            data = f.read()
        keep = _complete_lines(data)
        if len(keep) != len(data):
            os.truncate(file, len(keep))


_snapshots: dict[str, tuple[tuple, ms.database.Database, tempfile.TemporaryDirectory]] = {}


def open_snapshot(path: str) -> ms.database.Database | None:
    """The database at ``path`` as it is now, read-only in spirit; None when there is none.

    A tuning process may be appending meanwhile, so the complete lines are copied (records
    first, then workloads, so every record read has its workload) and MetaSchedule opens
    the copy. Cached until the files change: opening parses every record.
    """
    rec, wl = os.path.join(path, RECORD_FILE), os.path.join(path, WORKLOAD_FILE)
    if not os.path.exists(wl):
        return None
    stamp = (
        tuple((s.st_size, s.st_mtime_ns) for s in map(os.stat, (rec, wl)))
        if os.path.exists(rec)
        else (os.stat(wl).st_size,)
    )
    cached = _snapshots.get(path)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    records = b""
    if os.path.exists(rec):
        with open(rec, "rb") as f:
            records = _complete_lines(f.read())
    with open(wl, "rb") as f:
        workloads = _complete_lines(f.read())
    tmp = tempfile.TemporaryDirectory(prefix="partune-db-")
    for name, data in ((RECORD_FILE, records), (WORKLOAD_FILE, workloads)):
        with open(os.path.join(tmp.name, name), "wb") as f:
            f.write(data)
    db = ms.database.JSONDatabase(work_dir=tmp.name, allow_missing=False)
    _snapshots[path] = (stamp, db, tmp)
    return db


@contextlib.contextmanager
def locked(path: str, deadline: float | None) -> Iterator[None]:
    """Hold the exclusive tuning lock of a database directory (wait until ``deadline``)."""
    with open(os.path.join(path, LOCK_FILE), "a") as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | (fcntl.LOCK_NB if deadline is not None else 0))
                break
            except BlockingIOError:
                if time.monotonic() > deadline:  # type: ignore[operator]
                    raise TuningError(
                        f"database {path} is locked by another tuning process"
                    ) from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def read_state(path: str) -> dict[str, int]:
    """Per workload hash, the share a finished run gave it."""
    try:
        with open(os.path.join(path, STATE_FILE)) as f:
            return {k: int(v) for k, v in json.load(f).items()}
    except (FileNotFoundError, ValueError):
        return {}


def write_state(path: str, state: dict[str, int]) -> None:
    tmp = os.path.join(path, STATE_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(state, f, indent=0, sort_keys=True)
    os.replace(tmp, os.path.join(path, STATE_FILE))
