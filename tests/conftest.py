"""Shared fixtures: imported small zoo models are cached for the whole session."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest

os.environ.setdefault("TVM_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore", category=FutureWarning)

_cache: dict = {}


def load_model(name: str):
    from partune.models import load

    if name not in _cache:
        _cache[name] = load(name)
    return _cache[name]


@pytest.fixture(scope="session")
def bert():
    return load_model("bert-small")


@pytest.fixture(scope="session")
def resnet():
    return load_model("resnet50-small")


@pytest.fixture
def backend_settings():
    """Change the backends' settings (``partune.backends.settings``) for one test; restored after."""
    from dataclasses import replace

    from partune.backends import registry

    before = registry.settings()

    def change(**values) -> None:
        registry.configure(replace(registry.settings(), **values))

    yield change
    registry.configure(before)


def _postgres_bin():
    """The newest PostgreSQL server binaries on this machine (Debian's layout), or None."""
    import glob

    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return os.path.dirname(found[-1]) if found else None


def _as_postgres(cmd: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: run its tools as the ``postgres`` user then."""
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


@dataclass(frozen=True)
class PostgresServer:
    """The session's PostgreSQL: where it listens, and ``pg_ctl`` to stop and start it (a
    test of riding out an outage)."""

    host: str
    port: int
    pg_ctl: Callable[[str], object]

    def stop(self) -> None:
        self.pg_ctl("stop")

    def start(self) -> None:
        self.pg_ctl("start")


@pytest.fixture(scope="session")
def postgres_server():
    """A real PostgreSQL on loopback, for this session: (host, port).

    Skipped only where the server binaries are absent; a server that is there and will not
    start is an error, never a silent pass. Its data directory is a fresh one owned by the
    ``postgres`` user (pytest's temporary folders belong to root), removed afterwards.
    """
    import shutil
    import socket
    import subprocess
    import tempfile

    bin_dir = _postgres_bin()
    if bin_dir is None:
        pytest.skip("no PostgreSQL server binaries (/usr/lib/postgresql/*/bin)")
    root = tempfile.mkdtemp(prefix="partune-pg-")
    data = os.path.join(root, "data")
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = lambda *cmd: subprocess.run(_as_postgres(list(cmd)), check=True, capture_output=True, text=True)  # noqa: E731
    options = ["-w", "-t", "60", "-l", os.path.join(root, "log"), "-o",
               f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"]
    try:
        run(f"{bin_dir}/initdb", "-D", data, "-A", "trust", "-U", "postgres", "--no-sync")
        run(f"{bin_dir}/pg_ctl", "-D", data, *options, "start")
    except subprocess.CalledProcessError as e:
        shutil.rmtree(root, ignore_errors=True)
        raise RuntimeError(f"PostgreSQL did not start: {e.stderr.strip()[-300:]}") from e
    yield PostgresServer("127.0.0.1", port, lambda action: run(f"{bin_dir}/pg_ctl", "-D", data,
                                                                *(options if action == "start" else ["-m", "fast"]), action))
    subprocess.run(_as_postgres([f"{bin_dir}/pg_ctl", "-D", data, "-m", "immediate", "stop"]), capture_output=True)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def postgres_url(postgres_server, request):
    """A fresh, empty database on the session's PostgreSQL, as a storage URL."""
    import psycopg2

    host, port = postgres_server.host, postgres_server.port
    name = "t_" + "".join(c if c.isalnum() else "_" for c in request.node.name)[-50:].lower()
    conn = psycopg2.connect(host=host, port=port, user="postgres", dbname="postgres")
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(f'DROP DATABASE IF EXISTS "{name}"')
        cur.execute(f'CREATE DATABASE "{name}"')
    conn.close()
    return f"postgresql+psycopg2://postgres@{host}:{port}/{name}"


@pytest.fixture(params=["sqlite", "postgres"])
def storage_url(request, tmp_path):
    """The same test on SQLite and on a real PostgreSQL (``-k postgres`` selects the latter)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'm.db'}"
    return request.getfixturevalue("postgres_url")
