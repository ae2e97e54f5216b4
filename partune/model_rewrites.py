"""Rewrites every imported module goes through (``normalise``): each keeps the model's
meaning exactly (the same values, or the same products summed in another order, as any
backend's kernel may) and makes it buildable, uniform, faster, or takeable by more backends."""

from __future__ import annotations

import tvm
from tvm import relax

from partune.finite_bounds import drop_softmax_guards
from partune.input_free import fold_input_free
from partune.relative_shear import RelativeShears
from partune.waveform_conv import WaveformFrames


@relax.expr_functor.mutator
class _BoolCumsumFix(relax.PyExprMutator):
    """cumsum of bool: torch returns int64, Relax keeps bool and then cannot build."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.cumsum"
                and call.args[0].ty.dtype == "bool"):
            x = relax.op.astype(call.args[0], "int64")
            return relax.op.cumsum(x, axis=call.attrs.axis, dtype="int64",
                                   exclusive=call.attrs.exclusive)
        return call


@relax.expr_functor.mutator
class _WholeInputPool(relax.PyExprMutator):
    """A 2-D pool whose one window covers the whole unpadded input is a mean (max) over H, W.

    Hugging Face EfficientNet pools with ``AvgPool2d(hidden_dim, ceil_mode=True)``: a
    1280-wide window over a 7x7 map. Every framework clips the window to the input (the
    divisor is H*W), but kept as a pool it costs untuned TVM a loop over 1280^2 taps per
    channel (the OpenVINO-only plan ran it there: 0.7 s), and OpenVINO refuses a kernel larger
    than its input. As a reduction it is a global pool for every backend.
    """

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        out = call.ty  # the type the import inferred (a rewritten call has none yet)
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op) or call.op.name not in ("relax.nn.avg_pool2d",
                                                                       "relax.nn.max_pool2d"):
            return call
        a, ty = call.attrs, call.args[0].ty
        if (str(a.layout) != "NCHW" or str(a.out_layout) != "NCHW"
                or not isinstance(ty, relax.TensorType) or not isinstance(out, relax.TensorType)
                or ty.shape is None or out.shape is None or len(ty.shape.values) != 4):
            return call
        try:
            hw = [int(v) for v in ty.shape.values[2:]]
            out_hw = [int(v) for v in out.shape.values[2:]]
        except TypeError:  # symbolic
            return call
        if (out_hw != [1, 1] or any(int(p) for p in a.padding) or any(int(d) != 1 for d in a.dilation)
                or any(int(k) < n for k, n in zip(a.pool_size, hw, strict=True))):
            return call
        reduce = relax.op.mean if call.op.name == "relax.nn.avg_pool2d" else relax.op.max
        return reduce(call.args[0], axis=[2, 3], keepdims=True)


_MOVES = frozenset({"relax.expand_dims", "relax.broadcast_to", "relax.reshape", "relax.permute_dims",
                    "relax.squeeze"})


def _op_name(expr: relax.Expr) -> str | None:
    return expr.op.name if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) else None


@relax.expr_functor.mutator
class _ExactIdioms(relax.PyExprMutator):
    """Spell three import idioms so that every backend can take them, each rewrite exact.

    The ONNX import leaves int64 and float-to-bool steps that OpenVINO's CPU plugin cannot
    compute exactly, so it refuses them and the model splits around them (a border each,
    about 17 us measured, at every layer that reads the attention mask):

    * ``astype(moves(x))`` with ``x`` int64 (an attention mask expanded, then cast to
      float): the cast comes first, ``moves(astype(x))``; a cast commutes with expand,
      broadcast, reshape, permute and squeeze, and the int64 moves are gone.
    * ``astype(x, "bool")`` of a float: ``not (x == 0)``, the same for every value (NaN == 0
      is false everywhere, so NaN is true, as bool(NaN) is; -0.0 == 0, so -0.0 is false).
      Not ``x != 0``: TVM compiles that as an ordered compare, false for NaN.
    * ``take(T, where(i < 0, i + n, i), axis)`` with ``n`` the axis' length (how the import
      spells ONNX Gather's negative indices): ``take(T, i, axis, mode="wrap")``, the same
      for every index the original defines (``[-n, n)``).
    """

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        name = _op_name(call)
        if name == "relax.astype":
            return self._cast(call)
        if name == "relax.take":
            return self._take(call)
        return call

    def _bound(self, expr: relax.Expr) -> relax.Expr:
        return self.lookup_binding(expr) if isinstance(expr, relax.Var) and self.lookup_binding(expr) is not None else expr

    def _cast(self, call: relax.Call) -> relax.Expr:
        dtype, src = str(call.attrs.dtype), call.args[0]
        src_dtype = str(src.ty.dtype) if isinstance(src.ty, relax.TensorType) else ""
        if dtype == "bool" and src_dtype.startswith("float"):
            is_zero = self.builder_.emit(relax.op.equal(src, relax.const(0.0, src_dtype)))
            return relax.op.logical_not(is_zero)
        chain, x = [], src
        while _op_name(self._bound(x)) in _MOVES:
            chain.append(self._bound(x))
            x = chain[-1].args[0]
        if not chain or not isinstance(x.ty, relax.TensorType) or str(x.ty.dtype) != "int64":
            return call
        out = self.builder_.emit(relax.op.astype(x, dtype))
        for move in reversed(chain):
            out = self.builder_.emit(relax.Call(move.op, [out, *move.args[1:]], move.attrs))
        return out

    def _take(self, call: relax.Call) -> relax.Expr:
        table, idx = call.args
        where = self._bound(idx)
        if str(call.attrs.mode) != "fast" or _op_name(where) != "relax.where" or call.attrs.axis is None:
            return call
        cond, wrapped, i = (self._bound(a) if k < 2 else a for k, a in enumerate(where.args))
        try:
            n = int(table.ty.shape.values[int(call.attrs.axis)])
        except (TypeError, AttributeError, IndexError):
            return call
        if (_op_name(cond) != "relax.less" or _op_name(wrapped) != "relax.add"
                or not _is(cond.args[0], i) or not _is(wrapped.args[0], i)
                or _scalar(cond.args[1]) != 0 or _scalar(wrapped.args[1]) != n):
            return call
        return relax.op.take(table, i, axis=int(call.attrs.axis), mode="wrap")


def _is(a: relax.Expr, b: relax.Expr) -> bool:
    return a.same_as(b)


def _scalar(expr: relax.Expr) -> float | None:
    """The value of a scalar constant, else None."""
    if isinstance(expr, tvm.ir.GenericConst) and (value := expr.value.numpy()).size == 1:
        return float(value.reshape(()))
    return None


def normalise(mod: tvm.IRModule) -> tvm.IRModule:
    """Make an imported module buildable and uniform: bool cumsum fixed, whole-input pools made
    reductions, import idioms spelt so every backend takes them, constants folded, relative
    position gathers made shears, a waveform's convolution a matmul over frames, no dead code."""
    mod = mod.clone() if hasattr(mod, "clone") else mod
    mod["main"] = _BoolCumsumFix().visit_expr(mod["main"])
    mod["main"] = _WholeInputPool().visit_expr(mod["main"])
    # Work that depends on no input (masks built from constants) is done once, here.
    mod = relax.transform.FoldConstant()(mod)
    mod = fold_input_free(mod)  # what FoldConstant cannot: work rooted in R.arange and the like
    mod["main"] = _ExactIdioms().visit_expr(mod["main"])  # (after folding: it reads constants)
    mod = drop_softmax_guards(mod)  # softmax guards that can never fire
    mod["main"] = RelativeShears().visit_expr(mod["main"])  # relative-position gathers as copies
    mod["main"] = WaveformFrames().visit_expr(mod["main"])  # a waveform's conv: a matmul over frames
    mod = relax.transform.DeadCodeElimination(["main"])(mod)
    return mod
