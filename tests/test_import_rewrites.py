"""Import rewrites that make plans faster, each exact: input-free work folded once, softmax
guards dropped where they can never fire."""

import numpy as np
import pytest
import tvm
from tvm import relax

from partune.backends import registry
from partune.core.graph import main_bindings
from partune.frontend.passes import input_free, relative_shear
from partune.frontend.pipeline import normalise as _pipeline


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


def normalise(mod: tvm.IRModule) -> tvm.IRModule:
    return _pipeline(mod)[0]


def _ops(mod: tvm.IRModule) -> list[str]:
    return [
        b.value.op.name
        for b in main_bindings(mod["main"])
        if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)
    ]


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
    assert "relax.less_equal" in _ops(input_free.fold_input_free(_masked_scores())[0])


def test_a_function_of_inputs_only_is_left_as_it_is():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4,), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.add(x, x))
        bb.emit_func_output(out)
    mod = bb.get()
    assert input_free.fold_input_free(mod)[0] is mod


def _guarded_attention(
    mask: np.ndarray | None, normalise_first: bool = True, scores_only: bool = False
) -> tvm.IRModule:
    """softmax over scores with the import's guard against rows all -inf (torch's SDPA):
    scores from a layer norm (bounded) or from the raw input (not), plus an additive mask."""
    rng = np.random.default_rng(1)
    bb = relax.BlockBuilder()
    h = relax.Var("h", relax.TensorType((1, 4, 8), "float32"))
    with bb.function("main", [h]):
        with bb.dataflow():
            y = h
            if normalise_first:
                y = bb.emit(
                    relax.op.nn.layer_norm(
                        h,
                        relax.const(np.ones(8, "float32")),
                        relax.const(np.zeros(8, "float32")),
                        axes=[-1],
                    )
                )
            w = relax.const(rng.standard_normal((8, 4)).astype("float32"))
            x = bb.emit(relax.op.matmul(y, w))
            out = (
                bb.emit_output(x) if scores_only else bb.emit_output(_guarded_softmax(bb, x, mask))
            )
        bb.emit_func_output(out)
    return bb.get()


def _guarded_softmax(bb: relax.BlockBuilder, x: relax.Expr, mask: np.ndarray | None) -> relax.Expr:
    if mask is not None:
        x = bb.emit(relax.op.add(x, relax.const(mask)))
    sm = bb.emit(relax.op.nn.softmax(x, axis=-1))
    t = bb.emit(relax.op.equal(x, relax.const(float("-inf"), "float32")))
    t = bb.emit(relax.op.logical_not(t))
    t = bb.emit(relax.op.astype(t, "int8"))
    t = bb.emit(relax.op.max(t, axis=[-1], keepdims=True))
    t = bb.emit(relax.op.astype(t, "bool"))
    t = bb.emit(relax.op.logical_not(t))
    return relax.op.where(t, relax.const(np.zeros((1, 4, 4), "float32")), sm)


_CAUSAL = np.triu(np.full((4, 4), -np.inf, "float32"), k=1)  # the diagonal stays finite
_ROW_MASKED = np.where(np.arange(4)[:, None] == 2, -np.inf, 0).astype("float32") * np.ones(
    (4, 4), "float32"
)


@pytest.mark.parametrize(
    "mask,normalise_first,dropped",
    [
        (None, True, True),  # scores from a layer norm: bounded, never -inf
        (_CAUSAL, True, True),  # every row keeps a finite mask entry
        (_ROW_MASKED, True, False),  # row 2 is all -inf: the guard fires there
        (None, False, False),  # scores straight from a float input may be -inf
    ],
)
def test_softmax_guards_go_only_where_they_cannot_fire(mask, normalise_first, dropped):
    mod = _guarded_attention(mask, normalise_first)
    out = normalise(mod)
    assert ("relax.equal" not in _ops(out)) == dropped
    x = np.random.default_rng(2).standard_normal((1, 4, 8)).astype("float32")
    np.testing.assert_array_equal(_run(out, x), _run(mod, x))
    if mask is _ROW_MASKED:
        assert (_run(out, x)[0, 2] == 0).all()  # the guarded row: zeros, not NaN


def test_magnitude_bounds_hold_on_extreme_inputs_and_refuse_overflow():
    """Bounds are sound on what TVM computes, even from infinite or huge inputs, and a product
    that could overflow f32 is unbounded."""
    from partune.frontend.finite_bounds import magnitude_bounds, never_infinite

    mod = _guarded_attention(_CAUSAL)
    func = mod["main"]
    bounds = magnitude_bounds(func)
    bindings = main_bindings(func)
    calls = {b.value.op.name: b.var for b in bindings if isinstance(b.value, relax.Call)}
    scores, masked = calls["relax.matmul"], calls["relax.add"]
    assert never_infinite(bounds[scores]) and not never_infinite(
        bounds[masked]
    )  # the mask holds -inf
    # the bound holds on the values TVM computes (the scores, read out as the result)
    probe = _guarded_attention(_CAUSAL, scores_only=True)
    for x in (
        np.full((1, 4, 8), 1e30, "float32"),
        np.full((1, 4, 8), np.inf, "float32"),
        np.random.default_rng(3).standard_normal((1, 4, 8)).astype("float32") * 1e6,
    ):
        got = _run(probe, x)
        assert not np.isinf(got).any()  # NaN where the input was infinite, never an infinity
        finite = got[np.isfinite(got)]
        assert finite.size == 0 or np.abs(finite).max() <= bounds[scores]
    huge = relax.Var("h", relax.TensorType((1, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [huge]):
        with bb.dataflow():
            y = bb.emit(
                relax.op.nn.layer_norm(
                    huge,
                    relax.const(np.ones(8, "float32")),
                    relax.const(np.zeros(8, "float32")),
                    axes=[-1],
                )
            )
            z = bb.emit_output(relax.op.matmul(y, relax.const(np.full((8, 2), 3e37, "float32"))))
        bb.emit_func_output(z)
    assert not never_infinite(magnitude_bounds(bb.get()["main"])[z])


# --------------------------------------------------------------------------- relative shears


def _relative_scores(
    n: int, m: int, k: int, c: int, s: int, from_matmul: bool
) -> tuple[tvm.IRModule, np.ndarray]:
    """DeBERTa's c2p (s = +1) or p2c (s = -1) pick: scores against every relative position,
    gathered at ``c + s * (j - i)``; the scores a matmul by constant position keys, or the input."""
    rng = np.random.default_rng(n * 100 + m)
    i, j = np.indices((n, m))
    idx = np.broadcast_to(c + s * (j - i), (2, n, m)).astype("int64")
    shape = (2, n, 8) if from_matmul else (2, n, k)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            scores = x
            if from_matmul:
                keys = relax.const(rng.standard_normal((2, 8, k)).astype("float32"))
                scores = bb.emit(relax.op.matmul(x, keys))
            out = bb.emit_output(relax.op.gather_elements(scores, relax.const(idx), axis=-1))
        bb.emit_func_output(out)
    return bb.get(), rng.standard_normal(shape).astype("float32")


@pytest.mark.parametrize(
    "n, m, k, c, s, from_matmul",
    [
        (8, 8, 32, 16, 1, True),
        (8, 8, 32, 16, -1, True),
        (6, 4, 20, 9, 1, False),
        (5, 7, 16, 7, 1, True),
        (4, 6, 12, 8, -1, True),
    ],
)
def test_a_diagonal_gather_becomes_a_shear_and_picks_the_same_elements(n, m, k, c, s, from_matmul):
    mod, x = _relative_scores(n, m, k, c, s, from_matmul)
    sheared = normalise(mod)
    assert "relax.gather_elements" not in _ops(sheared)
    np.testing.assert_array_equal(_run(sheared, x), _run(mod, x))
    if from_matmul:  # the keys keep only the n + m - 1 columns the index reads
        (keys,) = [
            a
            for b in main_bindings(sheared["main"])
            if _op_name(b.value) == "relax.matmul"
            for a in b.value.args[1:]
        ]
        assert keys.value.numpy().shape[-1] == n + m - 1


def test_other_gathers_stay():
    assert relative_shear.diagonal(np.array([[0, 1], [1, 2]])) is None  # j + i: not a shear
    assert (
        relative_shear.diagonal(np.array([[[2, 3], [1, 2]], [[2, 3], [2, 3]]])) is None
    )  # planes differ
    assert relative_shear.diagonal(np.array([[5, 6, 7], [4, 5, 6]])) == (5, 1)
    assert relative_shear.diagonal(np.array([[5, 4], [6, 5]])) == (5, -1)
    mod, _ = _relative_scores(
        6, 4, 20, 9, -1, from_matmul=False
    )  # descending, no matmul to fold into
    assert "relax.gather_elements" in _ops(normalise(mod))
    mod, _ = _relative_scores(8, 8, 12, 4, 1, from_matmul=True)  # the index leaves the scores
    assert "relax.gather_elements" in _ops(normalise(mod))


def _op_name(value) -> str | None:
    return (
        value.op.name if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) else None
    )


# --------------------------------------------------------------------------- waveform convolutions


def _waveform(
    k: int, s: int, padding: int = 0, channels: int = 1, constant: bool = True
) -> tvm.IRModule:
    """wav2vec2's first layer: a strided conv1d over a raw signal, then a bias."""
    rng = np.random.default_rng(k * 10 + s)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, channels, 203), "float32"))
    params = [x]
    w = relax.const(rng.standard_normal((6, channels, k)).astype("float32"))
    if not constant:
        w = relax.Var("w", relax.TensorType((6, channels, k), "float32"))
        params.append(w)
    with bb.function("main", params):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv1d(x, w, strides=s, padding=padding))
            out = bb.emit_output(
                relax.op.add(y, relax.const(rng.standard_normal((1, 6, 1)).astype("float32")))
            )
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("k, s", [(10, 5), (3, 3), (4, 2), (9, 3)])
def test_a_waveform_convolution_becomes_a_matmul_over_frames_with_the_same_values(k, s):
    mod = _waveform(k, s)
    framed = normalise(mod)
    assert "relax.nn.conv1d" not in _ops(framed) and "relax.matmul" in _ops(framed)
    x = np.random.default_rng(1).standard_normal((2, 1, 203)).astype("float32")
    np.testing.assert_allclose(_run(framed, x), _run(mod, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(k=10, s=5, padding=1),
        dict(k=10, s=4),
        dict(k=10, s=5, channels=2),
        dict(k=10, s=5, constant=False),
        dict(k=3, s=1),
    ],
)
def test_other_convolutions_stay(kwargs):
    assert "relax.nn.conv1d" in _ops(normalise(_waveform(**kwargs)))
