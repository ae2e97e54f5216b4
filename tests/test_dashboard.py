"""``partune dashboard``: optuna-dashboard serves a storage's studies on loopback, and a storage
that cannot be opened is one line, exit 2."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import optuna
import pytest

from partune.cli import main

ROOT = Path(__file__).resolve().parents[1]
REFINE = "refine:0123abcd:plan"


def _store(path: Path) -> str:
    """A small SQLite store as a search leaves it: a refinement study with trials, the tuning job
    that names it, and a device's measurement study."""
    url = f"sqlite:///{path}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    refine = optuna.create_study(study_name=REFINE, storage=url)
    refine.optimize(
        lambda t: 1.0 + (t.suggest_categorical("r0", ["tvm", "torch"]) == "torch"), n_trials=3
    )
    job = optuna.create_study(study_name="chain:tvm,torch", storage=url)
    job.set_user_attr("refine_study", REFINE)
    optuna.create_study(study_name="partune-measurements/test-device", storage=url)
    return url


class _Lines:
    """A process's stdout, line by line, read by a thread: ``select`` on the pipe would miss
    lines already in Python's buffer, and a blocking read would hang the test."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.queue = proc, queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in iter(self.proc.stdout.readline, ""):
            self.queue.put(line)
        self.queue.put(None)  # the end

    def until(self, text: str, timeout_s: float) -> tuple[str, list[str]]:
        """The first line holding ``text``, and every line before it."""
        deadline, seen = time.monotonic() + timeout_s, []
        while time.monotonic() < deadline:
            try:
                line = self.queue.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                break
            if text in line:
                return line, seen
            seen.append(line)
        raise AssertionError(f"no '{text}' from the dashboard (exit {self.proc.poll()}): {seen}")


def test_dashboard_serves_the_studies(tmp_path):
    url = _store(tmp_path / "m.db")
    proc = subprocess.Popen(
        [sys.executable, "-m", "partune.cli", "dashboard", "--storage", url, "--port", "0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        out = _Lines(proc)
        line, before = out.until("optuna-dashboard on http://127.0.0.1:", 180)
        base = line.split(" on ")[1].split()[0].removesuffix("/dashboard")
        with urllib.request.urlopen(f"{base}/api/studies", timeout=30) as reply:
            studies = {s["study_name"]: s["study_id"] for s in json.load(reply)["study_summaries"]}
        assert {REFINE, "chain:tvm,torch", "partune-measurements/test-device"} <= set(studies)
        # The tuning job's line links straight to its refinement study, whose trials are served.
        assert any(f"{base}/dashboard/studies/{studies[REFINE]}" in ln for ln in before), before
        with urllib.request.urlopen(f"{base}/api/studies/{studies[REFINE]}", timeout=30) as reply:
            assert len(json.load(reply)["trials"]) == 3
        proc.send_signal(signal.SIGINT)  # Ctrl-C ends it cleanly, not as an interrupted search
        out.until("dashboard stopped", 30)
        assert proc.wait(timeout=30) == 0 and "interrupted" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("content", [b"not a database at all", None])
def test_dashboard_on_a_bad_storage_is_one_line(tmp_path, capsys, content):
    path = tmp_path / "bad.db"
    if content is not None:
        path.write_bytes(content)
    assert main(["dashboard", "--storage", f"sqlite:///{path}", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("partune: error: cannot open storage"), err
    assert path.exists() == (content is not None)  # a missing store is not created empty
