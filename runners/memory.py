"""The memory a plan needs where it is deployed, read from the kernel (Linux).

What a deployed plan costs in memory is what it keeps resident once built (weights each
backend copies, compiled code, sessions) plus what its runs add on top (activations,
workspaces); compiler memory freed after the build is not part of it. So: trim the heap
and read the resident size before the build; after the build, trim again (the compilers'
freed memory goes back to the system) and reset the kernel's high-water mark (writing
5 to ``/proc/self/clear_refs`` resets ``VmHWM``); after the timed runs, the footprint is
the high-water mark minus the size before. Memory freed by earlier requests and reused
hides growth, so compare plans measured in fresh processes (``plan_request(fresh=True)``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import re


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def trim() -> None:
    """Collect garbage and hand the heap's free pages back to the system (glibc)."""
    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def resident_bytes() -> int | None:
    """The process's resident size now (None where /proc is not Linux's)."""
    return _status_bytes("VmRSS")


def reset_peak() -> bool:
    """Start a new high-water mark of resident memory at the current size."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_bytes() -> int | None:
    """The high-water mark of resident memory since the last ``reset_peak``."""
    return _status_bytes("VmHWM")
