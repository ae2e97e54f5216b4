"""The CPU's instruction-set flags, on their own: the int8 scheme depends on them
(``partune.core.int8``) and store keys name that scheme, so this module imports nothing of
Partune's (``partune.core.versions``, which does, re-exports it).
"""

from __future__ import annotations


def cpu_flags() -> frozenset[str]:
    """The instruction-set flags this CPU reports (``/proc/cpuinfo``; none where unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "flags:")
    except OSError:
        return frozenset()
    return frozenset(line.split(":", 1)[1].split())
