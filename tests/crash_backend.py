"""A test-only backend whose kernels crash their process (segfault) or hang.

It takes element-wise ops so the search proposes it candidates; measuring any of them
kills or stalls the worker. The search must cost them +inf and carry on.
"""

from __future__ import annotations

import ctypes
import time

from tvm import relax

from partune.backends.base import Backend, FusionStyle, Level


def _calls(binding, ops: tuple[str, ...]) -> bool:
    v = binding.value
    return isinstance(v, relax.Call) and getattr(v.op, "name", "") in ops


class SegfaultBackend(Backend):
    """Takes one op of ``tests.graphs.Chain`` (its sqrt): each crash restarts the measuring
    worker, seconds a time, and one crashing candidate is what the tests need."""

    name = "segfault"
    level = Level.LIBRARY
    fusion_style = FusionStyle.NONE

    def accepts(self, binding) -> bool:
        return _calls(binding, ("relax.sqrt",))

    def build_region(self, func, scope, threads):
        def kernel(*args):
            ctypes.string_at(0)  # read address 0: SIGSEGV

        return kernel


class HangBackend(SegfaultBackend):
    name = "hang"

    def accepts(self, binding) -> bool:
        return _calls(binding, ("relax.nn.relu", "relax.exp"))

    def build_region(self, func, scope, threads):
        def kernel(*args):
            time.sleep(3600)

        return kernel


class SlowBackend(SegfaultBackend):
    """Builds slowly, noting which process group builds (``SLOW_LOG``): a test can kill the
    device in the middle of a measurement. Its kernels compute relu correctly."""

    name = "slow"

    def accepts(self, binding) -> bool:
        return _calls(binding, ("relax.nn.relu",))

    def build_region(self, func, scope, threads):
        import os

        import numpy as np

        with open(os.environ.get("SLOW_LOG", "/dev/null"), "a") as f:
            f.write(f"{os.getpgid(0)}\n")
        time.sleep(float(os.environ.get("SLOW_BUILD_S", "3")))

        def kernel(x, out):
            out.copyfrom(np.maximum(x.numpy(), 0))

        return kernel
