"""A TVM RPC tracker and ``partune rpc-server`` devices on loopback, for the tests that need
them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONWARNINGS="ignore")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        start_new_session=True,
        env=ENV | (env or {}),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def start_server(tracker: str, key: str, env: dict | None = None) -> subprocess.Popen:
    port = free_port()
    return _start(
        [
            sys.executable,
            "-m",
            "partune.cli",
            "rpc-server",
            "--tracker",
            tracker,
            "--key",
            key,
            "--port",
            str(port),
            "--port-end",
            str(port + 20),
        ],
        env,
    )


def wait_for_servers(tracker: str, key: str, count: int, timeout_s: float = 120.0) -> None:
    """Until the tracker lists ``count`` free servers under ``key`` (they register once
    imported)."""
    import tvm.rpc

    host, port = tracker.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            summary = tvm.rpc.connect_tracker(host, int(port)).summary()
            if summary.get("queue_info", {}).get(key, {}).get("free", 0) >= count:
                return
        except Exception:  # noqa: BLE001 - the tracker is still starting
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{count} '{key}' servers did not register with {tracker}")
        time.sleep(0.5)


def stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


@contextmanager
def loopback_fleet(devices: dict[str, int], env: dict | None = None):
    """A tracker and, per key, that many servers (``env`` added to theirs); yields the
    tracker's HOST:PORT and the server processes by key. Everything is killed afterwards."""
    port = free_port()
    tracker = _start(
        [
            sys.executable,
            "-m",
            "tvm.exec.rpc_tracker",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--port-end",
            str(port + 1),
            "--silent",
        ]
    )
    address = f"127.0.0.1:{port}"
    servers = {
        key: [start_server(address, key, env) for _ in range(n)] for key, n in devices.items()
    }
    try:
        for key, n in devices.items():
            wait_for_servers(address, key, n)
        yield address, servers
    finally:
        stop(*(p for ps in servers.values() for p in ps), tracker)
