"""``DropSoftmaxGuards``: the guards of a softmax against rows of ``-inf`` that can never fire.

The torch import of ``scaled_dot_product_attention`` guards each softmax against rows that
are all ``-inf`` (seven small ops per attention, 9 us of bert-small's 55 under OpenVINO);
torch.onnx.export drops the guard. Where ``frontend.finite_bounds`` proves that ``x`` never
holds an infinity, the guard is the identity and dropping it is exact. A mutator, not a DPL
rewrite: whether a guard can fire is a proof over the whole function, not a pattern.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from partune.frontend.finite_bounds import (
    FLT_MAX,
    INF,
    known_dims,
    magnitude_bounds,
    never_infinite,
    op_name,
)
from partune.frontend.passes.import_pass import ImportPass, bindings, with_main


def _is_neg_inf(expr: relax.Expr) -> bool:
    if not isinstance(expr, tvm.ir.GenericConst):
        return False
    value = expr.value.numpy()
    return value.size == 1 and bool(np.isneginf(value).all())


@relax.expr_functor.mutator
class _SoftmaxGuards(relax.PyExprMutator):
    """``where(not(any(x != -inf, axis=-1)), 0, softmax(x))`` is ``softmax(x)`` where every
    row of ``x`` provably holds an element that is not ``-inf``: ``x`` bounded, or ``x = s +
    M`` with ``s`` bounded and ``M`` a constant (an additive mask) with a finite element in
    every row (a causal mask's diagonal), whose sum with ``s`` cannot overflow.

    The import spells the test ``not(astype(max(astype(not(x == -inf), int8), -1), bool))``.
    """

    def __init__(self, bounds: dict[relax.Var, float]) -> None:
        super().__init__()
        self.bounds = bounds
        self.rewrites = 0

    def _chain(self, expr: relax.Expr, *names: str) -> relax.Expr | None:
        """Follow ``expr`` back through calls of ``names`` (first arguments); the last one's
        first argument, or None where the chain differs."""
        for name in names:
            value = self.lookup_binding(expr) if isinstance(expr, relax.Var) else None
            if op_name(value) != name:
                return None
            if name == "relax.max" and ([int(a) for a in value.attrs.axis or []] != [-1]):
                return None
            if name == "relax.equal" and not _is_neg_inf(value.args[1]):
                return None
            expr = value.args[0]
        return expr

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if op_name(call) != "relax.where":
            return call
        guard, _, result = call.args
        x = self._chain(
            guard,
            "relax.logical_not",
            "relax.astype",
            "relax.max",
            "relax.astype",
            "relax.logical_not",
            "relax.equal",
        )
        source = self._chain(result, "relax.nn.softmax")
        if (
            x is None
            or source is None
            or not source.same_as(x)
            or known_dims(result) != known_dims(call)
        ):
            return call
        if not self._rows_hold_no_neg_inf(x):
            return call
        self.rewrites += 1
        return result

    def _rows_hold_no_neg_inf(self, x: relax.Expr) -> bool:
        if never_infinite(self.bounds.get(x, INF)):
            return True
        value = self.lookup_binding(x) if isinstance(x, relax.Var) else None
        dims = known_dims(x)
        if op_name(value) != "relax.add" or dims is None:
            return False
        for s, mask in (value.args, value.args[::-1]):
            if isinstance(mask, tvm.ir.GenericConst) and never_infinite(self.bounds.get(s, INF)):
                m = np.abs(np.broadcast_to(mask.value.numpy().astype(np.float64), dims))
                fine = np.isfinite(m) & (m + self.bounds[s] < FLT_MAX)
                return bool(fine.any(axis=-1).all())
        return False


def drop_softmax_guards(mod: tvm.IRModule) -> tuple[tvm.IRModule, int]:
    """``mod`` without the softmax guards that can never fire (``_SoftmaxGuards``), and how
    many; the bounds (a pass over every weight) are only computed where there is a guard."""
    if not any(op_name(v) == "relax.equal" and _is_neg_inf(v.args[1]) for v in bindings(mod)):
        return mod, 0
    mutator = _SoftmaxGuards(magnitude_bounds(mod["main"]))
    mod = with_main(mod, mutator.visit_expr(mod["main"]))
    return relax.transform.DeadCodeElimination(["main"])(mod), mutator.rewrites


DROP_SOFTMAX_GUARDS = ImportPass(
    "DropSoftmaxGuards",
    "the torch import's guard of a softmax against "
    "all -inf rows, dropped where bounds prove no row can be (the "
    "ONNX export has none)",
    drop_softmax_guards,
)
