"""The values a model computes inside: what an isolated region is measured on.

A candidate region timed on random inputs can read out of bounds (an embedding gather
given random ids), take a different path (masks) or fail outright. So the model is run
once on its example inputs with every intermediate tensor returned, and each region's
inputs are cut from those values. One run of one build: a graph-level backend that
takes the whole model (fast to build and run), else TVM, which takes everything.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from partune.backends import registry
from partune.core import (
    DataflowGraph,
    SEScope,
    clean_error,
    cpu_target,
    last_line,
    lift_region,
    main_bindings,
    static_shape,
    tensor_types,
)

Values = dict[relax.Var, "np.ndarray | list[np.ndarray]"]
CAPTURE_LIMIT_BYTES = 2 << 30  # beyond this, regions fall back to valid random inputs


def _tensor_like(ty) -> bool:
    if isinstance(ty, relax.TupleType):
        return all(isinstance(f, relax.TensorType) for f in ty.fields)
    return isinstance(ty, relax.TensorType)


def _op_name(binding: relax.Binding) -> str:
    """The op a binding calls, as people name it (``conv2d``), else the kind of value it binds."""
    from partune.core import short_op

    op = getattr(getattr(binding.value, "op", None), "name", None)
    return (
        short_op(op[len("relax.") :])
        if isinstance(op, str) and op.startswith("relax.")
        else "a non-op value"
    )


def capture_values(
    mod: tvm.IRModule, graph: DataflowGraph, inputs: list[np.ndarray], backends: list[str]
) -> Values:
    """Every tensor (and tuple of tensors) bound in main, from one run on ``inputs``.

    Keys are main's own variables (its parameters included), so a region lifted out of
    main can look its inputs up. Raises when no backend can build the whole model.
    """
    func = mod["main"]
    bindings = main_bindings(func)
    exits = [b.var for b in bindings if _tensor_like(b.var.ty)]
    total = sum(n.out_bytes for n in graph.nodes)
    if total > CAPTURE_LIMIT_BYTES:
        raise MemoryError(f"intermediate values take {total / 2**30:.1f} GiB")
    whole, args, _ = lift_region(bindings, exits, "capture", {})
    order = [b for b in backends if registry.get(b).level.value == "compiler"] + [registry.NATIVE]
    errors = []
    for name in order:
        backend = registry.get(name)
        refused = next((b for b in bindings if not backend.accepts(b)), None)
        if refused is not None:
            errors.append(f"{name}: does not accept {_op_name(refused)}")
            continue
        try:
            # A fully constrained CPU scope, as CompilationConfig.for_cpu makes: TVM needs the
            # target.
            scope = SEScope("cpu", 0, cpu_target(registry.threads()), "global", name)
            kernel = backend.build_region(whole, scope, registry.threads())
        except Exception as e:  # noqa: BLE001 - try the next backend
            errors.append(
                f"{name}: {clean_error(last_line(e, 120))}"
            )  # read by people: no class names
            continue
        by_param = dict(zip(func.params, inputs, strict=True))
        ins = [tvm.runtime.tensor(by_param[a]) for a in args]
        outs = [
            tvm.runtime.tensor(np.empty(static_shape(t), str(t.dtype)))
            for v in exits
            for t in tensor_types(v.ty)
        ]
        kernel(*ins, *outs)
        values: Values = dict(by_param)
        k = 0
        for v in exits:
            if isinstance(v.ty, relax.TupleType):
                values[v] = [o.numpy() for o in outs[k : k + len(v.ty.fields)]]
                k += len(v.ty.fields)
            else:
                values[v] = outs[k].numpy()
                k += 1
        return values
    raise RuntimeError(
        "no backend could build the whole model to capture its values: " + "; ".join(errors)
    )


def region_inputs(args: list[relax.Expr], values: Values) -> list[np.ndarray] | None:
    """The arrays a lifted region's parameters take in the model (None if any is unknown)."""
    out = []
    for a in args:
        if isinstance(a, relax.TupleGetItem) and isinstance(a.tuple_value, relax.Var):
            v = values.get(a.tuple_value)
            if not isinstance(v, list):
                return None
            out.append(v[a.index])
        elif isinstance(a, relax.Var) and isinstance(values.get(a), np.ndarray):
            out.append(values[a])
        else:
            return None
    return out


def save_values(values: Values, func: relax.Function, path: str) -> None:
    """``values`` (of ``func``, main) into an .npz by position, the same in any copy of the model
    (a worker's parse of the model file): parameter i as ``p{i}``, binding j as ``b{j}``, a tuple's
    field k as ``b{j}.{k}``."""
    arrays: dict[str, np.ndarray] = {
        f"p{i}": values[p] for i, p in enumerate(func.params) if p in values
    }
    for j, b in enumerate(main_bindings(func)):
        value = values.get(b.var)
        if isinstance(value, list):
            arrays |= {f"b{j}.{k}": a for k, a in enumerate(value)}
        elif value is not None:
            arrays[f"b{j}"] = value
    np.savez(path, **arrays)


def load_values(func: relax.Function, path: str) -> Values:
    """What ``save_values`` wrote, keyed by this copy's own variables."""
    params, bindings = list(func.params), main_bindings(func)
    values: Values = {}
    fields: dict[int, dict[int, np.ndarray]] = {}
    with np.load(path, allow_pickle=False) as data:
        for name in data.files:
            where, _, field = name.partition(".")
            index = int(where[1:])
            if where[0] == "p":
                values[params[index]] = data[name]
            elif field:
                fields.setdefault(index, {})[int(field)] = data[name]
            else:
                values[bindings[index].var] = data[name]
    for index, parts in fields.items():
        values[bindings[index].var] = [parts[k] for k in sorted(parts)]
    return values
