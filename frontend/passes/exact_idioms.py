"""Three import idioms spelt so that every backend can take them, each rewrite exact.

The ONNX import leaves int64 and float-to-bool steps that OpenVINO's CPU plugin cannot
compute exactly, so it refuses them and the model splits around them (a border each, about
17 us measured, at every layer that reads the attention mask):

* ``CastBeforeMoves``: ``astype(moves(x))`` with ``x`` int64 (an attention mask expanded,
  then cast to float) casts first, ``moves(astype(x))``; a cast commutes with expand,
  broadcast, reshape, permute and squeeze, and the int64 moves are gone. A mutator: the
  chain of moves has any length, which a fixed pattern cannot say.
* ``FloatToBoolAsCompare``: ``astype(x, "bool")`` of a float is ``not (x == 0)``, the same
  for every value (NaN == 0 is false everywhere, so NaN is true, as bool(NaN) is; -0.0 == 0,
  so -0.0 is false). Not ``x != 0``: TVM compiles that as an ordered compare, false for NaN.
* ``TakeWrapForNegativeIndex``: ``take(T, where(i < 0, i + n, i), axis)`` with ``n`` the
  axis' length (how the import spells ONNX Gather's negative indices) is
  ``take(T, i, axis, mode="wrap")``, the same for every index the original defines.

All three read constants, so they run after constant folding.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.dpl import is_const, is_op, wildcard

from partune.frontend.passes.import_pass import ImportPass, by_pattern, on_main

_MOVES = frozenset(
    {
        "relax.expand_dims",
        "relax.broadcast_to",
        "relax.reshape",
        "relax.permute_dims",
        "relax.squeeze",
    }
)


def _op_name(expr: relax.Expr) -> str | None:
    return expr.op.name if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) else None


def _dtype(expr: relax.Expr) -> str:
    return str(expr.ty.dtype) if isinstance(expr.ty, relax.TensorType) else ""


@relax.expr_functor.mutator
class _CastFirst(relax.PyExprMutator):
    def __init__(self) -> None:
        super().__init__()
        self.rewrites = 0

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if _op_name(call) != "relax.astype":
            return call
        chain, x = [], call.args[0]
        while _op_name(bound := self._bound(x)) in _MOVES:
            chain.append(bound)
            x = bound.args[0]
        if not chain or _dtype(x) != "int64":
            return call
        self.rewrites += 1
        out = self.builder_.emit(relax.op.astype(x, str(call.attrs.dtype)))
        for move in reversed(chain):
            out = self.builder_.emit(relax.Call(move.op, [out, *move.args[1:]], move.attrs))
        return out

    def _bound(self, expr: relax.Expr) -> relax.Expr:
        value = self.lookup_binding(expr) if isinstance(expr, relax.Var) else None
        return expr if value is None else value


_X = wildcard()


def _compare(call: relax.Call, matched: dict) -> relax.Expr | None:
    src = matched[_X]
    if str(call.attrs.dtype) != "bool" or not _dtype(src).startswith("float"):
        return None
    return relax.op.logical_not(relax.op.equal(src, relax.const(0.0, _dtype(src))))


_I, _LOW, _N = wildcard(), is_const(), is_const()
_NEGATIVE_WRAP = is_op("relax.take")(
    wildcard(), is_op("relax.where")(is_op("relax.less")(_I, _LOW), is_op("relax.add")(_I, _N), _I)
)


def _scalar(expr: relax.Expr) -> float | None:
    """The value of a scalar constant, else None."""
    if isinstance(expr, tvm.ir.GenericConst) and (value := expr.value.numpy()).size == 1:
        return float(value.reshape(()))
    return None


def _wrap(call: relax.Call, matched: dict) -> relax.Expr | None:
    table = call.args[0]
    if str(call.attrs.mode) != "fast" or call.attrs.axis is None:
        return None
    try:
        n = int(table.ty.shape.values[int(call.attrs.axis)])
    except (TypeError, AttributeError, IndexError):
        return None
    if _scalar(matched[_LOW]) != 0 or _scalar(matched[_N]) != n:
        return None
    return relax.op.take(table, matched[_I], axis=int(call.attrs.axis), mode="wrap")


CAST_BEFORE_MOVES = ImportPass(
    "CastBeforeMoves",
    "an int64 tensor moved then cast: cast first (OpenVINO refuses the int64 moves)",
    on_main(_CastFirst),
)
FLOAT_TO_BOOL = ImportPass(
    "FloatToBoolAsCompare",
    "a float cast to bool as not(x == 0), exact for NaN and -0.0 (OpenVINO refuses the cast)",
    by_pattern(is_op("relax.astype")(_X), _compare),
)
TAKE_WRAP = ImportPass(
    "TakeWrapForNegativeIndex",
    "take(T, where(i < 0, i + n, i)) as take(T, i, mode=wrap) (ONNX Gather's negative indices)",
    by_pattern(_NEGATIVE_WRAP, _wrap),
)
