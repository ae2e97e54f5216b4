"""Built regions kept on disk: a region is built once (ahead of time, by
``partune.runners.build_pool``) and where it is timed it is only loaded.

An entry is a directory ``<cache>/<key>/`` holding a backend's artefact files (a TVM shared
library, an optimised ONNX model, an OpenVINO blob, plus what the kernel needs to bind its
buffers) and ``manifest.json`` (each file's SHA-256). A writer fills a private
temporary directory and renames it into place, so a reader sees a whole entry or none; a
reader checks the manifest before it hands any file to a library (a truncated shared
library could crash the process in ``dlopen``), so a damaged entry is a miss: the region
is built as usual, and a candidate never fails because of the cache.

The key (``request_key``, then ``entry_for``, then ``Entry.refine`` by the backend):
the region's module JSON (weights included), its function name, SEScope and backend; the
thread count, the CPU model and TVM's version; and what the backend adds (its library's
version; for TVM the tuning database's state). The cache is meant for one machine: ORT's
optimised models and OpenVINO's blobs are specific to the CPU they were made on.

A backend finds the entry of the build in progress with ``current()`` (set by the worker
with ``active``); outside a cached build it is None and nothing here is touched.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import json
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from partune.backends.checksum import checksums, first_damaged
from partune.core import cpu_name

FORMAT = 2  # bump when what an entry holds changes
MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"

T = TypeVar("T")


def _digest(*parts: object, data: str | bytes = b"") -> str:
    h = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode())
    h.update(b"\0")
    h.update(data.encode() if isinstance(data, str) else data)
    return h.hexdigest()[:32]


def request_key(req: dict) -> str:
    """The key of a region request's build: module JSON, function, SEScope and backend; for a
    region of a whole model's file (``partune.runners.module_file``), the file as it is now
    and the region's nodes instead of the JSON."""
    module = req["module"]  # ``partune.runners.protocol.ModelRef``'s JSON
    file = module.get("file")
    stamp = None
    if file:
        st = os.stat(file)
        stamp = (file, st.st_mtime_ns, st.st_size, module.get("nodes"))
    return _digest(
        FORMAT,
        req["backend"],
        req["function"],
        req["scope"],
        *([stamp] if stamp else []),
        data=module.get("text", ""),
    )


@functools.cache
def machine() -> str:
    """What a built artefact depends on beyond the request: the CPU and TVM's version."""
    import tvm

    return f"{cpu_name()}|python {platform.python_version()}|tvm {tvm.__version__}"


def entry_for(req: dict, write: bool) -> Entry | None:
    """The cache entry of a region request that carries ``build_cache``; None when it does not.

    With ``build_cache_once`` in the request, a reader removes the entry once it has loaded
    it (a search measures each region once: the cache stays as small as the lookahead).
    """
    root = req.get("build_cache")
    if not root:
        return None
    return Entry(
        root,
        _digest(request_key(req), req.get("threads", 1), machine()),
        write,
        consume=bool(req.get("build_cache_once")) and not write,
    )


@dataclass
class Entry:
    """One region's artefact in the cache; records whether it was loaded or stored."""

    root: str
    key: str
    write: bool = False  # store what is built (build workers); readers only load
    consume: bool = False  # remove the entry once loaded (a reader that is its only user)
    hit: bool = False  # the artefact was loaded from the cache
    stored: bool = False  # the artefact was built and stored
    error: str | None = None  # why an entry present could not be used, or not be stored

    @property
    def path(self) -> str:
        return os.path.join(self.root, self.key)

    def refine(self, *parts: object) -> Entry:
        """Narrow the key by what the backend's artefact also depends on (versions, databases)."""
        self.key = _digest(self.key, *parts)
        return self

    def load(self, loader: Callable[[str], T]) -> T | None:
        """``loader(entry directory)`` when a whole entry is there; None when absent or unusable."""
        path = self.path
        if not os.path.isdir(path):
            return None
        try:
            _verify(path)
            value = loader(path)
        except Exception as e:  # noqa: BLE001 - any damage means: build it as usual
            self.error = f"unusable cache entry: {type(e).__name__}: {_last_line(e)}"
            if self.write:  # a builder replaces it; readers leave it alone
                _discard(path)
            return None
        self.hit = True
        if self.consume:  # what was loaded is in memory now (a loaded library stays mapped)
            _discard(path)
        return value

    def store(self, writer: Callable[[str], None]) -> bool:
        """Publish what ``writer(directory)`` writes as this entry (build workers only).

        Never raises: a failure to store only means the region is built again next time.
        """
        if not self.write:
            return False
        try:
            os.makedirs(self.root, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=TMP_PREFIX, dir=self.root)
        except OSError as e:
            self.error = f"cannot store: {e}"
            return False
        try:
            writer(tmp)
            _write_manifest(tmp)
            _publish(tmp, self.path)
            self.stored = True
        except Exception as e:  # noqa: BLE001 - the build itself succeeded
            self.error = f"cannot store: {type(e).__name__}: {_last_line(e)}"
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return self.stored

    def scratch(self, suffix: str) -> str | None:
        """A private file name in the cache for a library that writes while building (ORT);
        None when this entry is not being written. The caller removes it."""
        if not self.write:
            return None
        try:
            os.makedirs(self.root, exist_ok=True)
            fd, path = tempfile.mkstemp(prefix=TMP_PREFIX, suffix=suffix, dir=self.root)
        except OSError:
            return None
        os.close(fd)
        os.unlink(path)  # the library creates it
        return path

    def describe(self) -> str:
        """For replies: hit, stored, miss (built, not stored) and why, when something went wrong."""
        what = "hit" if self.hit else "stored" if self.stored else "miss"
        return what + (f" ({self.error})" if self.error else "")


def _last_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[-1][:200]


def _write_manifest(directory: str) -> None:
    names = sorted(
        n
        for n in os.listdir(directory)
        if n != MANIFEST and os.path.isfile(os.path.join(directory, n))
    )
    with open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump({"format": FORMAT, "files": checksums(directory, names)}, f)


def _verify(directory: str) -> None:
    """Raise unless every file the manifest lists is there, whole and unchanged."""
    with open(os.path.join(directory, MANIFEST)) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT or not manifest.get("files"):
        raise ValueError("manifest of another format")
    damaged = first_damaged(directory, manifest["files"])
    if damaged:
        raise ValueError(damaged)


def _publish(tmp: str, path: str) -> None:
    """Rename the filled directory into place; a racing writer's entry, already there, wins."""
    try:
        os.rename(tmp, path)
    except OSError:
        if not os.path.isdir(path):
            raise
        # Someone published first (or a damaged entry is there, being replaced).
        try:
            _verify(path)
        except Exception:  # noqa: BLE001
            _discard(path)
            os.rename(tmp, path)


def _discard(path: str) -> None:
    """Remove an entry: first renamed away (readers then see none), then deleted."""
    gone = f"{path}{TMP_PREFIX}{os.getpid()}-{time.monotonic_ns()}"
    try:
        os.rename(path, gone)
    except OSError:
        return
    shutil.rmtree(gone, ignore_errors=True)


def remove_stale(root: str, older_than_s: float = 3600.0) -> None:
    """Delete temporary files and directories left by writers that were killed mid-write."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    now = time.time()
    for name in names:
        full = os.path.join(root, name)
        if TMP_PREFIX not in name:
            continue
        with contextlib.suppress(OSError):
            if now - os.path.getmtime(full) > older_than_s:
                if os.path.isdir(full):
                    shutil.rmtree(full, ignore_errors=True)
                else:
                    os.unlink(full)


_active: contextvars.ContextVar[Entry | None] = contextvars.ContextVar(
    "partune_build_cache", default=None
)


def current() -> Entry | None:
    """The cache entry of the region being built now (None: build without the cache)."""
    return _active.get()


@contextlib.contextmanager
def active(entry: Entry | None) -> Iterator[Entry | None]:
    """Make ``entry`` the one ``current()`` returns while the block runs."""
    token = _active.set(entry)
    try:
        yield entry
    finally:
        _active.reset(token)
