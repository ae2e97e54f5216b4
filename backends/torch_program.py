"""The program a region compiles to: slots, a constant template and a flat list of
steps over ATen closures, emitted binding by binding or chain by chain, checked on meta
tensors, and wrapped as the destination-passing region kernel.

Separate from the translators and the fuser, which it drives: they decide what each
step computes, this module decides how steps are laid out and run.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from tvm import relax

from partune.backends.base import BackendError, RegionKernel
from partune.backends.torch_fuser import Chain, Graph, make_graph, plan_chains
from partune.backends.torch_nn_ops import conv2d_fn, pad4
from partune.backends.torch_op_registry import (
    TORCH_DTYPES,
    GenericConst,
    OpFn,
    Unsupported,
    identity,
    ints,
    is_dynamic,
    tensor_type,
)
from partune.backends.torch_ops import translate_call

# --------------------------------------------------------------------------- the builder


@dataclass
class Program:
    """Build-time state: slots, constant template, and the step list the kernel runs."""

    device: torch.device
    template: list[Any] = field(default_factory=list)
    constant: set[int] = field(default_factory=set)
    slots: dict[relax.Var, int] = field(default_factory=dict)
    steps: list[tuple[OpFn, tuple[int, ...], int]] = field(default_factory=list)
    expect: list[tuple[int, Any]] = field(default_factory=list)  # (slot, Relax type) to verify
    const_cache: dict[Any, int] = field(default_factory=dict)

    def new_slot(self, value: Any = None, constant: bool = False) -> int:
        self.template.append(value)
        if constant:
            self.constant.add(len(self.template) - 1)
        return len(self.template) - 1

    def const_slot(self, e: Any) -> int:
        """A Relax tensor constant, converted once (shared constants share one slot)."""
        if e not in self.const_cache:
            t = torch.from_numpy(e.value.numpy()).to(self.device)
            self.const_cache[e] = self.new_slot(t, constant=True)
        return self.const_cache[e]

    def value(self, e: Any) -> torch.Tensor:
        """The build-time value of a constant expression (no slot for a bare constant)."""
        if isinstance(e, GenericConst) and e not in self.const_cache:
            return torch.from_numpy(e.value.numpy()).to(self.device)
        slot = self.operand(e)
        if slot not in self.constant:
            raise BackendError("expected a build-time constant")
        return self.template[slot]

    def operand(self, e: Any) -> int:
        """The slot holding a dynamic argument; tuples of tensors get a packing step."""
        if isinstance(e, relax.Var):
            if e not in self.slots:
                raise BackendError(f"variable {e.name} used before its definition")
            return self.slots[e]
        if isinstance(e, GenericConst):
            return self.const_slot(e)
        if isinstance(e, relax.Tuple):
            ins = tuple(self.operand(f) for f in e.fields)
            return self.emit(lambda *xs: xs, ins, None)
        raise Unsupported(f"operand {type(e).__name__}")

    def emit(self, fn: OpFn, ins: tuple[int, ...], ty: Any) -> int:
        """Add a step, or run it now when all its inputs are constants (constant folding)."""
        if fn is identity:
            return ins[0]
        if all(i in self.constant for i in ins):
            with torch.no_grad():
                slot = self.new_slot(fn(*[self.template[i] for i in ins]), constant=True)
        else:
            slot = self.new_slot()
            self.steps.append((fn, ins, slot))
        if ty is not None:
            self.expect.append((slot, ty))
        return slot


def emit_binding(p: Program, b: relax.VarBinding) -> None:
    value, ty = b.value, b.var.ty
    if isinstance(value, relax.Call):
        fn = translate_call(value, ty, p.device)
        ins = tuple(p.operand(a) for a in value.args if is_dynamic(a))
        p.slots[b.var] = p.emit(fn, ins, ty)
    elif isinstance(value, relax.Var | GenericConst | relax.Tuple):
        p.slots[b.var] = p.operand(value)
    elif isinstance(value, relax.TupleGetItem):
        k = int(value.index)
        p.slots[b.var] = p.emit(lambda t: t[k], (p.operand(value.tuple_value),), ty)
    else:
        raise Unsupported(f"binding value {type(value).__name__}")


def fold_affine(
    p: Program, chain: Chain, channels: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Per-channel (scale, bias) in float64 from the chain's folds, applied in order."""
    scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    for kind, e in chain.folds:
        if kind in ("bias", "mul"):
            vec = p.value(e).double().reshape(-1).expand(channels)
            if kind == "bias":
                bias = vec.clone() if bias is None else bias + vec
                continue
            s, shift = vec, None
        else:
            gamma, beta, mean, var = (p.value(a).double() for a in e.args[1:])
            gamma = gamma if bool(e.attrs.scale) else torch.ones_like(gamma)
            beta = beta if bool(e.attrs.center) else torch.zeros_like(beta)
            s = gamma / torch.sqrt(var + float(e.attrs.epsilon))
            shift = beta - mean * s
        bias = shift if bias is None else bias * s + (0 if shift is None else shift)
        scale = s if scale is None else scale * s
    return scale, bias


def emit_conv(p: Program, g: Graph, chain: Chain, last: relax.Var) -> None:
    call = next(v for m in chain.members if (v := g.call(m, "relax.nn.conv2d")) is not None)
    pads = pad4(call.attrs.padding)
    data = call.args[0]
    if chain.pad is not None:
        pads = tuple(a + b for a, b in zip(pads, chain.pad, strict=True))
        data = g.bindings[chain.members[0]].value.args[0]
    weight = p.value(chain.weight)
    scale, bias = fold_affine(p, chain, weight.shape[0])
    if scale is not None:
        weight = (weight.double() * scale.reshape(-1, 1, 1, 1)).to(weight.dtype)
    conv = conv2d_fn(
        pads, ints(call.attrs.strides), ints(call.attrs.dilation), int(call.attrs.groups), bias=True
    )
    ins = [p.operand(data), p.new_slot(weight, constant=True)]
    if bias is not None:
        ins.append(p.new_slot(bias.to(weight.dtype), constant=True))
    emit_chain(p, chain, last, conv, ins)


def emit_linear(p: Program, g: Graph, chain: Chain, last: relax.Var) -> None:
    call = g.bindings[chain.members[0]].value
    weight = p.value(chain.weight)
    scale, bias = fold_affine(p, chain, weight.shape[1])
    if scale is not None:
        weight = (weight.double() * scale.reshape(1, -1)).to(weight.dtype)
    ins = [p.operand(call.args[0]), p.new_slot(weight.t(), constant=True)]
    if bias is not None:
        ins.append(p.new_slot(bias.to(weight.dtype), constant=True))
    emit_chain(p, chain, last, F.linear, ins)


def post_op(kind: str, arg: Any, k: int) -> Callable[[torch.Tensor, tuple], Any]:
    """One post op; ``k`` is where its extra inputs start in the step's arguments."""
    if kind == "reshape":
        return lambda y, xs: y.reshape(arg)
    if kind == "add":
        return lambda y, xs: y.add_(xs[k])
    if kind == "bn_tuple":
        return lambda y, xs: (y, xs[k], xs[k + 1])
    return lambda y, xs: arg(y)


def emit_chain(p: Program, chain: Chain, last: relax.Var, anchor: OpFn, ins: list[int]) -> None:
    """One step: the anchor (with folded weight and bias), then its post ops in place."""
    n = len(ins)
    posts = []
    for kind, arg in chain.post:
        k = len(ins)
        if kind == "add":
            ins.append(p.operand(arg))
        elif kind == "bn_tuple":  # the moving mean and variance pass through unchanged
            ins.extend((p.operand(arg.args[3]), p.operand(arg.args[4])))
        posts.append(post_op(kind, arg, k))

    def fused(*xs: torch.Tensor) -> torch.Tensor:
        y = anchor(*xs[:n])
        for post in posts:
            y = post(y, xs)
        return y

    p.slots[last] = p.emit(fused, tuple(ins), last.ty)


def emit_safe_softmax(p: Program, g: Graph, chain: Chain, last: relax.Var) -> None:
    axis = chain.axis

    def safe_softmax(a: torch.Tensor) -> torch.Tensor:
        s = F.softmax(a, dim=axis)
        masked = a.amax(dim=axis, keepdim=True) == float("-inf")  # all -inf (NaN rows stay NaN)
        if a.device.type != "cpu" or bool(masked.any()):  # on CPU the check is cheaper than a fill
            s.masked_fill_(masked, 0.0)
        return s

    p.slots[last] = p.emit(safe_softmax, (p.operand(chain.data),), last.ty)


EMITTERS: dict[str, Callable[[Program, Graph, Chain, relax.Var], None]] = {
    "conv": emit_conv,
    "linear": emit_linear,
    "safe_softmax": emit_safe_softmax,
}


def region_bindings(func: relax.Function) -> tuple[list[relax.VarBinding], Any]:
    body = func.body
    if not isinstance(body, relax.SeqExpr):
        return [], body
    bindings = [b for block in body.blocks for b in block.bindings]
    for b in bindings:
        if not isinstance(b, relax.VarBinding):
            raise Unsupported(f"{type(b).__name__} in region")
    return bindings, body.body


def output_paths(
    p: Program, e: Any, ty: Any, path: tuple[int, ...] = ()
) -> list[tuple[int, tuple[int, ...]]]:
    """Flatten the returned value into (slot, tuple path) per output tensor, in order."""
    if isinstance(e, relax.Tuple) and not path:
        return [q for f in e.fields for q in output_paths(p, f, f.ty)]
    if isinstance(ty, relax.TupleType):
        return [q for k, f in enumerate(ty.fields) for q in output_paths(p, e, f, path + (k,))]
    return [(p.operand(e), path)]


def to_meta(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.to("meta")
    if isinstance(v, tuple | list):
        return type(v)(to_meta(x) for x in v)
    return v


def same_type(v: Any, ty: Any) -> bool:
    if isinstance(ty, relax.TupleType):
        return (
            isinstance(v, tuple | list)
            and len(v) == len(ty.fields)
            and all(same_type(x, f) for x, f in zip(v, ty.fields, strict=True))
        )
    shape, dtype = tensor_type(ty)
    return (
        isinstance(v, torch.Tensor) and tuple(v.shape) == shape and v.dtype == TORCH_DTYPES[dtype]
    )


def describe(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"{tuple(v.shape)} {v.dtype}"
    if isinstance(v, tuple | list):
        return "(" + ", ".join(describe(x) for x in v) + ")"
    return type(v).__name__


def verify(p: Program, inputs: list[tuple[int, Any]]) -> None:
    """Run the steps on meta tensors: every result must have its Relax shape and dtype."""
    env = [to_meta(v) for v in p.template]
    for slot, ty in inputs:
        shape, dtype = tensor_type(ty)
        env[slot] = torch.empty(shape, dtype=TORCH_DTYPES[dtype], device="meta")
    with torch.inference_mode():
        for fn, ins, out in p.steps:
            try:
                env[out] = fn(*[env[i] for i in ins])
            except NotImplementedError:
                return  # an op without a meta kernel: the rest cannot be checked statically
            except Exception as err:
                raise BackendError(f"translated step failed on meta tensors: {err}") from err
    for slot, ty in p.expect:
        if not same_type(env[slot], ty):
            raise BackendError(f"translation gives {describe(env[slot])} where Relax has {ty}")


def compile_region(
    func: relax.Function, device: torch.device, precision: str = "f32"
) -> RegionKernel:
    """Translate ``func`` into a destination-passing kernel over DLPack tensors; in bf16, the
    steps run under CPU autocast (matmuls, linears and convolutions in bfloat16 on the CPU's
    bf16 instructions; the outputs are written back in the region's dtypes)."""
    p = Program(device)
    inputs = []
    for param in func.params:
        if not isinstance(param.ty, relax.TensorType):
            raise Unsupported(f"parameter {param.name} is not a tensor")
        tensor_type(param.ty)
        p.slots[param] = p.new_slot()
        inputs.append((p.slots[param], param.ty))
    bindings, ret = region_bindings(func)
    g = make_graph(bindings, ret)
    chains, taken = plan_chains(g)
    for i, b in enumerate(bindings):
        if i in chains:
            kind, chain, last = chains[i]
            EMITTERS[kind](p, g, chain, last)
        elif i not in taken:
            emit_binding(p, b)
    outputs = output_paths(p, ret, ret.ty)
    verify(p, inputs)
    return make_kernel(p, [s for s, _ in inputs], outputs, bf16=precision == "bf16")


def make_kernel(
    p: Program, in_slots: list[int], outputs: list[tuple[int, tuple[int, ...]]], bf16: bool = False
) -> RegionKernel:
    template, steps = list(p.template), list(p.steps)
    n_in, n_out = len(in_slots), len(outputs)
    from_dlpack = torch.from_dlpack
    precision = (
        functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16)
        if bf16
        else contextlib.nullcontext
    )

    def kernel(*args: Any) -> None:
        if len(args) != n_in + n_out:
            raise BackendError(f"kernel takes {n_in} inputs and {n_out} outputs, got {len(args)}")
        env = template.copy()
        try:
            for slot, a in zip(in_slots, args, strict=False):
                env[slot] = from_dlpack(a)
            with torch.inference_mode(), precision():
                for fn, ins, out in steps:
                    env[out] = fn(*[env[i] for i in ins])
                for (slot, path), dst in zip(outputs, args[n_in:], strict=True):
                    v = env[slot]
                    for k in path:
                        v = v[k]
                    from_dlpack(dst).copy_(v)
        except Exception as err:  # out-of-range indices, wrong input shapes, ...
            raise BackendError(f"torch kernel failed: {err}") from err

    kernel.num_steps = len(steps)  # type: ignore[attr-defined]
    return kernel
