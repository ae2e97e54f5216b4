"""Work that reads no model input is folded at import, exactly, and nothing else is."""

import numpy as np
import tvm
from tvm import relax

from partune import input_free
from partune.backends import registry
from partune.core.graph import main_bindings
from partune.model_rewrites import normalise


def _masked_scores() -> tvm.IRModule:
    """A causal mask built from ``arange`` (int64 compares, as the torch import spells it),
    applied to the input: what FoldConstant leaves computed on every call."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            i = bb.emit(relax.op.arange(0, 8, 1, dtype="int64"))
            row = bb.emit(relax.op.reshape(i, (8, 1)))
            col = bb.emit(relax.op.add(i, relax.const(0, "int64")))
            mask = bb.emit(relax.op.less_equal(col, row))
            out = bb.emit_output(relax.op.where(mask, x, relax.const(-1e9, "float32")))
        bb.emit_func_output(out)
    return bb.get()


def _run(mod: tvm.IRModule, x: np.ndarray) -> np.ndarray:
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy()


def _ops(mod: tvm.IRModule) -> list[str]:
    return [b.value.op.name for b in main_bindings(mod["main"])
            if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)]


def test_an_arange_mask_becomes_one_constant_and_computes_the_same():
    mod = _masked_scores()
    folded = normalise(mod)
    assert _ops(folded) == ["relax.where"]  # arange, reshape, add and the compare are gone
    x = np.random.default_rng(0).standard_normal((1, 8, 8)).astype("float32")
    np.testing.assert_array_equal(_run(folded, x), _run(mod, x))
    # and OpenVINO, which refuses the int64 steps, now takes the whole function
    ov = registry.get("openvino")
    assert all(ov.accepts(b) for b in main_bindings(folded["main"]))
    assert not all(ov.accepts(b) for b in main_bindings(mod["main"]))


def test_values_too_large_to_keep_stay_computed(monkeypatch):
    monkeypatch.setattr(input_free, "MAX_ELEMENTS", 8)  # the 8x8 mask is over the cap
    assert "relax.less_equal" in _ops(input_free.fold_input_free(_masked_scores()))


def test_a_function_of_inputs_only_is_left_as_it_is():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4,), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.add(x, x))
        bb.emit_func_output(out)
    mod = bb.get()
    assert input_free.fold_input_free(mod) is mod
