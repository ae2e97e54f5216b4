"""``FoldInputFree``: the work that depends on no model input, folded once, at import.

The torch import builds attention masks and position ids from ``R.arange`` on every call
(GPT-2: 34 int64 and bool bindings before the first layer). Relax's ``FoldConstant`` leaves
them: an ``arange`` has no constant *tensor* argument, so nothing downstream folds either.
The peers fold such work when they load the file (onnxruntime and OpenVINO both run
constant folding), but a Partune plan ran it per call, and worse, OpenVINO refuses the
int64 steps (its CPU plugin narrows them to 32 bits), so an "openvino-only" plan split
around them into four regions with TVM between: 0.108 ms on gpt2-small, against 0.065 ms
for OpenVINO on one graph.

So the input-free bindings are compiled with TVM once (plain ``tvm.compile`` on the host),
run, and the values that input-dependent work reads are put in as constants. Exact by
construction: the very ops are evaluated by TVM, and a value too large to keep as a
constant (a broadcast of a weight, say) is left to compute at run time.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from partune.core import known_shape
from partune.frontend.passes.import_pass import ImportPass, with_main

MAX_ELEMENTS = 1 << 20  # a folded value larger than this stays computed (4 MiB of f32)

# Ops with effects or with no meaning outside a VM: never evaluated ahead of time.
_EFFECTS = (
    "relax.call_",
    "relax.print",
    "relax.assert",
    "relax.memory",
    "relax.vm",
    "relax.builtin",
    "relax.null_value",
    "relax.invoke",
    "relax.to_vdevice",
    "relax.hint_on_device",
)


def _pure_op(value: relax.Expr) -> bool:
    if isinstance(value, (relax.Var, relax.Tuple, relax.TupleGetItem, tvm.ir.GenericConst)):
        return True
    return (
        isinstance(value, relax.Call)
        and isinstance(value.op, tvm.ir.Op)
        and not value.op.name.startswith(_EFFECTS)
    )


def _elements(ty: object) -> int | None:
    """Elements of a statically shaped tensor type; None otherwise."""
    shape = known_shape(ty)
    return None if shape is None else int(np.prod(shape, dtype=np.int64))


def _plan(func: relax.Function) -> tuple[list[relax.VarBinding], list[relax.Var]]:
    """The input-free bindings, in order, and those of their vars that input-dependent work
    (or the function's result) reads: the values to fold."""
    bindings = [b for block in func.body.blocks for b in block.bindings]
    free: dict[relax.Var, relax.VarBinding] = {}
    for b in bindings:
        if (
            isinstance(b, relax.VarBinding)
            and _pure_op(b.value)
            and all(v in free for v in relax.analysis.free_vars(b.value))
        ):
            free[b.var] = b
    read: set[relax.Var] = set(relax.analysis.free_vars(func.body.body))
    for b in bindings:
        if b.var not in free:
            read.update(relax.analysis.free_vars(b.value))
    frontier = [
        v
        for v in free
        if v in read
        and not isinstance(free[v].value, (tvm.ir.GenericConst, relax.Var))
        and (n := _elements(free[v].value.ty)) is not None
        and n <= MAX_ELEMENTS
    ]
    return list(free.values()), frontier


@relax.expr_functor.mutator
class _Substitute(relax.PyExprMutator):
    """Uses of the vars in ``values`` become the expressions given for them."""

    def __init__(self, values: dict[relax.Var, relax.Expr]) -> None:
        super().__init__()
        self.values = values

    def visit_var_(self, var: relax.Var) -> relax.Expr:
        return self.values.get(var, var)

    def visit_dataflow_var_(self, var: relax.Var) -> relax.Expr:
        return self.values.get(var, var)


def _evaluate(bindings: list[relax.VarBinding], wanted: list[relax.Var]) -> list[np.ndarray]:
    """Values of ``wanted``, computing ``bindings`` (which read no input) with TVM."""
    bb = relax.BlockBuilder()
    emitted: dict[relax.Var, relax.Expr] = {}
    rename = _Substitute(emitted)  # reads each var's new name as it is emitted
    with bb.function("main", []):
        with bb.dataflow():
            for b in bindings:
                emitted[b.var] = bb.emit(rename.visit_expr(b.value))
            out = bb.emit_output(relax.Tuple([emitted[v] for v in wanted]))
        bb.emit_func_output(out)
    with tvm.transform.PassContext():  # a build of its own: not the pipeline's switches
        ex = tvm.compile(bb.get(), target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return [t.numpy() for t in vm["main"]()]


def fold_input_free(mod: tvm.IRModule) -> tuple[tvm.IRModule, int]:
    """``mod`` with every input-free value that input-dependent work reads made a constant
    (unchanged when there is none, or when TVM cannot evaluate them), and how many."""
    bindings, frontier = _plan(mod["main"])
    if not frontier:
        return mod, 0
    try:
        values = _evaluate(bindings, frontier)
    except Exception:  # noqa: BLE001 - an op TVM cannot compile alone: leave the work at run time
        return mod, 0
    consts = {v: relax.const(a, str(a.dtype)) for v, a in zip(frontier, values, strict=True)}
    mod = with_main(mod, _Substitute(consts).visit_expr(mod["main"]))
    return relax.transform.DeadCodeElimination(["main"])(mod), len(consts)


FOLD_INPUT_FREE = ImportPass(
    "FoldInputFree",
    "work that reads no input (masks and positions "
    "from R.arange) computed once by TVM and made constants",
    fold_input_free,
)
