"""``CumsumOfBoolAsInt64``: a cumsum of bool counts in int64, as torch does.

torch returns int64 for the cumsum of a bool tensor; the torch import keeps bool, and TVM
then cannot build it (the causal-mask code of GPT-2, Llama and others). Written as a
``PyExprMutator``, not a DPL rewrite: the result's type changes, and ``rewrite_call``
keeps the bound var's old (bool) type where the mutator infers the new one.
"""

from __future__ import annotations

import tvm
from tvm import relax

from partune.frontend.passes.import_pass import ImportPass, on_main


@relax.expr_functor.mutator
class _BoolCumsum(relax.PyExprMutator):
    def __init__(self) -> None:
        super().__init__()
        self.rewrites = 0

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if (
            isinstance(call.op, tvm.ir.Op)
            and call.op.name == "relax.cumsum"
            and call.args[0].ty.dtype == "bool"
        ):
            self.rewrites += 1
            x = relax.op.astype(call.args[0], "int64")
            return relax.op.cumsum(
                x, axis=call.attrs.axis, dtype="int64", exclusive=call.attrs.exclusive
            )
        return call


CUMSUM_OF_BOOL = ImportPass(
    "CumsumOfBoolAsInt64",
    "cumsum of bool counts in int64 (as torch; TVM cannot build the bool one)",
    on_main(_BoolCumsum),
)
