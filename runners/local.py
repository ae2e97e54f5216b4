"""LocalRunner: measures in a worker process that has the backends registered.

One long-lived worker (imports are paid once) measures requests one at a time; the
parent enforces a timeout per request. A worker that crashes (a segfaulting kernel)
or hangs is killed with its process group and replaced; the request is costed +inf
with the error kept.

``cpus`` pins the worker to those cores (``os.sched_setaffinity`` at its start, and TVM
told not to re-pin: by default TVM binds every process that sets up its thread pool to
core 0, whatever mask it had). A measuring worker on its own core beside a build pool
(``partune.runners.build_pool``) on the others is the intended use.

A worker is replaced before it grows (``max_rss_bytes``, ``max_requests``): the libraries
keep compiled code, arenas and caches, and one long-lived worker grew to 8.9 GB over a
search of 3,175 measurements. After each reply the worker reports its resident size and its
peak (``worker_main``); one above the limit, or past its number of requests, is closed and a
fresh one started at once, its imports overlapping what the search does next. Each runner
counts the workers it replaced (``recycled``) and the highest peak any of them reached
(``peak_rss_bytes``), for the summary.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from partune.runners import memory
from partune.runners.isolated import compare_isolated
from partune.runners.protocol import (
    CaptureReply,
    CompareRequest,
    ErrorReply,
    PlanRequest,
    ProtocolError,
    Reply,
    Request,
    failure_of,
    reply_from_json,
)
from partune.runners.runner import Runner
from partune.runners.timing import Measurement
from partune.runners.worker_main import CPUS_ENV, RSS_LIMIT_ENV

# Crash-handler output (TVM's backtrace, Python's faulthandler) that only restates the signal.
_NOISE = re.compile(
    r'File "|!{3}|Traceback \(most recent call|(?:Current thread|Thread) 0x|Stack \(most recent|'
    r"Extension modules:|<no Python frame>|"
    r"Fatal Python error: (?:Segmentation fault|Aborted|Bus error)"
)
_SIZES = struct.calcsize("<QQ")  # what follows each reply: the worker's resident size and peak


class LocalRunner(Runner):
    startup_timeout_s = 300.0  # importing TVM and torch on a loaded machine
    reads_local_files = True

    def __init__(
        self,
        timeout_s: float = 120.0,
        threads: int = 1,
        cpus: Iterable[int] | None = None,
        *,
        max_requests: int | None = memory.MAX_REQUESTS,
        max_rss_bytes: int | None = memory.default_rss_limit(),
    ) -> None:
        """``max_rss_bytes``: replace the worker when it is resident above this after a request
        (default: 3 GiB, or a quarter of the machine where less); ``max_requests``: after this
        many requests, whatever its size (slow growth the size check would catch late). None:
        never. A request that fails does not count: its worker was killed anyway."""
        self.timeout_s = timeout_s
        self.threads = threads
        self.cpus = sorted(set(cpus)) if cpus is not None else None
        self.max_requests = max_requests
        self.max_rss_bytes = max_rss_bytes
        self.recycled = 0  # workers replaced for their size or their number of requests
        self.peak_rss_bytes = 0  # the highest resident size any worker of this runner reached
        self.rss_bytes = 0  # the worker's resident size after the last request
        self._proc: subprocess.Popen | None = None
        self._ready = False  # the worker has said RDY!
        self._served = 0  # requests answered by the worker now running
        self._log = tempfile.TemporaryFile()

    def _spawn(self) -> None:
        env = dict(
            os.environ,
            TVM_NUM_THREADS=str(self.threads),
            OMP_NUM_THREADS=str(self.threads),
            PYTHONWARNINGS="ignore",
            **{RSS_LIMIT_ENV: str(self.max_rss_bytes or 0)},
        )
        if self.cpus:
            env |= {CPUS_ENV: ",".join(map(str, self.cpus)), "TVM_BIND_THREADS": "0"}
        self._log.seek(0)
        self._log.truncate()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "partune.runners.worker_main"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            start_new_session=True,
        )
        self._ready, self._served = False, 0

    def _start(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._spawn()
        if not self._ready:
            if self._read(4, time.monotonic() + self.startup_timeout_s) != b"RDY!":
                raise ChildProcessError
            self._ready = True
        assert self._proc is not None
        return self._proc

    def start(self) -> None:
        """Start the worker now (its imports paid ahead of the first request)."""
        try:
            self._start()
        except BaseException:
            self._kill()  # not half started: the next request starts a fresh one
            raise

    @property
    def pid(self) -> int | None:
        """The worker's process id (it leads its own process group); None when none runs."""
        return self._proc.pid if self._proc is not None else None

    def _kill(self) -> None:
        if self._proc is not None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self._reap(self._proc)
            self._proc = None

    def _reap(self, proc: subprocess.Popen) -> int:
        """Wait for ``proc`` to end; its exit code (negative: the signal). The peak the kernel
        counted for it joins ``peak_rss_bytes``: a worker killed mid-request (by the
        out-of-memory killer, say) reported none."""
        if proc.returncode is None:
            try:
                _, status, usage = os.wait4(proc.pid, 0)
            except ChildProcessError:
                return proc.wait()
            proc.returncode = os.waitstatus_to_exitcode(status)
            self.peak_rss_bytes = max(self.peak_rss_bytes, usage.ru_maxrss * 1024)
        return proc.returncode

    def _recycle(self, rss: int, peak: int) -> None:
        """After a reply: note the worker's peak; replace it if it has grown or served enough.

        Never in the middle of an isolated comparison: its runners have no limits
        (``compare``), since a worker keeps a comparison's contenders built across its rounds.
        """
        self.peak_rss_bytes, self.rss_bytes = max(self.peak_rss_bytes, peak), rss
        self._served += 1
        if (self.max_rss_bytes and rss > self.max_rss_bytes) or (
            self.max_requests and self._served >= self.max_requests
        ):
            self.close()
            self.recycled += 1
            try:
                self._spawn()  # its imports run while the search prepares the next request
            except OSError:
                self._proc = None  # the next request tries again, and says so if it cannot

    def _log_tail(self) -> str:
        """The worker's last words before it died, if they say anything: a crash handler's stack
        frames (``File "...", line 0, in 0xffff``) and banners (``!!! Segfault encountered !!!``)
        only repeat the signal the reason already names."""
        self._log.seek(0)
        lines = [ln.strip() for ln in self._log.read().decode(errors="replace").splitlines()]
        said = [ln for ln in lines if ln and not _NOISE.match(ln)]
        return said[-1][:200] if said else ""

    def _read(self, n: int, deadline: float) -> bytes:
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        fd = proc.stdout.fileno()
        chunks, got = [], 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                raise TimeoutError
            chunk = os.read(fd, n - got)
            if not chunk:
                raise ChildProcessError
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def exchange(self, request: Request, timeout_s: float | None = None) -> Reply:
        request = self.addressed(request)
        if isinstance(request, PlanRequest) and request.fresh:
            self.close()  # a new worker: nothing an earlier request left behind counts
        data = json.dumps(request.to_json()).encode()
        limit = timeout_s or self.timeout_s
        try:
            proc = self._start()
            deadline = time.monotonic() + limit
            assert proc.stdin is not None
            proc.stdin.write(struct.pack("<I", len(data)))
            proc.stdin.write(
                data
            )  # not joined to its header: a copy fewer of a whole model (0.6 GB at 12 layers)
            del data
            proc.stdin.flush()
            size = struct.unpack("<I", self._read(4, deadline))[0]
            body = self._read(size + _SIZES, deadline)
            reply = reply_from_json(json.loads(body[:size]))
        except TimeoutError:
            self._kill()
            return ErrorReply(f"timed out after {limit:g} s")
        except (ValueError, ProtocolError) as e:  # JSON that is not a reply: the worker is not ours
            self._kill()
            return ErrorReply(f"unreadable reply from the worker: {str(e)[:120]}")
        except (ChildProcessError, BrokenPipeError, OSError):
            if self._proc is None:
                return ErrorReply("worker could not start")
            code = self._reap(self._proc)
            tail = self._log_tail()
            self._proc = None
            why = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            return ErrorReply(f"worker crashed ({why})" + (f": {tail}" if tail else ""))
        self._recycle(*struct.unpack("<QQ", body[size:]))
        return reply

    def captured(
        self, mod: Any, graph: Any, inputs: list, backends: list[str], model_file: Path | None
    ) -> dict:
        """The model's values, computed by the worker from ``model_file`` and read back from an
        .npz: the whole-model build (BERT-768 at 12 layers took the search process from 2.1 to
        3.5 GB) and any crash in it are the worker's, not the search's."""
        from partune.runners.builder import capture_request
        from partune.runners.capture import load_values

        assert model_file is not None  # this runner reads_local_files
        out = model_file.with_suffix(".values.npz")
        reply = self.exchange(capture_request(model_file, inputs, backends, out))
        if not isinstance(reply, CaptureReply):
            raise RuntimeError(failure_of(reply))
        try:
            return load_values(mod["main"], str(out))
        finally:
            out.unlink(missing_ok=True)

    def available_bytes(self) -> int | None:
        return memory.available_bytes()  # the worker runs on this machine

    def compare(
        self, request: CompareRequest, timeout_s: float | None = None
    ) -> dict[str, Measurement]:
        """At one thread, in this runner's worker, interleaved. At more, each contender in a
        worker of its own, one running at a time (``partune.runners.isolated``): a library's
        idle threads must not slow the contender after it."""
        if self.threads == 1 or len(request.contenders) < 2:
            return super().compare(request, timeout_s)
        made: list[LocalRunner] = []

        def runner_for() -> LocalRunner:  # not recycled: it keeps its contender built across rounds
            made.append(
                LocalRunner(
                    self.timeout_s, self.threads, self.cpus, max_requests=None, max_rss_bytes=None
                )
            )
            return made[-1]

        try:
            return compare_isolated(request, runner_for, timeout_s)
        finally:
            self.peak_rss_bytes = max([self.peak_rss_bytes, *(r.peak_rss_bytes for r in made)])

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.close()
                self._proc.wait(timeout=5)
            except (subprocess.TimeoutExpired, OSError):
                pass
        self._kill()
