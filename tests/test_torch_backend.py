"""The torch backend: whole zoo models against eager torch, op semantics against TVM's own
build, peephole composites, refusals, kernel I/O and the exported composite patterns."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
import tvm
from tvm import relax
from tvm.relax import op as O

from partune.backends.base import BackendError, FusionStyle, Level
from partune.backends.torch_backend import TorchBackend
from partune.backends.torch_patterns import PATTERNS
from partune.core.scopes import SEScope
from tests.regions import SMALL_ZOO, run_region, zoo_mains

SCOPE = SEScope("cpu", 0, {"kind": "llvm"}, "global", "torch")
TOL = 1e-4  # relative to the output's scale
RNG = np.random.default_rng(0)


@pytest.fixture(scope="module")
def zoo():
    return zoo_mains()


@pytest.fixture(scope="module")
def backend() -> TorchBackend:
    return TorchBackend()


# --------------------------------------------------------------------------- helpers


def run(backend: TorchBackend, func: relax.Function, *inputs: np.ndarray) -> list[np.ndarray]:
    return run_region(backend, SCOPE, func, *inputs)


def run_tvm(func: relax.Function, *inputs: np.ndarray) -> list[np.ndarray]:
    """The reference: TVM's own (legalised, untuned) build of the same function."""
    ex = tvm.compile(tvm.IRModule({"main": func}), target=tvm.target.Target({"kind": "llvm"}))
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(x) for x in inputs])
    return [out.numpy()] if hasattr(out, "numpy") else [o.numpy() for o in out]


def function(
    params: list[tuple[tuple[int, ...], str]], body: Callable[..., relax.Expr]
) -> relax.Function:
    """A one-block Relax function over fresh parameters; ``body`` may emit bindings itself."""
    bb = relax.BlockBuilder()
    xs = [relax.Var(f"x{i}", relax.TensorType(s, d)) for i, (s, d) in enumerate(params)]
    with bb.function("main", xs):
        with bb.dataflow():
            out = body(bb, *xs)
            out = bb.emit_output(out)
        bb.emit_func_output(out)
    return bb.get()["main"]


def op_function(
    params: list[tuple[tuple[int, ...], str]], make: Callable[..., relax.Expr]
) -> relax.Function:
    return function(params, lambda bb, *xs: make(*xs))


def sample(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    if dtype == "bool":
        return RNG.random(shape) > 0.5
    if dtype.startswith("int"):
        return RNG.integers(-5, 6, shape).astype(dtype)
    return RNG.standard_normal(shape).astype(dtype)


def const(a: object, dtype: str = "float32") -> relax.Expr:
    return relax.const(np.asarray(a, dtype=dtype))


def bindings(func: relax.Function) -> list[relax.Binding]:
    return [b for block in func.body.blocks for b in block.bindings]


# --------------------------------------------------------------------------- whole models


def test_backend_description(backend: TorchBackend) -> None:
    assert backend.name == "torch" and backend.level is Level.LIBRARY
    assert backend.fusion_style is FusionStyle.NONE
    assert backend.device_types == ("cpu", "cuda")
    assert backend.codegen == "partune_torch"


@pytest.mark.parametrize("name", SMALL_ZOO)
def test_zoo_model_matches_eager(backend: TorchBackend, zoo: dict, name: str) -> None:
    func, inputs, ref = zoo[name]
    (got,) = run(backend, func, *[x.numpy() for x in inputs])
    assert got.shape == ref.shape
    scale = max(float(np.abs(ref).max()), 1.0)
    assert float(np.abs(got - ref).max()) <= TOL * scale


@pytest.mark.parametrize("name", SMALL_ZOO)
def test_zoo_every_binding_accepted(backend: TorchBackend, zoo: dict, name: str) -> None:
    func = zoo[name][0]
    refused = {b.var.name: backend.why_not(b) for b in bindings(func) if not backend.accepts(b)}
    assert refused == {}


def test_peepholes_shrink_the_program(backend: TorchBackend, zoo: dict) -> None:
    """Composites and constant folding leave far fewer steps than bindings."""
    for name in ("resnet50-small", "bert-small"):
        func = zoo[name][0]
        kernel = backend.build_region(func, SCOPE, 1)
        assert kernel.num_steps < 0.7 * len(bindings(func))


# --------------------------------------------------------------------------- single ops vs TVM

ParamList = list[tuple[tuple[int, ...], str]]
OP_CASES: list[tuple[str, ParamList, Callable[..., relax.Expr]]] = [
    ("divide_int_truncates", [((8,), "int32"), ((8,), "int32")], O.divide),
    ("floor_divide_int", [((8,), "int32"), ((8,), "int32")], O.floor_divide),
    ("floor_mod_int", [((8,), "int32"), ((8,), "int32")], O.floor_mod),
    ("power", [((2, 3), "float32")], lambda x: O.power(x, const(3.0))),
    (
        "strided_slice_clamps",
        [((4, 6, 5), "float32")],
        lambda x: O.strided_slice(x, [1], [-3], [100], [2]),
    ),
    (
        "strided_slice_two_axes",
        [((4, 6, 5), "float32")],
        lambda x: O.strided_slice(x, [0, 2], [1, -4], [3, -1]),
    ),
    (
        "take_axis1_int32",
        [((5, 3), "float32"), ((2, 2), "int32")],
        lambda x, i: O.take(x, i, axis=1),
    ),
    ("split_sections_uneven", [((2, 7), "float32")], lambda x: O.split(x, 3, axis=1)),
    ("split_indices", [((2, 9), "float32")], lambda x: O.split(x, [2, 5], axis=-1)),
    (
        "max_pool_ceil",
        [((1, 2, 8, 8), "float32")],
        lambda x: O.nn.max_pool2d(x, 3, 2, 1, ceil_mode=True),
    ),
    (
        "avg_pool_ceil_incl",
        [((1, 2, 7, 7), "float32")],
        lambda x: O.nn.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=True),
    ),
    ("avg_pool_excl", [((1, 2, 7, 7), "float32")], lambda x: O.nn.avg_pool2d(x, 3, 2, 1)),
    (
        "adaptive_avg_pool_uneven",
        [((1, 2, 5, 7), "float32")],
        lambda x: O.nn.adaptive_avg_pool2d(x, (3, 4)),
    ),
    (
        "conv_asymmetric_pad",
        [((1, 3, 7, 7), "float32")],
        lambda x: O.nn.conv2d(x, const(RNG.random((4, 3, 3, 3))), strides=2, padding=(0, 1, 1, 2)),
    ),
    (
        "conv_depthwise_dilated",
        [((1, 4, 9, 9), "float32")],
        lambda x: O.nn.conv2d(x, const(RNG.random((4, 1, 3, 3))), padding=2, dilation=2, groups=4),
    ),
    (
        "batch_norm_tuple",
        [((2, 3, 4, 4), "float32")],
        lambda x: O.nn.batch_norm(
            x,
            const(RNG.random(3) + 0.5),
            const(RNG.random(3)),
            const(RNG.random(3)),
            const(RNG.random(3) + 0.5),
            axis=1,
            center=False,
            training=False,
        ),
    ),
    (
        "layer_norm_two_axes",
        [((2, 3, 4), "float32")],
        lambda x: O.nn.layer_norm(
            x, const(RNG.random((3, 4))), const(RNG.random((3, 4))), [-2, -1]
        ),
    ),
    ("cumsum_exclusive", [((2, 6), "int32")], lambda x: O.cumsum(x, axis=1, exclusive=True)),
    ("cumsum_bool_to_int64", [((2, 6), "bool")], lambda x: O.cumsum(x, axis=-1, dtype="int64")),
    ("sum_int8_keeps_dtype", [((2, 60), "int8")], lambda x: O.sum(x, axis=[1])),
    ("mean_two_axes", [((2, 6, 3), "float32")], lambda x: O.mean(x, axis=[-1, 0], keepdims=True)),
    ("pad_int_value", [((2, 3), "int32")], lambda x: O.nn.pad(x, (1, 0, 0, 2), pad_value=7)),
    ("gelu_tanh", [((2, 6), "float32")], O.nn.gelu_tanh),
    ("clip_int", [((2, 6), "int32")], lambda x: O.clip(x, -2, 3)),
    ("astype_to_bool", [((2, 6), "float32")], lambda x: O.astype(x, "bool")),
    ("where_broadcast", [((2, 1), "bool"), ((1, 6), "float32"), ((2, 6), "float32")], O.where),
    (
        "index_tensor",
        [((5, 4, 3), "float32")],
        lambda x: O.index_tensor(
            x, relax.Tuple([const([[0, 1, 4], [2, 3, 0]], "int64"), const([[0, 3, 1]], "int64")])
        ),
    ),
    (
        "matmul_out_dtype",
        [((3, 4), "float16"), ((4, 5), "float16")],
        lambda a, b: O.matmul(a, b, out_dtype="float32"),
    ),
    ("matmul_vector", [((4,), "float32"), ((2, 4, 5), "float32")], O.matmul),
    ("arange_float", [((1,), "float32")], lambda x: O.arange(0.0, 1.0, 0.3, dtype="float32")),
    ("full_casts", [((1,), "float32")], lambda x: O.full((2, 3), const(2.7), dtype="int32")),
    (
        "expand_dims_squeeze",
        [((2, 1, 3), "float32")],
        lambda x: O.expand_dims(O.squeeze(x, [1]), [-1, 0]),
    ),
    (
        "concat",
        [((2, 3), "float32"), ((2, 1), "float32")],
        lambda a, b: O.concat(relax.Tuple([a, b]), axis=-1),
    ),
    (
        "unary_float_chain",
        [((3, 5), "float32")],
        lambda x: O.abs(
            O.negative(
                O.log(
                    O.nn.gelu(
                        O.nn.silu(O.rsqrt(O.sqrt(O.exp(O.erf(O.tanh(O.sigmoid(O.nn.relu(x))))))))
                    )
                )
            )
        ),
    ),
    (
        "compare_and_logic",
        [((3, 5), "float32"), ((3, 5), "float32")],
        lambda a, b: O.where(
            O.logical_xor(
                O.logical_or(O.less(a, b), O.greater_equal(a, b)),
                O.logical_and(O.greater(a, b), O.bitwise_or(O.not_equal(a, b), O.less_equal(a, b))),
            ),
            O.maximum(a, b),
            O.minimum(a, b),
        ),
    ),
    (
        "reductions",
        [((3, 4, 5), "float32")],
        lambda x: O.add(
            O.add(O.max(x, axis=[1]), O.min(x, axis=[1])),
            O.add(O.sum(x, axis=[1]), O.prod(x, axis=[1])),
        ),
    ),
    (
        "softmaxes",
        [((3, 5), "float32")],
        lambda x: O.add(O.nn.softmax(x, axis=0), O.nn.log_softmax(x)),
    ),
    (
        "shape_ops",
        [((2, 1, 3), "float32")],
        lambda x: O.flatten(O.permute_dims(O.broadcast_to(O.squeeze(x), (4, 2, 3)))),
    ),
    (
        "creation",
        [((2, 3), "float32")],
        lambda x: O.add(
            O.add(O.zeros((2, 3), "float32"), O.ones_like(x)),
            O.add(O.zeros_like(x), O.ones((3,), "float32")),
        ),
    ),
]


SIGNED = [
    np.array([7, -7, 7, -7, 1, 0, 5, -3], "int32"),
    np.array([2, 2, -2, -2, 3, 1, 5, 4], "int32"),
]
SPECIAL_INPUTS: dict[str, list[np.ndarray]] = {
    "divide_int_truncates": SIGNED,  # signs matter, zero divisors do not
    "floor_divide_int": SIGNED,
    "floor_mod_int": SIGNED,
    "take_axis1_int32": [sample((5, 3), "float32"), np.array([[0, 2], [1, 2]], "int32")],
}


@pytest.mark.parametrize("case", OP_CASES, ids=[c[0] for c in OP_CASES])
def test_op_matches_tvm(backend: TorchBackend, case: tuple) -> None:
    name, params, make = case
    func = op_function(params, make)
    assert all(backend.accepts(b) for b in bindings(func))
    inputs = SPECIAL_INPUTS.get(name) or [sample(s, d) for s, d in params]
    for got, ref in zip(run(backend, func, *inputs), run_tvm(func, *inputs), strict=True):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        np.testing.assert_allclose(
            got.astype("float64"), ref.astype("float64"), rtol=1e-3, atol=1e-5
        )


def test_take_modes(backend: TorchBackend) -> None:
    """'clip' clamps and 'wrap' wraps out-of-range indices, as TVM does."""
    x, idx = sample((5, 3), "float32"), np.array([[0, 7, -1, 2], [3, -6, 0, 11]])
    for mode in ("clip", "wrap"):
        func = op_function(
            [((5, 3), "float32"), ((2, 4), "int64")],
            lambda a, i, m=mode: O.take(a, i, axis=0, mode=m),
        )
        np.testing.assert_allclose(run(backend, func, x, idx)[0], run_tvm(func, x, idx)[0])


def test_bool_cumsum_means_any_so_far(backend: TorchBackend) -> None:
    """TVM cannot build cumsum with a bool result (GPT-2 has one); here it is a running OR."""
    func = op_function([((2, 5), "bool")], lambda x: O.cumsum(x, axis=1))
    x = np.array([[0, 1, 0, 1, 0], [0, 0, 0, 0, 0]], dtype=bool)
    (got,) = run(backend, func, x)
    np.testing.assert_array_equal(got, np.cumsum(x, axis=1) > 0)


# --------------------------------------------------------------------------- peepholes vs TVM


def conv_block(bb: relax.BlockBuilder, x: relax.Var, r: relax.Var) -> relax.Var:
    """pad -> conv -> bias -> scale -> batch norm -> residual add -> relu: one fused step."""
    p = bb.emit(O.nn.pad(x, (0, 0, 0, 0, 1, 1, 1, 1)))
    c = bb.emit(O.nn.conv2d(p, const(RNG.standard_normal((4, 3, 3, 3)) * 0.3)))
    b = bb.emit(O.add(const(RNG.standard_normal((1, 4, 1, 1))), c))
    b = bb.emit(O.multiply(b, const(RNG.random((4, 1, 1)) + 0.5)))
    n = bb.emit(
        O.nn.batch_norm(
            b,
            const(RNG.random(4) + 0.5),
            const(RNG.random(4)),
            const(RNG.random(4)),
            const(RNG.random(4) + 0.5),
            axis=1,
            epsilon=1e-3,
            training=False,
        )
    )
    y = bb.emit(relax.TupleGetItem(n, 0))
    return bb.emit(O.nn.relu(bb.emit(O.add(y, r))))


def linear_block(bb: relax.BlockBuilder, x: relax.Var) -> relax.Var:
    """reshape -> matmul(W^T const) -> bias -> reshape -> layer scale -> gelu -> clip."""
    h = bb.emit(O.reshape(x, (6, 8)))
    w = bb.emit(O.permute_dims(const(RNG.standard_normal((5, 8))), [1, 0]))
    m = bb.emit(O.matmul(h, w))
    b = bb.emit(O.add(const(RNG.standard_normal(5)), m))
    r = bb.emit(O.reshape(b, (2, 3, 5)))
    s = bb.emit(O.multiply(const(RNG.random(5) + 0.5), r))
    g = bb.emit(O.nn.gelu(s))
    return bb.emit(O.clip(g, -0.5, 0.5))


def safe_softmax_block(bb: relax.BlockBuilder, a: relax.Var) -> relax.Var:
    """torch's exported _safe_softmax: rows that are all -inf give zeros."""
    s = bb.emit(O.nn.softmax(a, axis=-1))
    e = bb.emit(O.equal(a, const(float("-inf"))))
    n = bb.emit(O.logical_not(e))
    i = bb.emit(O.astype(n, "int8"))
    m = bb.emit(O.max(i, axis=[-1], keepdims=True))
    b = bb.emit(O.astype(m, "bool"))
    nb = bb.emit(O.logical_not(b))
    z = bb.emit(O.full_like(s, const(0.0)))
    return bb.emit(O.where(nb, z, s))


def test_conv_chain_is_one_step_and_exact(backend: TorchBackend) -> None:
    func = function([((1, 3, 6, 6), "float32"), ((1, 4, 6, 6), "float32")], conv_block)
    assert backend.build_region(func, SCOPE, 1).num_steps == 1
    x, r = sample((1, 3, 6, 6), "float32"), sample((1, 4, 6, 6), "float32")
    np.testing.assert_allclose(
        run(backend, func, x, r)[0], run_tvm(func, x, r)[0], rtol=1e-4, atol=1e-5
    )


def test_linear_chain_is_one_step_and_exact(backend: TorchBackend) -> None:
    func = function([((2, 3, 8), "float32")], linear_block)
    assert (
        backend.build_region(func, SCOPE, 1).num_steps == 2
    )  # the input reshape, then one fused step
    x = sample((2, 3, 8), "float32")
    np.testing.assert_allclose(run(backend, func, x)[0], run_tvm(func, x)[0], rtol=1e-4, atol=1e-5)


def test_safe_softmax_is_one_step_and_zeroes_masked_rows(backend: TorchBackend) -> None:
    func = function([((2, 3, 4), "float32")], safe_softmax_block)
    assert backend.build_region(func, SCOPE, 1).num_steps == 1
    a = sample((2, 3, 4), "float32")
    a[0, 1, :] = -np.inf
    a[1, 2, :2] = -np.inf
    (got,) = run(backend, func, a)
    np.testing.assert_allclose(got, run_tvm(func, a)[0], rtol=1e-5, atol=1e-6)
    assert np.all(got[0, 1] == 0)


def test_safe_softmax_whose_mask_is_also_read_stays_unfused_and_exact(
    backend: TorchBackend,
) -> None:
    """The DPL match needs every value inside to be read only inside: a mask read outside
    (here returned) keeps the nine steps apart."""

    def leaking(bb: relax.BlockBuilder, a: relax.Var) -> relax.Expr:
        s = bb.emit(O.nn.softmax(a, axis=-1))
        e = bb.emit(O.equal(a, const(float("-inf"))))
        n = bb.emit(O.logical_not(e))
        i = bb.emit(O.astype(n, "int8"))
        m = bb.emit(O.max(i, axis=[-1], keepdims=True))
        nb = bb.emit(O.logical_not(bb.emit(O.astype(m, "bool"))))
        z = bb.emit(O.full_like(s, const(0.0)))
        return bb.emit(relax.Tuple([bb.emit(O.where(nb, z, s)), nb]))

    func = function([((2, 3, 4), "float32")], leaking)
    assert backend.build_region(func, SCOPE, 1).num_steps > 1
    a = sample((2, 3, 4), "float32")
    a[0, 1, :] = -np.inf
    for got, ref in zip(run(backend, func, a), run_tvm(func, a), strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_chain_stops_where_an_intermediate_escapes(backend: TorchBackend) -> None:
    """A conv result that is also returned cannot be absorbed into its bias add."""

    def body(bb: relax.BlockBuilder, x: relax.Var) -> relax.Expr:
        c = bb.emit(O.nn.conv2d(x, const(RNG.standard_normal((2, 3, 1, 1)))))
        y = bb.emit(O.nn.relu(bb.emit(O.add(c, const(RNG.standard_normal((1, 2, 1, 1)))))))
        return bb.emit(relax.Tuple([c, y]))

    func = function([((1, 3, 4, 4), "float32")], body)
    x = sample((1, 3, 4, 4), "float32")
    for got, ref in zip(run(backend, func, x), run_tvm(func, x), strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_constants_fold_at_build_time(backend: TorchBackend) -> None:
    """Sub-expressions of constants only (masks, position ids) cost nothing per call."""

    def body(bb: relax.BlockBuilder, x: relax.Var) -> relax.Expr:
        pos = bb.emit(O.astype(O.arange(0, 4, 1, dtype="int64"), "float32"))
        return O.add(x, bb.emit(O.multiply(pos, const(2.0))))

    func = function([((3, 4), "float32")], body)
    assert backend.build_region(func, SCOPE, 1).num_steps == 1
    x = sample((3, 4), "float32")
    np.testing.assert_allclose(run(backend, func, x)[0], x + 2 * np.arange(4))


# --------------------------------------------------------------------------- kernel I/O


def test_tuple_outputs_are_flattened_in_order(backend: TorchBackend) -> None:
    def body(bb: relax.BlockBuilder, x: relax.Var) -> relax.Expr:
        parts = bb.emit(O.split(x, 2, axis=1))
        return bb.emit(relax.Tuple([parts, bb.emit(O.nn.relu(x)), x]))

    func = function([((2, 4), "float32")], body)
    x = sample((2, 4), "float32")
    got = run(backend, func, x)
    for g, r in zip(got, [x[:, :2], x[:, 2:], np.maximum(x, 0), x], strict=True):
        np.testing.assert_array_equal(g, r)


def test_kernel_checks_argument_count(backend: TorchBackend) -> None:
    kernel = backend.build_region(op_function([((2,), "float32")], O.exp), SCOPE, 1)
    with pytest.raises(BackendError):
        kernel(tvm.runtime.tensor(np.ones(2, "float32")))


def test_kernel_errors_are_backend_errors(backend: TorchBackend) -> None:
    """An index out of range ('fast' mode does not check it) surfaces as a BackendError."""
    func = op_function([((5, 3), "float32"), ((2,), "int64")], lambda x, i: O.take(x, i, axis=0))
    kernel = backend.build_region(func, SCOPE, 1)
    out = tvm.runtime.tensor(np.zeros((2, 3), "float32"))
    with pytest.raises(BackendError):
        kernel(
            tvm.runtime.tensor(sample((5, 3), "float32")), tvm.runtime.tensor(np.array([0, 9])), out
        )


def test_threads(backend: TorchBackend) -> None:
    before = torch.get_num_threads()
    try:
        backend.set_threads(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


# --------------------------------------------------------------------------- refusals

REFUSED: list[tuple[str, ParamList, Callable[..., relax.Expr]]] = [
    (
        "conv_nhwc",
        [((1, 7, 7, 3), "float32")],
        lambda x: O.nn.conv2d(
            x, const(np.ones((3, 3, 3, 4))), data_layout="NHWC", kernel_layout="HWIO"
        ),
    ),
    (
        "conv_out_dtype",
        [((1, 3, 7, 7), "float16")],
        lambda x: O.nn.conv2d(x, const(np.ones((4, 3, 3, 3)), "float16"), out_dtype="float32"),
    ),
    (
        "layer_norm_no_center",
        [((2, 4), "float32")],
        lambda x: O.nn.layer_norm(x, const(np.ones(4)), const(np.ones(4)), [-1], center=False),
    ),
    (
        "layer_norm_middle_axis",
        [((2, 3, 4), "float32")],
        lambda x: O.nn.layer_norm(x, const(np.ones(3)), const(np.ones(3)), [1]),
    ),
    (
        "batch_norm_training",
        [((2, 3, 4, 4), "float32")],
        lambda x: O.nn.batch_norm(x, *[const(np.ones(3))] * 4, axis=1, training=True),
    ),
    (
        "pad_reflect",
        [((1, 2, 3, 3), "float32")],
        lambda x: O.nn.pad(x, (0, 0, 0, 0, 1, 1, 1, 1), pad_mode="reflect"),
    ),
    (
        "max_pool_asymmetric",
        [((1, 2, 8, 8), "float32")],
        lambda x: O.nn.max_pool2d(x, 3, 2, (0, 0, 1, 1)),
    ),
    (
        "strided_slice_negative_stride",
        [((4, 6), "float32")],
        lambda x: O.strided_slice(x, [1], [4], [0], [-1]),
    ),
    ("strided_slice_empty", [((4, 6), "float32")], lambda x: O.strided_slice(x, [1], [5], [2])),
    ("uint32", [((3,), "uint32"), ((3,), "uint32")], O.add),
    ("integer_matmul", [((3, 4), "int32"), ((4, 5), "int32")], O.matmul),
    ("add_bool", [((3,), "bool"), ((3,), "bool")], O.add),
    ("unknown_op", [((3, 4), "float32")], lambda x: O.sort(x)),
]


@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_refuses(backend: TorchBackend, case: tuple) -> None:
    _, params, make = case
    func = op_function(params, make)
    (b,) = bindings(func)
    assert not backend.accepts(b) and backend.why_not(b)
    with pytest.raises(BackendError):
        backend.build_region(func, SCOPE, 1)


def test_refuses_symbolic_shapes(backend: TorchBackend) -> None:
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n, 4), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(O.nn.relu(x))
        bb.emit_func_output(y)
    (b,) = bindings(bb.get()["main"])
    assert not backend.accepts(b)


def test_refuses_match_cast(backend: TorchBackend) -> None:
    x = relax.Var("x", relax.TensorType((2, 4), "float32"))
    b = relax.MatchCast(
        relax.Var("y", relax.TensorType((2, 4), "float32")), x, relax.TensorType((2, 4), "float32")
    )
    assert not backend.accepts(b)


# --------------------------------------------------------------------------- patterns


def pattern_example(name: str) -> relax.Function:
    """The smallest function that the composite ``name`` describes."""
    parts = name.removeprefix("torch.").split("_")

    def body(bb: relax.BlockBuilder, x: relax.Var) -> relax.Expr:
        y: relax.Expr = x
        if parts[0] == "conv2d":
            y = bb.emit(O.nn.conv2d(y, const(np.ones((3, 3, 1, 1)))))
        elif parts[0] == "matmul":
            y = bb.emit(O.matmul(bb.emit(O.reshape(y, (9, 3))), const(np.ones((3, 3)))))
        elif parts[0] in ("batch", "layer", "softmax", "max", "avg", "adaptive"):
            return single_op_pattern(bb, "_".join(parts), y)
        for part in parts[1:]:
            if part == "bn":
                y = bb.emit(
                    relax.TupleGetItem(
                        bb.emit(
                            O.nn.batch_norm(y, *[const(np.ones(3))] * 4, axis=1, training=False)
                        ),
                        0,
                    )
                )
            elif part == "bias":  # constant first, as the torch importer emits it
                y = bb.emit(O.add(const(np.ones((1, 3, 1, 1) if parts[0] == "conv2d" else 3)), y))
            elif part == "clip":
                y = bb.emit(O.clip(y, 0, 6))
            elif part == "tanh":
                continue
            elif part == "gelu" and "tanh" in parts:
                y = bb.emit(O.nn.gelu_tanh(y))
            else:
                y = bb.emit({"relu": O.nn.relu, "gelu": O.nn.gelu, "silu": O.nn.silu}[part](y))
        return y

    return function([((1, 3, 3, 3), "float32")], body)


def single_op_pattern(bb: relax.BlockBuilder, name: str, x: relax.Var) -> relax.Expr:
    ones = const(np.ones(3))
    return {
        "batch_norm": lambda: bb.emit(
            relax.TupleGetItem(
                bb.emit(O.nn.batch_norm(x, ones, ones, ones, ones, axis=1, training=False)), 0
            )
        ),
        "layer_norm": lambda: O.nn.layer_norm(x, ones, ones, [-1]),
        "softmax": lambda: O.nn.softmax(x),
        "max_pool2d": lambda: O.nn.max_pool2d(x, 2),
        "avg_pool2d": lambda: O.nn.avg_pool2d(x, 2),
        "adaptive_avg_pool2d": lambda: O.nn.adaptive_avg_pool2d(x, 1),
    }[name]()


def composites(mod: tvm.IRModule, patterns: list) -> dict[str, list[relax.Function]]:
    """The composite functions FuseOpsByPattern cuts out of ``mod``, by pattern name."""
    fused = relax.transform.FuseOpsByPattern(patterns, bind_constants=True)(mod)
    out: dict[str, list[relax.Function]] = {}
    for _, f in fused.functions_items():
        if f.attrs is not None and "Composite" in f.attrs:
            out.setdefault(str(f.attrs["Composite"]), []).append(f)
    return out


@pytest.mark.parametrize("name,pattern", PATTERNS, ids=[n for n, _ in PATTERNS])
def test_pattern_matches_its_example(backend: TorchBackend, name: str, pattern: object) -> None:
    """Each pattern cuts a composite from its example, and that composite is one ATen step."""
    func = pattern_example(name)
    found = composites(tvm.IRModule({"main": func}), [(name, pattern)])
    assert list(found) == [name]
    (region,) = found[name]
    assert backend.build_region(region, SCOPE, 1).num_steps == 1


def test_patterns_are_unique_and_largest_first() -> None:
    names = [n for n, _ in PATTERNS]
    assert len(names) == len(set(names)) and all(n.startswith("torch.") for n in names)
    found = composites(tvm.IRModule({"main": pattern_example("torch.conv2d_bn_relu")}), PATTERNS)
    assert list(found) == ["torch.conv2d_bn_relu"]


def test_patterns_refuse_what_the_backend_refuses() -> None:
    """Layouts and training-mode batch norm are constrained in the patterns themselves."""
    nhwc = op_function(
        [((1, 7, 7, 3), "float32")],
        lambda x: O.nn.conv2d(
            x, const(np.ones((3, 3, 3, 4))), data_layout="NHWC", kernel_layout="HWIO"
        ),
    )
    train = op_function(
        [((1, 3, 4, 4), "float32")],
        lambda x: O.nn.batch_norm(x, *[const(np.ones(3))] * 4, axis=1, training=True),
    )
    for func in (nhwc, train):
        assert composites(tvm.IRModule({"main": func}), PATTERNS) == {}


def test_patterns_cut_zoo_models_into_one_step_regions(backend: TorchBackend, zoo: dict) -> None:
    """On real imports (W^T and (1, C, 1, 1) biases included) the composites are single steps
    and agree with TVM's own build."""
    seen = set()
    for name in ("resnet50-small", "mobilenet_v2-small", "convnext-small", "bert-small"):
        for pattern, funcs in composites(tvm.IRModule({"main": zoo[name][0]}), PATTERNS).items():
            for f in funcs:
                assert backend.build_region(f, SCOPE, 1).num_steps == 1, (name, pattern)
            if pattern in seen:
                continue
            seen.add(pattern)
            plain = relax.Function(funcs[0].params, funcs[0].body, funcs[0].ret_ty)
            inputs = [
                sample(tuple(int(d) for d in p.ty.shape.values), str(p.ty.dtype))
                for p in plain.params
            ]
            for got, ref in zip(run(backend, plain, *inputs), run_tvm(plain, *inputs), strict=True):
                np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4, err_msg=pattern)
    assert {
        "torch.conv2d_bn_relu",
        "torch.conv2d_bn_clip",
        "torch.conv2d_bn",
        "torch.conv2d_bias",
        "torch.matmul_bias",
        "torch.layer_norm",
        "torch.softmax",
    } <= seen


def test_every_pattern_region_builds(backend: TorchBackend) -> None:
    """Whatever a pattern selects, the backend can build and run."""
    x = sample((1, 3, 3, 3), "float32")
    for name, _ in PATTERNS:
        func = pattern_example(name)
        assert all(backend.accepts(b) for b in bindings(func)), name
        np.testing.assert_allclose(
            run(backend, func, x)[0], run_tvm(func, x)[0], rtol=1e-4, atol=1e-5, err_msg=name
        )
