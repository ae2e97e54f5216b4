"""Each import pass alone, before and after, structurally (as TVM tests its own passes); then
the pipeline: passes switched off by name, and the count each pass reports.

The numeric checks of the same rewrites (exact outputs, on models) are in
test_import_rewrites.py and test_models.py.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import tvm
from tvm import relax

from partune.frontend import pipeline
from partune.frontend.passes.bool_cumsum import CUMSUM_OF_BOOL
from partune.frontend.passes.exact_idioms import CAST_BEFORE_MOVES, FLOAT_TO_BOOL, TAKE_WRAP
from partune.frontend.passes.import_pass import ImportPass
from partune.frontend.passes.input_free import FOLD_INPUT_FREE
from partune.frontend.passes.relative_shear import RELATIVE_SHEARS
from partune.frontend.passes.softmax_guards import DROP_SOFTMAX_GUARDS
from partune.frontend.passes.waveform_frames import WAVEFORM_FRAMES
from partune.frontend.passes.whole_input_pool import WHOLE_INPUT_POOL

Body = Callable[[relax.BlockBuilder, list[relax.Var]], relax.Expr]


def _module(params: list[tuple[str, tuple[int, ...], str]], body: Body) -> tvm.IRModule:
    """``main(params)`` whose dataflow block ``body`` emits; it returns the output expression."""
    bb = relax.BlockBuilder()
    args = [relax.Var(n, relax.TensorType(s, d)) for n, s, d in params]
    with bb.function("main", args):
        with bb.dataflow():
            out = bb.emit_output(body(bb, args))
        bb.emit_func_output(out)
    return bb.get()


def _alone(p: ImportPass, mod: tvm.IRModule) -> tuple[tvm.IRModule, int]:
    """``p`` run by itself, as a TVM pass, and the places it says it rewrote."""
    counts: dict[str, int] = {}
    out = p.make(counts)(mod)
    return out, counts.get(p.name, 0)


def _check(p: ImportPass, params, before: Body, after: Body, rewrites: int = 1) -> None:
    """``p`` alone turns ``before`` into ``after``, once the code it left unused is gone (the
    pipeline's last pass, ``DeadCodeElimination``, removes it)."""
    out, n = _alone(p, _module(params, before))
    out = relax.transform.DeadCodeElimination(["main"])(out)
    tvm.ir.assert_structural_equal(out, _module(params, after))
    assert n == rewrites


def test_cumsum_of_bool_counts_in_int64():
    _check(
        CUMSUM_OF_BOOL,
        [("x", (4,), "bool")],
        lambda bb, a: relax.op.cumsum(a[0], axis=0),
        lambda bb, a: relax.op.cumsum(
            bb.emit(relax.op.astype(a[0], "int64")), axis=0, dtype="int64", exclusive=False
        ),
    )


def test_a_pool_over_the_whole_input_is_a_reduction():
    _check(
        WHOLE_INPUT_POOL,
        [("x", (1, 8, 7, 7), "float32")],
        lambda bb, a: relax.op.nn.avg_pool2d(a[0], pool_size=(7, 7)),
        lambda bb, a: relax.op.mean(a[0], axis=[2, 3], keepdims=True),
    )
    _check(
        WHOLE_INPUT_POOL,
        [("x", (1, 8, 7, 7), "float32")],
        lambda bb, a: relax.op.nn.max_pool2d(a[0], pool_size=(7, 7)),
        lambda bb, a: relax.op.max(a[0], axis=[2, 3], keepdims=True),
    )


def test_a_pool_with_a_smaller_window_is_left_alone():
    mod = _module(
        [("x", (1, 8, 7, 7), "float32")],
        lambda bb, a: relax.op.nn.avg_pool2d(a[0], pool_size=(3, 3)),
    )
    out, n = _alone(WHOLE_INPUT_POOL, mod)
    tvm.ir.assert_structural_equal(out, mod)
    assert n == 0


def test_an_int64_tensor_moved_then_cast_is_cast_first():
    _check(
        CAST_BEFORE_MOVES,
        [("m", (1, 8), "int64")],
        lambda bb, a: relax.op.astype(
            bb.emit(relax.op.reshape(bb.emit(relax.op.expand_dims(a[0], [1])), (1, 1, 1, 8))),
            "float32",
        ),
        # every step emitted, the last one too: the cast's var is bound to the last move's
        lambda bb, a: bb.emit(
            relax.op.reshape(
                bb.emit(relax.op.expand_dims(bb.emit(relax.op.astype(a[0], "float32")), [1])),
                (1, 1, 1, 8),
            )
        ),
    )


def test_a_float_cast_to_bool_is_a_compare_with_zero():
    _check(
        FLOAT_TO_BOOL,
        [("f", (4,), "float32")],
        lambda bb, a: relax.op.astype(a[0], "bool"),
        lambda bb, a: relax.op.logical_not(
            bb.emit(relax.op.equal(a[0], relax.const(0.0, "float32")))
        ),
    )


def test_an_int_cast_to_bool_is_left_alone():
    mod = _module([("i", (4,), "int32")], lambda bb, a: relax.op.astype(a[0], "bool"))
    assert _alone(FLOAT_TO_BOOL, mod)[1] == 0


def test_a_negative_index_wrap_is_a_wrapping_take():
    def before(bb, a):
        t, i = a
        negative = bb.emit(relax.op.less(i, relax.const(0, "int64")))
        shifted = bb.emit(relax.op.add(i, relax.const(5, "int64")))
        return relax.op.take(t, bb.emit(relax.op.where(negative, shifted, i)), axis=0)

    params = [("t", (5, 3), "float32"), ("i", (2,), "int64")]
    _check(TAKE_WRAP, params, before, lambda bb, a: relax.op.take(a[0], a[1], axis=0, mode="wrap"))
    wrong_n = _module(
        params,
        lambda bb, a: relax.op.take(
            a[0],
            bb.emit(
                relax.op.where(
                    bb.emit(relax.op.less(a[1], relax.const(0, "int64"))),
                    bb.emit(relax.op.add(a[1], relax.const(4, "int64"))),
                    a[1],
                )
            ),
            axis=0,
        ),
    )
    assert _alone(TAKE_WRAP, wrong_n)[1] == 0  # i + 4 on an axis of 5: not Gather's wrap


def test_input_free_work_becomes_a_constant():
    def before(bb, a):
        i = bb.emit(relax.op.arange(0, 4, 1, dtype="int64"))
        mask = bb.emit(relax.op.less_equal(i, bb.emit(relax.op.reshape(i, (4, 1)))))
        return relax.op.where(mask, a[0], relax.const(-1e9, "float32"))

    mask = np.arange(4)[None, :] <= np.arange(4)[:, None]
    _check(
        FOLD_INPUT_FREE,
        [("x", (4, 4), "float32")],
        before,
        lambda bb, a: relax.op.where(relax.const(mask), a[0], relax.const(-1e9, "float32")),
    )


def _guard(bb: relax.BlockBuilder, x: relax.Expr) -> relax.Expr:
    """The torch import's softmax guard, as it spells it."""
    is_inf = bb.emit(relax.op.equal(x, relax.const(-np.inf, "float32")))
    some = bb.emit(relax.op.astype(bb.emit(relax.op.logical_not(is_inf)), "int8"))
    row = bb.emit(relax.op.astype(bb.emit(relax.op.max(some, axis=[-1])), "bool"))
    return bb.emit(relax.op.logical_not(row))


def test_a_softmax_guard_that_cannot_fire_is_dropped():
    def guarded(bb, a):
        x = bb.emit(relax.op.tanh(a[0]))  # bounded: no row of -inf
        empty = _guard(bb, x)
        return relax.op.where(empty, relax.const(0.0, "float32"), bb.emit(relax.op.nn.softmax(x)))

    out, n = _alone(
        DROP_SOFTMAX_GUARDS, _module([("s", (4,), "float32")], guarded)
    )  # (and its DCE)
    want = _module(
        [("s", (4,), "float32")],
        lambda bb, a: bb.emit(relax.op.nn.softmax(bb.emit(relax.op.tanh(a[0])))),
    )
    tvm.ir.assert_structural_equal(out, want)
    assert n == 1


def test_a_softmax_guard_over_an_input_stays():
    def guarded(bb, a):
        return relax.op.where(
            _guard(bb, a[0]), relax.const(0.0, "float32"), bb.emit(relax.op.nn.softmax(a[0]))
        )

    assert _alone(DROP_SOFTMAX_GUARDS, _module([("s", (4,), "float32")], guarded))[1] == 0


def test_a_diagonal_gather_is_a_shear():
    idx = np.array([[1, 2], [0, 1]], dtype="int64")  # idx[i, j] = 1 + (j - i)

    def after(bb, a):
        kept = bb.emit(relax.op.strided_slice(a[0], [2], [0], [3]))  # the columns it reads: all 3
        flat = bb.emit(relax.op.reshape(kept, [1, 6]))
        window = bb.emit(relax.op.strided_slice(flat, [1], [1], [5]))
        rows = bb.emit(relax.op.reshape(window, [1, 2, 2]))
        return relax.op.strided_slice(rows, [2], [0], [2])

    _check(
        RELATIVE_SHEARS,
        [("a", (1, 2, 3), "float32")],
        lambda bb, a: relax.op.gather_elements(a[0], relax.const(idx[None]), axis=-1),
        after,
    )


def test_a_strided_one_channel_conv1d_is_a_matmul_over_frames():
    w = np.random.default_rng(0).standard_normal((2, 1, 4)).astype("float32")

    def after(bb, a):
        frames = bb.emit(
            relax.op.reshape(bb.emit(relax.op.strided_slice(a[0], [2], [0], [20])), [1, 10, 2])
        )
        parts = [bb.emit(relax.op.strided_slice(frames, [1], [j], [j + 9])) for j in range(2)]
        columns = bb.emit(relax.op.permute_dims(bb.emit(relax.op.concat(parts, axis=2)), [0, 2, 1]))
        return relax.op.matmul(relax.const(w.reshape(2, 4)), columns, out_dtype="float32")

    _check(
        WAVEFORM_FRAMES,
        [("x", (1, 1, 20), "float32")],
        lambda bb, a: relax.op.nn.conv1d(a[0], relax.const(w), strides=2, out_dtype="float32"),
        after,
    )


def test_every_pass_has_a_name_of_its_own_and_a_line_on_why():
    assert len(set(pipeline.NAMES)) == len(pipeline.PASSES)
    assert all(p.summary for p in pipeline.PASSES)
    listing = pipeline.describe_passes()
    assert [line.split()[0] for line in listing.splitlines()] == list(pipeline.NAMES)


def _pool_then_cast() -> tvm.IRModule:
    def body(bb, a):
        pooled = bb.emit(relax.op.nn.avg_pool2d(a[0], pool_size=(7, 7)))
        return relax.op.astype(pooled, "bool")

    return _module([("x", (1, 8, 7, 7), "float32")], body)


def test_a_disabled_pass_does_not_run_and_the_rest_do():
    out, runs = pipeline.normalise(_pool_then_cast(), disabled=["WholeInputPoolAsReduction"])
    by_name = {r.name: r for r in runs}
    assert (
        not by_name["WholeInputPoolAsReduction"].ran
        and by_name["FloatToBoolAsCompare"].rewrites == 1
    )
    ops = [b.value.op.name for block in out["main"].body.blocks for b in block.bindings]
    assert "relax.nn.avg_pool2d" in ops and "relax.astype" not in ops
    out, runs = pipeline.normalise(_pool_then_cast())
    ops = [b.value.op.name for block in out["main"].body.blocks for b in block.bindings]
    assert "relax.mean" in ops and all(r.ran for r in runs)


def test_with_every_pass_disabled_the_module_is_untouched():
    mod = _pool_then_cast()
    out, runs = pipeline.normalise(mod, disabled=pipeline.NAMES)
    tvm.ir.assert_structural_equal(out, mod)
    assert not any(r.ran for r in runs)
    assert "disabled" in pipeline.describe_runs(runs)


def test_an_unknown_pass_name_is_a_one_line_error():
    from partune.core.errors import PartuneError

    with pytest.raises(PartuneError, match="no import pass named Nope"):
        pipeline.normalise(_pool_then_cast(), disabled=["Nope"])


def test_compute_in_bf16_casts_matmul_operands_and_keeps_an_f32_result():
    from partune.core.bf16 import compute_in_bf16

    params = [("a", (2, 3), "float32"), ("b", (3, 4), "float32")]
    out = compute_in_bf16(
        _module(
            params,
            lambda bb, a: relax.op.add(bb.emit(relax.op.matmul(a[0], a[1])), relax.const(1.0)),
        )
    )
    want = _module(
        params,
        lambda bb, a: relax.op.add(
            bb.emit(
                relax.op.matmul(
                    bb.emit(relax.op.astype(a[0], "bfloat16")),
                    bb.emit(relax.op.astype(a[1], "bfloat16")),
                    out_dtype="float32",
                )
            ),
            relax.const(1.0),
        ),
    )
    tvm.ir.assert_structural_equal(out, want)
    assert compute_in_bf16.info.name == "ComputeInBf16"
