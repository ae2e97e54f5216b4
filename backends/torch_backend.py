"""The torch backend: runs Relax regions on PyTorch's ATen kernels (oneDNN/MKL, cuDNN/cuBLAS).

Why a library backend is worth having: ATen's convolutions and GEMMs are tuned, while
untuned TVM lowers them 100x-250x slower. A region is translated once, at build time,
into a flat list of closures over ATen calls; the per-call cost is a loop over that
list. Peepholes inside a region make one kernel out of several ops:

- conv2d absorbs a zero pad before it, and after it constant per-channel adds and
  multiplies and inference batch norms (all folded into its weight and bias), residual
  adds, reshapes and activations (applied in place);
- matmul with a constant weight (also ``permute_dims(W)``) becomes F.linear (addmm) and
  absorbs the same but batch norm, per output feature;
- the exported ``_safe_softmax`` (nine bindings) becomes softmax plus a masked fill.

Sub-expressions of constants only (masks, position ids, transposed weights) are
evaluated once at build time. Scaled-dot-product attention is left decomposed: single-threaded
on CPU, ATen's fused kernel beat matmul-softmax-matmul by only ~1.15x at BERT-4x256 sizes.

The translator is the single source of truth: ``accepts`` says yes exactly when the
translator can build the binding, and ``build_region`` checks every step's shape and
dtype against the Relax types on the meta device before handing the kernel out.

The pieces live in their own modules: the op translators in ``torch_ops`` (with the
families it gathers), the peephole fuser in ``torch_fuser``, the program and the region
kernel in ``torch_program``, and the composite patterns in ``torch_patterns``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from tvm import relax
from tvm.relax import dpl

from partune.backends.base import Backend, BackendError, FusionStyle, Level, RegionKernel
from partune.backends.torch_op_registry import Unsupported
from partune.backends.torch_ops import check_binding
from partune.backends.torch_patterns import PATTERNS
from partune.backends.torch_program import compile_region

if TYPE_CHECKING:
    from partune.core import SEScope


# --------------------------------------------------------------------------- the backend


def torch_device(scope: SEScope) -> torch.device:
    kind = scope.device_type or "cpu"
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda":
        return torch.device("cuda", scope.virtual_device_id or 0)
    raise BackendError(f"torch backend does not run on {kind}")


class TorchBackend(Backend):
    """PyTorch eager (ATen) kernels, one region at a time, with peephole composites."""

    name = "torch"
    level = Level.LIBRARY
    fusion_style = FusionStyle.NONE
    device_types = ("cpu", "cuda")
    bf16 = True  # CPU autocast: oneDNN's bf16 matmuls and convolutions

    def accepts(self, binding: relax.Binding) -> bool:
        try:
            check_binding(binding)
        except Unsupported:
            return False
        return True

    def why_not(self, binding: relax.Binding) -> str | None:
        """The reason ``accepts`` refuses ``binding`` (None when it accepts)."""
        try:
            check_binding(binding)
        except Unsupported as err:
            return str(err)
        return None

    def patterns(self) -> list[tuple[str, dpl.DFPattern]]:
        return PATTERNS

    def build_region(self, func: relax.Function, scope: SEScope, threads: int) -> RegionKernel:
        self.set_threads(threads)
        try:
            return compile_region(func, torch_device(scope), scope.compute_precision)
        except BackendError:
            raise
        except Exception as err:  # e.g. constant folding hit an ATen error
            raise BackendError(f"torch backend could not build the region: {err}") from err

    def set_threads(self, threads: int) -> None:
        if threads > 0 and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
