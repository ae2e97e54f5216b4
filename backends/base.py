"""The Backend interface: what a backend accepts and how it builds a region.

A backend is real code running a real library or compiler. The search never imports a
backend module; it asks the registry for backends by name and talks to them only
through this interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from tvm import relax

    from partune.backends.settings import Settings
    from partune.core import SEScope


class Level(StrEnum):
    """How much of a model a backend takes at once."""

    LIBRARY = "library"  # op-level kernels (cuDNN-like): one op or small composite
    COMPILER = "compiler"  # graph-level: a whole region becomes one graph
    NATIVE = "native"  # TVM's own lowering: takes everything


class FusionStyle(StrEnum):
    """Which regions a backend can run as one unit (picks its partition rule)."""

    NONE = "none"  # single ops / composites only
    TVM = "tvm"  # TVM-like fusion: injective into anchor, anchor into elementwise
    ARBITRARY = "arbitrary"  # any convex region


class BackendError(RuntimeError):
    """A backend could not translate or build a region."""


RegionKernel = Callable[..., None]
"""A built region: called destination-passing style with TVM tensors, inputs then outputs."""


class Backend(ABC):
    """A library or compiler that can run parts of a Relax model."""

    name: ClassVar[str]
    level: ClassVar[Level]
    fusion_style: ClassVar[FusionStyle]
    device_types: ClassVar[tuple[str, ...]] = ("cpu",)
    # Whether the search offers this backend when the user names none. A backend that
    # only pays off with extra work up front (tuning) is offered only when asked for.
    offered_by_default: ClassVar[bool] = True
    # Whether regions must be tuned (``tune_region``) before a measurement means anything.
    autotuned: ClassVar[bool] = False
    # Whether ``build_region`` keeps what it builds in the build cache
    # (``partune.backends.build_cache``) when one is active, so building it ahead of time
    # (``partune.runners.build_pool``) pays.
    caches_builds: ClassVar[bool] = False
    # Whether the backend computes a region in bfloat16 by a real fast path of its library
    # (a bf16 SEScope); a backend without one is never offered bf16 scopes.
    bf16: ClassVar[bool] = False
    # Whether the backend runs a region's matmuls and convolutions on int8 kernels when they
    # come in QDQ form (``partune.core.int8``); a backend without it is never offered int8.
    int8: ClassVar[bool] = False
    # Where its int8 regions quantize (``partune.core.int8``): whole QDQ units, outputs too
    # (onnxruntime runs a matmul or convolution on int8 kernels only so), or NNCF's placement
    # ("inputs": what the ops read, and attention's operands where they are made; OpenVINO's
    # low-precision transformations fuse a matmul's bias and activation only without a
    # quantization between them).
    int8_placement: ClassVar[str] = "units"
    # Whether each region's kernel keeps a thread count of its own (a session's or compiled
    # model's setting), so that a scope on fewer threads than the job's is real; TVM's and
    # torch's thread pools are one per process, and are never offered such scopes.
    threads_per_region: ClassVar[bool] = False

    @property
    def codegen(self) -> str | None:
        """BYOC codegen name (``relax.ext.<codegen>``); None for TVM's native lowering."""
        return f"partune_{self.name}" if self.level is not Level.NATIVE else None

    @abstractmethod
    def accepts(self, binding: relax.Binding) -> bool:
        """Whether this backend can translate the binding's value. Never claim what fails."""

    @abstractmethod
    def build_region(self, func: relax.Function, scope: SEScope, threads: int) -> RegionKernel:
        """Translate ``func`` (a region lifted out of main) into a callable kernel.

        ``func`` has tensor parameters, one dataflow block, weights as ``tvm.ir.Constant``
        and returns a tensor or a tuple of tensors. The kernel writes into the output
        tensors it is given (destination-passing style).
        """

    def patterns(self) -> Sequence[tuple[str, object]]:
        """Named composite patterns (``tvm.relax.dpl``) this backend runs as one call."""
        return ()

    def set_threads(self, threads: int) -> None:  # noqa: B027 - optional hook
        """Apply the process-wide thread count to this backend's library."""

    def configure(self, settings: Settings) -> None:  # noqa: B027 - optional hook
        """Read the settings this backend uses (``partune.backends.settings``)."""

    def tune_region(
        self, func: relax.Function, scope: SEScope, trials: int, timeout_s: float
    ) -> dict:
        """Tune ``func`` for ``scope`` before it is built (``autotuned`` backends only).

        Returns a JSON-able report. Work already done (a persistent database) is reused,
        so a second call with the same budget does nothing. Raises ``BackendError``.
        """
        raise BackendError(f"{self.name} has nothing to tune")
