"""A real PostgreSQL on loopback, in a fresh data directory: for the tests and the fault campaign.

Debian's server binaries refuse to run as root, so as root its tools run as the
``postgres`` user, and the data directory is made theirs (temporary folders belong to root).
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass


def postgres_bin() -> str | None:
    """The newest PostgreSQL server binaries on this machine (Debian's layout), or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return os.path.dirname(found[-1]) if found else None


def _as_postgres(cmd: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


def _run(*cmd: str) -> None:
    subprocess.run(_as_postgres(list(cmd)), check=True, capture_output=True, text=True)


@dataclass(frozen=True)
class PostgresServer:
    """Where the server listens, and how to stop and start it (an outage, on purpose)."""

    host: str
    port: int
    bin_dir: str
    data: str
    options: tuple[str, ...]
    password: str | None = None

    def url(self, database: str = "postgres", password: str | None = None) -> str:
        secret = password if password is not None else self.password
        return (
            f"postgresql+psycopg2://postgres{':' + secret if secret else ''}"
            f"@{self.host}:{self.port}/{database}"
        )

    def stop(self) -> None:
        _run(f"{self.bin_dir}/pg_ctl", "-D", self.data, "-m", "fast", "stop")

    def start(self) -> None:
        _run(f"{self.bin_dir}/pg_ctl", "-D", self.data, *self.options, "start")

    def create_database(self, name: str) -> str:
        """A fresh, empty database (dropped first if it exists); its storage URL."""
        import psycopg2

        conn = psycopg2.connect(
            host=self.host,
            port=self.port,
            user="postgres",
            dbname="postgres",
            password=self.password,
        )
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f'DROP DATABASE IF EXISTS "{name}"')
            cur.execute(f'CREATE DATABASE "{name}"')
        conn.close()
        return self.url(name)


@contextmanager
def local_postgres(password: str | None = None):
    """A server for the duration of the block (``password``: login required, else trust).
    Raises RuntimeError when the binaries are there but it will not start."""
    bin_dir = postgres_bin()
    if bin_dir is None:
        raise FileNotFoundError("no PostgreSQL server binaries (/usr/lib/postgresql/*/bin)")
    root = tempfile.mkdtemp(prefix="partune-pg-")
    data = os.path.join(root, "data")
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    options = (
        "-w",
        "-t",
        "60",
        "-l",
        os.path.join(root, "log"),
        "-o",
        f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200",
    )
    server = PostgresServer("127.0.0.1", port, bin_dir, data, options, password)
    try:
        auth = ["-A", "trust"]
        if password:
            pwfile = os.path.join(root, "pw")
            with open(pwfile, "w") as f:
                f.write(password)
            if os.geteuid() == 0:
                shutil.chown(pwfile, "postgres", "postgres")
            auth = ["-A", "scram-sha-256", "--pwfile", pwfile]
        _run(f"{bin_dir}/initdb", "-D", data, *auth, "-U", "postgres", "--no-sync")
        server.start()
    except subprocess.CalledProcessError as e:
        shutil.rmtree(root, ignore_errors=True)
        raise RuntimeError(f"PostgreSQL did not start: {e.stderr.strip()[-300:]}") from e
    try:
        yield server
    finally:
        subprocess.run(
            _as_postgres([f"{bin_dir}/pg_ctl", "-D", data, "-m", "immediate", "stop"]),
            capture_output=True,
        )
        shutil.rmtree(root, ignore_errors=True)
