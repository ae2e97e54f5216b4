"""``RelativeShears``: relative-position gathers as shears, ``gather_elements`` with a constant
diagonal index.

DeBERTa's disentangled attention scores every query against every relative position, then
picks, per (query i, key j), the score of position ``c + (j - i)`` (c2p) or ``c + (i - j)``
(p2c): ``gather_elements(scores, idx, axis=-1)`` with a constant ``idx``. An element gather
is the slowest way to do that: OpenVINO spent 15% of deberta's time in its four
``GatherElements`` (0.82 ms of 5.4 ms at one thread), more than in its score matmuls.

Row i reads a contiguous window of the scores that starts one column earlier for each
next row: a shear. Over the row-major flattening of ``A'[..., n, W]`` (the W = n + m - 1
columns the index reaches, in the order it reaches them) element (i, j) lies at
``(n - 1) + i * (W - 1) + j``, so the gather is a reshape, one slice, a reshape and one
more slice: contiguous copies that every backend has. Where the scores are a matmul by a
constant (the relative-position keys, folded at import), the column selection moves into
that constant, and the matmul computes only the W columns the index reads (255 of 512 in
deberta at sequence 128). Exact: the same elements, picked another way, and each score is
still the same dot product.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from partune.core import known_shape
from partune.frontend.passes.import_pass import ImportPass, on_main


def diagonal(idx: np.ndarray) -> tuple[int, int] | None:
    """``(c, s)`` when ``idx[..., i, j] == c + s * (j - i)`` everywhere, with ``s`` = +1 or -1
    and the same plane for every leading index; None otherwise."""
    if idx.ndim < 2 or idx.shape[-2] < 2 or idx.shape[-1] < 1:
        return None
    planes = idx.reshape(-1, *idx.shape[-2:])
    plane = planes[0]
    if not (planes == plane).all():
        return None
    i, j = np.indices(plane.shape)
    c = int(plane[0, 0])
    for s in (1, -1):
        if (plane == c + s * (j - i)).all():
            return c, s
    return None


def _columns(c: int, s: int, n: int, m: int) -> np.ndarray:
    """The columns ``A'`` keeps, so that ``A'[i, (n - 1) - i + j] == A[i, c + s * (j - i)]``."""
    return c + s * (np.arange(n + m - 1) - (n - 1))


def _shear(
    bb: relax.BlockBuilder, a: relax.Expr, lead: list[int], n: int, width: int, m: int
) -> relax.Expr:
    """``out[..., i, j] = a[..., i, (n - 1) - i + j]`` for ``a`` of shape ``lead + [n, width]``."""
    axis = len(lead)
    flat = bb.emit(relax.op.reshape(a, [*lead, n * width]))
    window = bb.emit(relax.op.strided_slice(flat, [axis], [n - 1], [n - 1 + n * (width - 1)]))
    rows = bb.emit(relax.op.reshape(window, [*lead, n, width - 1]))
    return relax.op.strided_slice(rows, [axis + 1], [0], [m])


@relax.expr_functor.mutator
class _Shears(relax.PyExprMutator):
    """Every diagonal constant-index ``gather_elements`` made a shear (see the module docstring).
    A mutator: whether the index is a diagonal is a test of its values, and the column
    selection reaches into the binding of the gathered scores."""

    def __init__(self) -> None:
        super().__init__()
        self.rewrites = 0

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.gather_elements"):
            return call
        data, idx = call.args
        shape, idx_shape = known_shape(data.ty), known_shape(idx.ty)
        if not isinstance(idx, tvm.ir.GenericConst) or shape is None or idx_shape is None:
            return call
        if int(call.attrs.axis) not in (-1, len(shape) - 1) or list(shape[:-1]) != list(
            idx_shape[:-1]
        ):
            return call
        found = diagonal(idx.value.numpy())
        if found is None:
            return call
        *lead, n, k = (int(d) for d in shape)
        m = int(idx_shape[-1])
        cols = _columns(*found, n, m)
        if cols.min() < 0 or cols.max() >= k:
            return call
        kept = self._kept_columns(data, cols)
        if kept is None:
            return call
        self.rewrites += 1
        return _shear(self.builder_, self.builder_.emit(kept), lead, n, len(cols), m)

    def _kept_columns(self, data: relax.Expr, cols: np.ndarray) -> relax.Expr | None:
        """``data[..., cols]``: in a constant right-hand side of the matmul that made it, else a
        slice (ascending columns), else None (descending: no backend has negative strides)."""
        made = self.lookup_binding(data) if isinstance(data, relax.Var) else None
        if (
            isinstance(made, relax.Call)
            and isinstance(made.op, tvm.ir.Op)
            and made.op.name == "relax.matmul"
            and isinstance(rhs := made.args[1], tvm.ir.GenericConst)
            and rhs.value.numpy().ndim >= 2
        ):
            kept = np.ascontiguousarray(np.take(rhs.value.numpy(), cols, axis=-1))
            return relax.op.matmul(made.args[0], relax.const(kept), out_dtype=made.attrs.out_dtype)
        if cols[-1] > cols[0]:
            return relax.op.strided_slice(
                data, [len(known_shape(data.ty)) - 1], [int(cols[0])], [int(cols[-1]) + 1]
            )
        return None


RELATIVE_SHEARS = ImportPass(
    "RelativeShears",
    "a diagonal constant-index gather_elements "
    "(DeBERTa's relative positions) as reshapes and slices",
    on_main(_Shears),
)
