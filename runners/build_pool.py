"""BuildPool: regions built ahead of time, on the cores the measurements do not use.

MetaSchedule splits the Builder from the Runner; so does this. Without a pool the one
measuring worker builds each candidate (TVM compile, ORT graph optimisation, OpenVINO
compile) right before timing it, so every build is on the search's critical path. A
pool of build workers (processes like the measuring worker, pinned to the other cores)
builds the requests it is given into a build cache (``partune.backends.build_cache``) while the
measurer times earlier ones; the measurer then only loads a ready artefact.

    unpin_search_process()                            # TVM pinned this process to core 0
    measure_cpus, build_cpus = split_cores()
    pool = BuildPool(cache_dir, cpus=build_cpus)      # workers on the cores the measurer leaves
    runner = LocalRunner(cpus=measure_cpus)           # the measurer on a core of its own
    pool.prefetch([req1, req2, ...])                  # region requests, in the order measured
    pool.wait(req1, timeout_s)                        # its build is done (or failed)
    runner.run(replace(req1, build_cache=pool.cache_dir))

``Lookahead`` does this bookkeeping for a loop that measures keys in order.

A build that fails, crashes or hangs in the pool costs only that build: the worker is
replaced and the measurer builds the region itself (a miss). Backends that keep nothing
(torch) are not sent to the pool. A request the measurer reaches before its build started
is taken back, with every request queued before it: the measurer builds it itself rather
than wait, and the pool goes on with what comes next. One it reaches while it is being
built, it waits for; then the pool is behind, and the request queued next is left to the
measurer too, so that when the pool is the slower side the two share the builds.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import replace
from typing import Generic, TypeVar

from partune.backends import build_cache
from partune.runners import memory
from partune.runners.local import LocalRunner
from partune.runners.protocol import (
    BuildReply,
    BuildRequest,
    ErrorReply,
    RegionRequest,
    Reply,
    Request,
)

K = TypeVar("K", bound=Hashable)

_QUEUED, _BUILDING, _DONE, _FAILED = "queued", "building", "done", "failed"
_START_FAILURES = 3  # a worker that cannot start this many times in a row gives up
# A worker with nothing to build this long is stopped (the next request starts another): once
# the candidates are built, what it holds (2.8 GB at 24 BERT-768 layers) is not kept through
# the whole-model plans and the verdict, which need the memory most.
IDLE_S = 30.0


def available_cpus() -> list[int]:
    """The cores this process may run on.

    Not ``os.sched_getaffinity(0)`` alone: TVM binds the thread that sets up its thread
    pool to core 0, so in a process that has used TVM that mask says {0}. The cgroup's
    cpuset says what the machine lends; the affinity mask counts where it says nothing.
    """
    mine = set(os.sched_getaffinity(0))
    for path in (
        "/sys/fs/cgroup/cpuset.cpus.effective",
        "/sys/fs/cgroup/cpuset/cpuset.effective_cpus",
        "/sys/fs/cgroup/cpuset/cpuset.cpus",
    ):
        with contextlib.suppress(OSError, ValueError):
            with open(path) as f:
                text = f.read().strip()
            cpus: set[int] = set()
            for part in filter(None, text.split(",")):
                lo, _, hi = part.partition("-")
                cpus.update(range(int(lo), int(hi or lo) + 1))
            if cpus:
                return sorted(cpus | mine)
    return sorted(set(range(os.cpu_count() or 1)) | mine)


def split_cores(threads: int = 1) -> tuple[list[int], list[int]]:
    """(the measuring worker's cores, the build pool's cores): the last ``threads`` cores and
    the rest (empty on a machine with no core to spare: then there is no pool).

    The last, not the first: TVM binds every process that sets up its thread pool to
    core 0 (the search's own process, MetaSchedule's workers, any other TVM job on the
    machine), so core 0 is the busiest; builds mind sharing it far less than timings.
    """
    cpus = available_cpus()
    if len(cpus) <= threads:
        return cpus, []
    return cpus[-threads:], cpus[:-threads]


def unpin_search_process() -> None:
    """Let the calling thread run on every core again, and keep TVM from binding it to core 0.

    TVM binds the thread that sets up its thread pool to core 0 (``TVM_BIND_THREADS``, on by
    default), which in the search process is the main thread: its serial work between
    measurements (making requests, storing results) then shares a core with the build
    pool. Call it in the search process before the pool starts (the variable is read
    whenever TVM sets up its pool); give the measuring LocalRunner its ``cpus``.
    """
    os.environ["TVM_BIND_THREADS"] = "0"
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, available_cpus())


class BuildPool:
    """Processes that build region requests into a build cache ahead of their measurement."""

    def __init__(
        self,
        cache_dir: str,
        workers: int = 1,
        *,
        threads: int = 1,
        cpus: Iterable[int] | None = None,
        timeout_s: float = 300.0,
        max_builds: int | None = memory.MAX_REQUESTS,
        max_rss_bytes: int | None = memory.default_rss_limit(),
    ) -> None:
        """``workers`` processes (0: no pool, every call does nothing) on ``cpus`` (default:
        the cores ``split_cores(threads)`` leaves to the pool; none left means no pool).
        ``threads`` is the measuring runner's thread count: what is built for it is what it
        will load. ``timeout_s`` bounds one build; a worker past it is killed and replaced.
        A worker is also replaced after ``max_builds`` builds, or when resident above
        ``max_rss_bytes`` after one (``LocalRunner``'s limits; None: never): compilers keep
        memory from build to build, and the pool must not grow beside the measurer.
        """
        self.cache_dir = os.path.abspath(cache_dir)
        self.threads = threads
        self.timeout_s = timeout_s
        self.cpus = sorted(set(cpus)) if cpus is not None else split_cores(threads)[1]
        self.workers = max(0, int(workers)) if self.cpus else 0
        self.stats: collections.Counter[str] = collections.Counter()
        self.errors: list[str] = []  # the last few build failures, for reports
        self._cond = threading.Condition()
        self._queue: collections.deque[str] = collections.deque()
        self._pending: dict[str, BuildRequest] = {}
        self._state: dict[str, str] = {}
        self._closed = False
        self._starting = max(0, int(workers)) if self.cpus else 0
        self._runners = [
            LocalRunner(
                timeout_s,
                threads,
                cpus=self.cpus,
                max_requests=max_builds,
                max_rss_bytes=max_rss_bytes,
            )
            for _ in range(self.workers)
        ]
        self._threads = [
            threading.Thread(target=self._serve, args=(r,), daemon=True, name=f"build-pool-{i}")
            for i, r in enumerate(self._runners)
        ]
        if self.workers:
            os.makedirs(self.cache_dir, exist_ok=True)
            build_cache.remove_stale(self.cache_dir)
        for t in self._threads:
            t.start()

    @property
    def enabled(self) -> bool:
        return self.workers > 0 and not self._closed

    def prefetch(self, requests: Iterable[Request]) -> None:
        """Queue region requests for building, in this order (after those queued already).

        Returns at once. Requests queued, built or building already, and those of backends
        that keep nothing built, are passed over.
        """
        if not self.enabled:
            return
        for req in requests:
            if not isinstance(req, RegionRequest) or not _caches(req.backend):
                continue
            key = _key(req)
            with self._cond:
                if key in self._state:
                    continue
                self._state[key] = _QUEUED
                self._pending[key] = BuildRequest.of(req, self.cache_dir)
                self._queue.append(key)
                self.stats["queued"] += 1
                self._cond.notify()

    def wait(self, request: Request, timeout_s: float) -> bool:
        """Until ``request``'s build has finished or failed (at most ``timeout_s``).

        Returns at once when it was never queued; when it is queued but not started, it is
        taken back with every request queued before it (the measurer is past those) and
        the measurer builds it. When it had to wait, the next queued request is taken back
        too (see the module docstring). True when the pool built it: the measurer will load it.
        """
        if not self.enabled or not isinstance(request, RegionRequest):
            return False
        key = _key(request)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            state = self._state.get(key)
            if state == _QUEUED:
                while self._queue:
                    k = self._queue.popleft()
                    self._pending.pop(k, None)
                    del self._state[k]
                    self.stats["taken back"] += 1
                    if k == key:
                        break
                return False
            if state == _BUILDING:
                start = time.monotonic()
                self.stats["waited"] += 1
                while self._state.get(key) == _BUILDING and not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                self.stats["wait_ms"] += round((time.monotonic() - start) * 1e3)
                # The pool is not ahead: leave the next request to the measurer, so that the
                # two build side by side instead of the measurer waiting on every build.
                if self._queue:
                    k = self._queue.popleft()
                    self._pending.pop(k, None)
                    del self._state[k]
                    self.stats["left to the measurer"] += 1
            return self._state.get(key) == _DONE

    def summary(self) -> str:
        """One line for the user: what the pool built and how often the measurer waited for it."""
        st = self.stats
        line = (
            f"build pool on core(s) {','.join(map(str, self.cpus))}: {st['stored']} region(s) "
            f"built ahead, {st['taken back'] + st['left to the measurer']} left to the measurer, "
            f"{st['failed']} failed; the measurer waited {st['waited']} time(s), "
            f"{st['wait_ms'] / 1e3:.1f} s in all"
        )
        return line + (f" (last failure: {self.errors[-1]})" if self.errors else "")

    @property
    def peak_rss_bytes(self) -> int:
        """The highest resident size any build worker reached (0: none reported)."""
        return max((r.peak_rss_bytes for r in self._runners), default=0)

    @property
    def recycled(self) -> int:
        """Build workers replaced for their size or their number of builds."""
        return sum(r.recycled for r in self._runners)

    def started(self, timeout_s: float) -> bool:
        """Until every worker has started (imported its libraries); False if ``timeout_s`` ran
        out."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self.enabled and self._starting:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def join(self, timeout_s: float) -> bool:
        """Until everything queued has been built or has failed; False if ``timeout_s`` ran out."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self.enabled and (self._queue or _BUILDING in self._state.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 1.0))
        return True

    def close(self) -> None:
        """Stop the workers now (a build in progress is killed); the cache stays."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._queue.clear()
            self._pending.clear()
            self._cond.notify_all()
        for runner in self._runners:
            pid = runner.pid
            if pid is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
        for t in self._threads:
            t.join(timeout=30)

    def __enter__(self) -> BuildPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _serve(self, runner: LocalRunner) -> None:
        """One worker: take the next queued request, build it, record how it went."""
        with contextlib.suppress(OSError):  # this thread's pickling stays off the measurer's core
            os.sched_setaffinity(0, self.cpus)
        failed_starts = 0
        try:
            with contextlib.suppress(Exception):  # imports paid now, not with the first build
                runner.start()
            with self._cond:
                self._starting -= 1
                self._cond.notify_all()
            while True:
                with self._cond:
                    idle_until = time.monotonic() + IDLE_S
                    while (
                        not self._closed
                        and not self._queue
                        and (left := idle_until - time.monotonic()) > 0
                    ):
                        self._cond.wait(left)
                    if self._closed:
                        return
                    key = self._queue.popleft() if self._queue else None
                    if key is not None:
                        request = self._pending.pop(key)
                        self._state[key] = _BUILDING
                if (
                    key is None
                ):  # nothing to build for a while: the worker goes, a request starts a new one
                    runner.close()
                    continue
                try:
                    reply: Reply = runner.exchange(request, self.timeout_s)
                except Exception as e:  # noqa: BLE001 - never leave a request building forever
                    reply = ErrorReply(f"{type(e).__name__}: {e}")
                with self._cond:
                    ok = isinstance(reply, BuildReply)
                    self._state[key] = _DONE if ok else _FAILED
                    if isinstance(reply, BuildReply):
                        self.stats[
                            "stored"
                            if reply.build.cache.startswith("stored")
                            else "built, not stored"
                        ] += 1
                    else:
                        self.stats["failed"] += 1
                        why = (
                            reply.error
                            if isinstance(reply, ErrorReply)
                            else f"a '{reply.kind}' reply"
                        )
                        self.errors = [*self.errors[-9:], why]
                    self._cond.notify_all()
                cannot_start = (
                    isinstance(reply, ErrorReply) and reply.error == "worker could not start"
                )
                failed_starts = failed_starts + 1 if cannot_start else 0
                if failed_starts >= _START_FAILURES:
                    return
        finally:
            runner.close()


def _key(req: RegionRequest) -> str:
    """The build cache's key of a region request (``build_cache.request_key``, on its JSON)."""
    return build_cache.request_key(req.to_json())


def _caches(backend: str) -> bool:
    """Whether ``backend`` keeps built regions (unknown here: let the worker decide)."""
    from partune.backends import registry

    try:
        return bool(registry.get(backend).caches_builds)
    except Exception:  # noqa: BLE001 - e.g. a backend only the workers can import
        return True


class Lookahead(Generic[K]):
    """Region requests for keys measured in a known order, each built ``window`` keys ahead.

    ``request(key)`` makes the requests of the next ``window`` keys (once each) and queues
    them in the pool, waits for ``key``'s own build, and returns its request naming the
    build cache (read once: the measurer removes the entry it loads, so the cache holds
    about ``window`` entries, not one per candidate). Keys skipped (found in a store) are
    simply passed. Without a pool (or with one that is disabled) it only calls ``make``.

    Requests carry their region's weights, so the keys made ahead are also bounded by their
    size (``max_bytes``): near-whole-model regions of a BERT-768 are 100-200 MB of text each,
    and eight of them ahead took the search process from 3 to 5.5 GB.
    """

    def __init__(
        self,
        pool: BuildPool | None,
        order: Sequence[K],
        make: Callable[[K], RegionRequest],
        window: int = 8,
        wait_s: float | None = None,
        max_bytes: int = 256 << 20,
    ) -> None:
        self.pool = pool if pool is not None and pool.enabled else None
        self.make = make
        self.window = window
        self.max_bytes = max_bytes
        self.wait_s = (
            wait_s if wait_s is not None else (pool.timeout_s if pool is not None else 0.0)
        )
        self._order = list(order)
        self._pos = {k: i for i, k in enumerate(self._order)}
        self._made: dict[K, RegionRequest] = {}
        self._ahead = 0  # keys before this index have been made (or passed)

    def request(self, key: K) -> RegionRequest:
        if self.pool is None:
            return self.make(key)
        i = self._pos[key]
        for k in [k for k in self._made if self._pos[k] < i]:
            del self._made[k]  # measured already, or found in the store
        held = sum(_size(r) for r in self._made.values())
        new = []
        for k in self._order[max(self._ahead, i + 1) : min(len(self._order), i + 1 + self.window)]:
            if held >= self.max_bytes:
                break
            self._made[k] = req = self._attach(self.make(k))
            held += _size(req)
            new.append(k)
            self._ahead = self._pos[k] + 1
        self.pool.prefetch([self._made[k] for k in new])
        req = self._made.pop(key, None) or self._attach(self.make(key))
        self.pool.wait(req, self.wait_s)
        return req

    def _attach(self, req: RegionRequest) -> RegionRequest:
        assert self.pool is not None
        return replace(req, build_cache=self.pool.cache_dir, build_cache_once=True)


def _size(req: RegionRequest) -> int:
    """What a request holds in memory, about: its module text and its encoded inputs."""
    return req.module.size + sum(len(a) for a in req.inputs or ())
