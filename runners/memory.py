"""The memory a plan needs where it is deployed, read from the kernel (Linux).

What a deployed plan costs in memory is what it keeps resident once built (weights each
backend copies, compiled code, sessions) plus what its runs add on top (activations,
workspaces); compiler memory freed after the build is not part of it. So: trim the heap
and read the resident size before the build; after the build, trim again (the compilers'
freed memory goes back to the system) and reset the kernel's high-water mark (writing
5 to ``/proc/self/clear_refs`` resets ``VmHWM``); after the timed runs, the footprint is
the high-water mark minus the size before. Memory freed by earlier requests and reused
hides growth, so compare plans measured in fresh processes (``plan_request(fresh=True)``).

A process's own peak over its whole life (``lifetime_peak_bytes``) survives those resets:
``reset_peak`` keeps the mark it clears. Measuring workers report it with every reply, and a
``LocalRunner`` replaces one that has grown past ``default_rss_limit()`` (or served
``MAX_REQUESTS``).
"""

from __future__ import annotations

import os
import re

from partune.core import trim  # noqa: F401 - workers call memory.trim

GiB = 1 << 30
MAX_RSS_BYTES = 3 * GiB  # a worker resident above this after a request is replaced
MAX_REQUESTS = (
    2000  # ... and after this many, whatever its size: what size misses (threads, file handles)
)

_cleared = {"peak": 0}  # the highest high-water mark ``reset_peak`` has cleared in this process


def _status_bytes(field: str, path: str = "/proc/self/status") -> int | None:
    try:
        with open(path) as f:
            m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def available_bytes() -> int | None:
    """Memory this machine can hand out now without swapping (None where /proc does not say)."""
    return _status_bytes("MemAvailable", "/proc/meminfo")


def resident_bytes() -> int | None:
    """The process's resident size now (None where /proc is not Linux's)."""
    return _status_bytes("VmRSS")


def reset_peak() -> bool:
    """Start a new high-water mark of resident memory at the current size (the one cleared
    still counts in ``lifetime_peak_bytes``)."""
    _cleared["peak"] = max(_cleared["peak"], peak_bytes() or 0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_bytes() -> int | None:
    """The high-water mark of resident memory since the last ``reset_peak``."""
    return _status_bytes("VmHWM")


def lifetime_peak_bytes() -> int | None:
    """The process's highest resident size since it started, ``reset_peak`` or not."""
    now = peak_bytes()
    return max(now, _cleared["peak"]) if now is not None else None


def machine_bytes() -> int | None:
    """The machine's physical memory (None where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def default_rss_limit() -> int:
    """When a worker is replaced for its size: ``MAX_RSS_BYTES``, or a quarter of the machine
    where that is less. A worker keeps what the libraries cache and leak (compiled code,
    arenas, sessions) and grows with every candidate; the search process, a measuring worker
    and a build worker must fit beside each other and beside what the user runs."""
    total = machine_bytes()
    return min(MAX_RSS_BYTES, total // 4) if total else MAX_RSS_BYTES
