"""A test-only backend whose kernels crash their process (segfault) or hang.

It takes element-wise ops so the search proposes it candidates; measuring any of them
kills or stalls the worker. The search must cost them +inf and carry on.
"""

from __future__ import annotations

import ctypes
import time

from tvm import relax

from partune.backends.base import Backend, FusionStyle, Level


class SegfaultBackend(Backend):
    name = "segfault"
    level = Level.LIBRARY
    fusion_style = FusionStyle.NONE

    def accepts(self, binding) -> bool:
        v = binding.value
        return isinstance(v, relax.Call) and getattr(v.op, "name", "") in ("relax.nn.relu", "relax.exp")

    def build_region(self, func, scope, threads):
        def kernel(*args):
            ctypes.string_at(0)  # read address 0: SIGSEGV

        return kernel


class HangBackend(SegfaultBackend):
    name = "hang"

    def build_region(self, func, scope, threads):
        def kernel(*args):
            time.sleep(3600)

        return kernel
