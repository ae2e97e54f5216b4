"""``partune dashboard``: optuna-dashboard over a storage, on this machine only.

Refinement is an Optuna study, so the tool people already use for Optuna shows it best:
each variant tried (a trial), the backend it gave each region and the merges (its
parameters), and how the best time fell (the history). The server listens on loopback
only: the dashboard can rename and delete studies, so it is not for the network.
"""

from __future__ import annotations

import argparse
import signal
from pathlib import Path
from typing import Any

from partune.commands.common import sqlite_file, study_summaries

HOST = "127.0.0.1"


def cmd_dashboard(args: argparse.Namespace) -> int:
    """Serve optuna-dashboard over ``--storage`` until interrupted; print where to open it."""
    from partune.core import PartuneError

    _check_exists(args.storage)
    summaries = study_summaries(args.storage)  # a storage that cannot be opened: one line, exit 2
    try:
        import optuna_dashboard
    except ImportError:
        raise PartuneError(
            "partune dashboard needs optuna-dashboard: pip install optuna-dashboard"
        ) from None
    server = _server(optuna_dashboard.wsgi(args.storage), args.port)
    url = f"http://{HOST}:{server.server_port}"
    for line in _listing(summaries, url):
        print(line)
    print(f"optuna-dashboard on {url}/dashboard (this machine only; Ctrl-C stops it)", flush=True)
    # A process started in the background inherits SIGINT ignored: Ctrl-C (and a plain
    # kill) must still end it cleanly.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        server.serve_forever()
    except KeyboardInterrupt:  # Ctrl-C is how it ends: not an interrupted search
        print("dashboard stopped")
    finally:
        server.server_close()
    return 0


def _check_exists(storage: str) -> None:
    """Opening an SQLite path that is not there would create an empty store: say so instead."""
    from partune.core import PartuneError
    from partune.store import MEMORY

    if storage == MEMORY:
        raise PartuneError(
            "a 'memory' storage keeps nothing after its run: name a database with --storage"
        )
    path = sqlite_file(storage)
    if path is not None and not Path(path).is_file():
        raise PartuneError(f"cannot open storage {storage}: no file {path}")


def _server(app: Any, port: int):
    """A threaded WSGI server on loopback (``port`` 0: any free one); request logs stay quiet."""
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    from partune.core import PartuneError

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True  # a browser's open connection must not keep Ctrl-C from ending it

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # the base class's signature
            pass

    try:
        return make_server(HOST, port, app, server_class=Server, handler_class=Quiet)
    except OSError as e:
        raise PartuneError(
            f"cannot listen on {HOST}:{port}: {e.strerror or e} (choose another --port)"
        ) from None


def _listing(summaries: list, url: str) -> list[str]:
    """What the storage holds, with a link to each tuning job's refinement study."""
    from partune.store import STUDY_PREFIX

    ids = {s.study_name: getattr(s, "_study_id", None) for s in summaries}
    measurements = [s for s in summaries if s.study_name.startswith(STUDY_PREFIX)]
    jobs = [s for s in summaries if s.user_attrs.get("refine_study")]
    lines = [
        f"{_studies(len(summaries))}: {len(jobs)} tuning job(s) with a refinement study, "
        f"{_studies(len(measurements), 'measurement ')} (one per device)"
    ]
    for job in jobs:
        refine = job.user_attrs["refine_study"]
        link = (
            f"{url}/dashboard/studies/{ids[refine]}"
            if ids.get(refine) is not None
            else "(not started)"
        )
        lines.append(f"  {job.study_name}: refinement {link}")
    return lines


def _studies(n: int, kind: str = "") -> str:
    """``1 study``, ``3 measurement studies``."""
    return f"{n} {kind}stud{'y' if n == 1 else 'ies'}"
