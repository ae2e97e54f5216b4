"""Apply a plan to a Relax module: lift each offloaded region into a BYOC function.

Regions of native TVM stay in ``main`` and go through TVM's own lowering (a bf16 one with its
matmuls and convolutions on bf16 operands, ``partune.core.bf16``). Every other
region becomes a global function with attributes ``Codegen`` (the backend's codegen
name), ``global_symbol`` and ``partune.scope`` (its SEScope as JSON), called from main;
``relax.transform.RunCodegen`` later hands these functions to the backends. An int8 region
is lifted with its matmuls and convolutions in QDQ form over the plan's calibrated ranges
(``partune.core.int8``), which its backend runs on int8 kernels.

A native region that must keep its borders (tuned TVM: its schedules were found for the
workloads TVM fuses inside the region alone) becomes a plain Relax function called from
main: TVM's FuseOps never fuses across a call, so the whole-model build runs exactly the
fused workloads that were tuned and measured, instead of new ones that have no record.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import tvm
from tvm import relax

from partune.core.bf16 import function_in_bf16, in_bf16
from partune.core.graph import DataflowGraph, main_bindings
from partune.core.int8 import (
    INT8,
    UNITS,
    attention_operands,
    in_int8,
    int8_units,
    source_output,
    unit_output,
)
from partune.core.plan import Calibration, Plan, Region, region_order

SCOPE_ATTR = "partune.scope"
# On an int8 region's function: its QDQ form is the plan's, calibrated (and with the units the
# plan keeps in f32 left so): its backend builds it as it stands (``int8_ready``).
INT8_ATTR = "partune.int8"


def _substitute(expr: relax.Expr, env: dict[relax.Var, relax.Expr]) -> relax.Expr:
    """``expr`` with variables replaced by ``env`` (one level of tuple nesting in args)."""
    if isinstance(expr, relax.Var):
        return env.get(expr, expr)
    if isinstance(expr, relax.Tuple):
        return relax.Tuple([_substitute(f, env) for f in expr.fields])
    if isinstance(expr, relax.TupleGetItem):
        return relax.TupleGetItem(_substitute(expr.tuple_value, env), expr.index)
    if isinstance(expr, relax.Call):
        return relax.Call(
            expr.op, [_substitute(a, env) for a in expr.args], expr.attrs, expr.ty_args
        )
    return expr


def _free_vars(bindings: list[relax.Binding]) -> list[relax.Var]:
    """Variables read by ``bindings`` but bound outside them, in first-use order."""
    bound = {b.var for b in bindings}
    seen: dict[relax.Var, None] = {}

    def visit(e: relax.Expr) -> None:
        if isinstance(e, relax.Var):
            if e not in bound:
                seen.setdefault(e, None)
        elif isinstance(e, relax.Tuple):
            for f in e.fields:
                visit(f)
        elif isinstance(e, relax.TupleGetItem):
            visit(e.tuple_value)
        elif isinstance(e, relax.Call):
            for a in e.args:
                visit(a)

    for b in bindings:
        visit(b.value)
    return list(seen)


def region_exits(graph: DataflowGraph, region: set[int]) -> list[int]:
    """Nodes of ``region`` read by another region or returned by main."""
    outs = set(graph.outputs)
    return [
        n for n in sorted(region) if n in outs or any(c not in region for c in graph.consumers[n])
    ]


def lift_region(
    bindings: list[relax.Binding], exits: list[relax.Var], name: str, attrs: dict[str, str]
) -> tuple[relax.Function, list[relax.Expr], Callable]:
    """Make a function of ``bindings`` returning ``exits``.

    Returns the function, its call arguments (to be substituted in the caller) and a
    function giving, per exit, the expression that rebuilds it from the call's result.
    Tuples crossing the boundary travel as their fields, since a destination-passing
    kernel reads and writes tensors only.
    """
    free = _free_vars(bindings)
    # Tuple-typed inputs are passed field by field: kernels take tensors only.
    args: list[relax.Expr] = []
    params: list[relax.Var] = []
    for a in free:
        if isinstance(a.ty, relax.TupleType):
            for i, f in enumerate(a.ty.fields):
                args.append(relax.TupleGetItem(a, i))
                params.append(relax.Var(f"{a.name}_{i}", f))
        else:
            args.append(a)
            params.append(relax.Var(a.name, a.ty))
    bb = relax.BlockBuilder()
    flat: list[relax.Expr] = []
    shapes: list[tuple[int, int]] = []  # per exit: (start in flat, field count or -1)
    with bb.function(name, params, attrs=attrs, private=False):
        with bb.dataflow():
            env: dict[relax.Var, relax.Expr] = {}
            k = 0
            for a in free:
                if isinstance(a.ty, relax.TupleType):
                    n = len(a.ty.fields)
                    env[a] = bb.emit(relax.Tuple(params[k : k + n]))
                    k += n
                else:
                    env[a] = params[k]
                    k += 1
            for b in bindings:
                env[b.var] = bb.emit(_substitute(b.value, env), name_hint=b.var.name)
            for v in exits:
                ty = v.ty
                if isinstance(ty, relax.TupleType):
                    start = len(flat)
                    for i in range(len(ty.fields)):
                        flat.append(bb.emit(relax.TupleGetItem(env[v], i)))
                    shapes.append((start, len(ty.fields)))
                else:
                    shapes.append((len(flat), -1))
                    flat.append(env[v])
            out = flat[0] if len(flat) == 1 else relax.Tuple(flat)
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    func = bb.get()[name]

    def rebuild(result: relax.Expr) -> list[relax.Expr]:
        def item(i: int) -> relax.Expr:
            return result if len(flat) == 1 else relax.TupleGetItem(result, i)

        return [
            item(s) if n == -1 else relax.Tuple([item(s + k) for k in range(n)]) for s, n in shapes
        ]

    return func, args, rebuild


def int8_ready(func: relax.Function) -> bool:
    """Whether ``func`` is an int8 region a plan already put in QDQ form (``apply``); else (a
    region timed alone) its backend does, with placeholder ranges."""
    return func.attrs is not None and INT8_ATTR in func.attrs


def _int8_bindings(
    bindings: list[relax.Binding],
    nodes: list[int],
    params: list[relax.Var],
    exits: list[relax.Var],
    calibration: Calibration | None,
    placement: str = UNITS,
) -> list[relax.Binding]:
    """The bindings of ``nodes`` with their matmuls and convolutions in int8, unit by unit
    (``int8_units``, within the region), each activation quantized over its calibrated range
    (``n<i>``: binding i's value, ``p<i>``: the i-th parameter), but for the units the plan keeps
    in f32 (an attention matmul kept so leaves its operands unquantized); placeholders where the
    plan has no calibration; where ``placement`` says (``function_in_int8``)."""
    ranges = calibration.ranges if calibration is not None else {}
    kept = set(calibration.f32_units) if calibration is not None else set()
    name = {b.var: f"n{i}" for i, b in enumerate(bindings)} | {
        p: f"p{i}" for i, p in enumerate(params)
    }
    inside = set(nodes)
    units = {
        op: end
        for op, end in int8_units(bindings, inside.__contains__, frozenset(exits)).items()
        if op not in kept
    }
    outputs = placement == UNITS
    ends = {e for op, e in units.items() if op in inside and e != op} if outputs else set()
    operands = {} if outputs else attention_operands(bindings, inside.__contains__)
    sources = {i for i, matmul in operands.items() if matmul not in kept}
    out = []
    for n in nodes:
        b = bindings[n]
        if n in units:
            arg = b.value.args[0]
            value = in_int8(
                b.value,
                ranges.get(name.get(arg, "")),
                ranges.get(f"n{n}"),
                unit_end=outputs and units[n] == n,
            )
        elif n in ends:
            value = unit_output(b.value, ranges.get(f"n{n}"))
        elif n not in sources:
            out.append(b)
            continue
        else:
            value = b.value
        if n in sources:
            value = source_output(value, ranges.get(f"n{n}"))
        out.append(relax.VarBinding(b.var, value))
    return out


def apply(
    plan: Plan,
    mod: tvm.IRModule,
    graph: DataflowGraph,
    codegen_of: Callable[[str], str | None],
    prefix: str = "",
    bordered: Callable[[str], bool] = lambda backend: False,
    int8_placement: Callable[[str], str] = lambda backend: UNITS,
) -> tvm.IRModule:
    """Rewrite ``mod`` so each region runs on its plan's SEScope.

    ``codegen_of(backend)`` gives a backend's BYOC codegen name, or None for native TVM;
    ``bordered(backend)``: whether a native region of that backend keeps its borders (a
    function of its own, see the module docstring); ``int8_placement(backend)``: where its int8
    regions quantize (``partune.backends.Backend.int8_placement``).
    ``prefix`` makes the regions' global
    symbols unique per build. The plan must already be validated against ``graph``.
    """
    func = mod["main"]
    bindings = main_bindings(func)
    new_mod = tvm.IRModule({gv: f for gv, f in mod.functions.items() if gv.name_hint != "main"})
    bb = relax.BlockBuilder(new_mod)
    params = [relax.Var(p.name, p.ty) for p in func.params]
    env: dict[relax.Var, relax.Expr] = dict(zip(func.params, params, strict=True))
    regions: tuple[Region, ...] = plan.regions
    with bb.function("main", params, attrs=dict(func.attrs) if func.attrs else None):
        with bb.dataflow():
            for k in region_order(graph, regions):
                region = regions[k]
                nodes = sorted(region.nodes)
                codegen = codegen_of(region.backend)
                bf16 = (
                    codegen is None and region.scope.compute_precision == "bf16"
                )  # else the codegen's
                if codegen is None and not bordered(region.backend):
                    for n in nodes:
                        b = bindings[n]
                        value = _substitute(b.value, env)
                        env[b.var] = bb.emit(
                            in_bf16(value) if bf16 else value, name_hint=b.var.name
                        )
                    continue
                exits = [bindings[n].var for n in region_exits(graph, set(nodes))]
                if codegen is None:  # native, bordered: plain Relax, lowered with main
                    symbol = f"{region.backend.replace('-', '_')}_{prefix}r{k}_{nodes[0]}"
                    attrs = {"global_symbol": symbol}
                else:
                    symbol = f"{codegen}_{prefix}r{k}_{nodes[0]}"
                    attrs = {
                        "Codegen": codegen,
                        "global_symbol": symbol,
                        SCOPE_ATTR: json.dumps(region.scope.to_json()),
                    }
                region_bindings = [bindings[n] for n in nodes]
                if region.scope.compute_precision == INT8:
                    region_bindings = _int8_bindings(
                        bindings,
                        nodes,
                        list(func.params),
                        exits,
                        plan.calibration,
                        int8_placement(region.backend),
                    )
                    attrs[INT8_ATTR] = "calibrated"
                lifted, args, rebuild = lift_region(region_bindings, exits, symbol, attrs)
                gv = bb.add_func(function_in_bf16(lifted) if bf16 else lifted, symbol)
                call = bb.emit(
                    relax.Call(gv, [_substitute(a, env) for a in args]), name_hint=symbol
                )
                for v, e in zip(exits, rebuild(call), strict=True):
                    env[v] = bb.emit(e, name_hint=v.name) if not isinstance(e, relax.Var) else e
            result = _substitute(func.body.body, env)
            out = bb.emit_output(result)
        bb.emit_func_output(out)
    return bb.get()
