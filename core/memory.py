"""Handing a process's freed heap back to the system.

Imports and builds leave large freed blocks in glibc's heap (protobufs, onnxslim's rounds,
compiler memory); the resident size stays high until ``malloc_trim`` returns them. The
front end trims after every import and the runners after every build.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc


def trim() -> None:
    """Collect garbage and hand the heap's free pages back to the system (glibc)."""
    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
