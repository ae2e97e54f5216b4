"""The ONNX Runtime backend: whole zoo models against torch, op semantics, refusals, kernel I/O."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np
import onnx
import pytest
import torch
import tvm
from tvm import relax
from tvm.relax import op as O

from partune.backends.base import BackendError, FusionStyle, Level
from partune.backends.onnxruntime_backend import OnnxRuntimeBackend, make_session
from partune.backends.relax_onnx import relax_to_onnx
from partune.core.scopes import SEScope
from tests.regions import SMALL_ZOO, first_binding, one_op, run_region, tensor_types, zoo_mains

SCOPE = SEScope("cpu", 0, {"kind": "llvm"}, "global", "onnxruntime")
TOL = 1e-4  # relative to the output's scale


@pytest.fixture(scope="module")
def zoo():
    return zoo_mains()


@pytest.fixture(scope="module")
def backend() -> OnnxRuntimeBackend:
    return OnnxRuntimeBackend()


def _run(
    backend: OnnxRuntimeBackend, func: relax.Function, *inputs: np.ndarray
) -> list[np.ndarray]:
    return run_region(backend, SCOPE, func, *inputs)


def test_backend_identity(backend: OnnxRuntimeBackend) -> None:
    assert backend.name == "onnxruntime"
    assert backend.level is Level.COMPILER
    assert backend.fusion_style is FusionStyle.ARBITRARY
    assert backend.device_types == ("cpu",)
    assert backend.codegen == "partune_onnxruntime"


@pytest.mark.parametrize("name", SMALL_ZOO)
def test_zoo_model_matches_torch(zoo, backend: OnnxRuntimeBackend, name: str) -> None:
    func, inputs, ref = zoo[name]
    (got,) = _run(backend, func, *(x.numpy() for x in inputs))
    scale = float(np.abs(ref).max())
    np.testing.assert_allclose(got, ref, rtol=TOL, atol=TOL * scale)


@pytest.mark.parametrize("name", SMALL_ZOO)
def test_zoo_every_binding_accepted(zoo, backend: OnnxRuntimeBackend, name: str) -> None:
    func = zoo[name][0]
    refused = [
        str(b.value)[:120]
        for blk in func.body.blocks
        for b in blk.bindings
        if not backend.accepts(b)
    ]
    assert refused == []


def test_relax_to_onnx_passes_checker(zoo) -> None:
    func = zoo["bert-small"][0]
    model = relax_to_onnx(func)
    onnx.checker.check_model(model, full_check=True)
    assert [i.name for i in model.graph.input] == [p.name for p in func.params]
    assert len(model.graph.output) == len(tensor_types(func.ret_ty))
    assert len(model.graph.initializer) > 0
    assert model.opset_import[0].version == 17
    with pytest.raises(BackendError):
        relax_to_onnx(func, opset=13)


REFUSED: dict[str, tuple[list, Callable[..., relax.Expr]]] = {
    "conv2d NHWC": (
        [((1, 8, 8, 3), "float32"), ((4, 3, 3, 3), "float32")],
        lambda x, w: O.nn.conv2d(x, w, data_layout="NHWC"),
    ),
    "batch_norm training": (
        [((1, 3, 4, 4), "float32")] + [((3,), "float32")] * 4,
        lambda x, g, b, m, v: O.nn.batch_norm(x, g, b, m, v, axis=1, training=True),
    ),
    "layer_norm no affine": (
        [((2, 4), "float32"), ((4,), "float32"), ((4,), "float32")],
        lambda x, g, b: O.nn.layer_norm(x, g, b, [-1], center=False),
    ),
    "layer_norm inner axis": (
        [((2, 3, 4), "float32"), ((3,), "float32"), ((3,), "float32")],
        lambda x, g, b: O.nn.layer_norm(x, g, b, [1]),
    ),
    "take nan mode": (
        [((5, 3), "float32"), ((2,), "int64")],
        lambda x, i: O.take(x, i, 0, mode="nan"),
    ),
    "uneven adaptive pool": ([((1, 2, 7, 7), "float32")], lambda x: O.nn.adaptive_avg_pool2d(x, 3)),
    "unsupported op": ([((1, 4, 2, 8), "float32")] * 3, O.nn.attention),
    "bfloat16": ([((4,), "bfloat16")] * 2, O.add),
    "integer mean": ([((2, 3), "int32")], lambda x: O.mean(x, 1)),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refuses_what_it_cannot_do(backend: OnnxRuntimeBackend, case: str) -> None:
    params, body = REFUSED[case]
    func = one_op(params, body)
    assert not backend.accepts(first_binding(func))
    with pytest.raises(BackendError):
        relax_to_onnx(func)


def test_refuses_dynamic_shapes(backend: OnnxRuntimeBackend) -> None:
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n, 4), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            gv = bb.emit_output(bb.emit(O.nn.relu(x)))
        bb.emit_func_output(gv)
    func = bb.get()["main"]
    assert not backend.accepts(first_binding(func))
    with pytest.raises(BackendError):
        relax_to_onnx(func)


def test_accepts_structural_bindings(backend: OnnxRuntimeBackend) -> None:
    ty = relax.TensorType((2, 3), "float32")
    x, y = relax.Var("x", ty), relax.Var("y", ty)
    tup = relax.Var("t", relax.TupleType([ty, ty]))
    const = relax.const(np.ones((2, 3), "float32"))
    for value in (x, relax.Tuple([x, y]), relax.TupleGetItem(tup, 1), const):
        assert backend.accepts(relax.VarBinding(relax.Var("v", value.ty), value))
    shape = relax.ShapeExpr([2, 3])
    assert not backend.accepts(relax.VarBinding(relax.Var("s", shape.ty), shape))


def test_two_output_region(backend: OnnxRuntimeBackend) -> None:
    """Nested tuple results, a passthrough input, and one value returned twice."""
    ty = relax.TensorType((2, 3), "float32")
    x, y = relax.Var("x", ty), relax.Var("y", ty)
    bb = relax.BlockBuilder()
    with bb.function("main", [x, y]):
        with bb.dataflow():
            s = bb.emit(O.add(x, y))
            r = bb.emit(O.nn.relu(s))
            gv = bb.emit_output(relax.Tuple([s, relax.Tuple([r, x]), s]))
        bb.emit_func_output(gv)
    func = bb.get()["main"]
    a, b = np.random.default_rng(0).standard_normal((2, 2, 3)).astype("float32")
    got = _run(backend, func, a, b)
    for g, want in zip(got, [a + b, np.maximum(a + b, 0), a, a + b], strict=True):
        np.testing.assert_array_equal(g, want)


def test_kernel_rebinds_new_buffers_and_validates(backend: OnnxRuntimeBackend) -> None:
    func = one_op([((4,), "float32"), ((4,), "float32")], O.multiply)
    kernel = backend.build_region(func, SCOPE, 1)
    sets = [
        [tvm.runtime.tensor(np.full(4, v, "float32")) for v in (k + 2.0, 3.0, 0.0)]
        for k in range(2)
    ]
    for _ in range(2):  # second round hits the cached bindings
        for k, (x, y, out) in enumerate(sets):
            kernel(x, y, out)
            np.testing.assert_array_equal(out.numpy(), np.full(4, (k + 2.0) * 3.0))
    fresh = [tvm.runtime.tensor(np.full(4, 5.0, "float32")) for _ in range(3)]
    kernel(*fresh)
    np.testing.assert_array_equal(fresh[2].numpy(), np.full(4, 25.0))
    assert kernel.zero_copy
    with pytest.raises(BackendError):
        kernel(*fresh[:2])
    with pytest.raises(BackendError):
        kernel(*fresh[:2], tvm.runtime.tensor(np.zeros(5, "float32")))


def test_inlines_composite_functions(backend: OnnxRuntimeBackend) -> None:
    """A region as BYOC hands it over: calls to local composite functions."""
    from tvm.relax.dpl import is_op, wildcard

    func = one_op(
        [((1, 3, 6, 6), "float32")],
        lambda x: O.nn.relu(
            O.nn.conv2d(x, relax.const(np.ones((2, 3, 3, 3), "float32")), padding=1)
        ),
    )
    pattern = is_op("relax.nn.relu")(is_op("relax.nn.conv2d")(wildcard(), wildcard()))
    mod = tvm.IRModule({"main": func})
    mod = relax.transform.FuseOpsByPattern([("partune_onnxruntime.cr", pattern)])(mod)
    mod = relax.transform.MergeCompositeFunctions()(mod)
    region = next(
        f
        for _, f in mod.functions.items()
        if isinstance(f, relax.Function) and f.attrs is not None and "Codegen" in f.attrs
    )
    x = np.random.default_rng(0).standard_normal((1, 3, 6, 6)).astype("float32")
    (got,) = _run(backend, region, x)
    want = torch.relu(
        torch.nn.functional.conv2d(torch.from_numpy(x), torch.ones(2, 3, 3, 3), padding=1)
    )
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)


_RNG = np.random.default_rng(1)
_X = _RNG.standard_normal((2, 7)).astype("float32")
_IMG = _RNG.standard_normal((1, 2, 8, 8)).astype("float32")
_MASK = np.array([[True, False, True, True, False]])
_SEQ = _RNG.standard_normal((1, 4, 11)).astype("float32")
_W1 = _RNG.standard_normal((6, 2, 3)).astype("float32")
_W1T = _RNG.standard_normal((4, 3, 3)).astype("float32")
_W2 = _RNG.standard_normal((2, 3, 3, 3)).astype("float32")

SEMANTICS: dict[
    str, tuple[list, Callable[..., relax.Expr], list[np.ndarray], Callable[..., list]]
] = {
    "take wrap": (
        [((2, 7), "float32"), ((3,), "int64")],
        lambda x, i: O.take(x, i, 1, mode="wrap"),
        [_X, np.array([-1, 8, 2])],
        lambda x, i: [np.take(x, i, 1, mode="wrap")],
    ),
    "take clip": (
        [((2, 7), "float32"), ((3,), "int32")],
        lambda x, i: O.take(x, i, 1, mode="clip"),
        [_X, np.array([-4, 9, 2], "int32")],
        lambda x, i: [np.take(x, i, 1, mode="clip")],
    ),
    "strided_slice negative step": (
        [((2, 7), "float32")],
        lambda x: O.strided_slice(x, [0, 1], [-1, 100], [-100, -100], [-1, -3]),
        [_X],
        lambda x: [x[::-1, ::-3]],
    ),
    "pad reflect": (
        [((2, 7), "float32")],
        lambda x: O.nn.pad(x, [1, 0, 2, 3], pad_mode="reflect"),
        [_X],
        lambda x: [np.pad(x, [(1, 0), (2, 3)], mode="reflect")],
    ),
    "pad replicate": (
        [((2, 7), "float32")],
        lambda x: O.nn.pad(x, [0, 1, 3, 0], pad_mode="replicate"),
        [_X],
        lambda x: [np.pad(x, [(0, 1), (3, 0)], mode="edge")],
    ),
    "split uneven": (
        [((2, 7), "float32")],
        lambda x: O.split(x, 3, axis=1),
        [_X],
        lambda x: [x[:, :3], x[:, 3:6], x[:, 6:]],
    ),
    "index_tensor broadcast": (
        [((2, 7), "float32"), ((2, 1), "int64"), ((3,), "int32")],
        lambda x, i, j: O.index_tensor(x, relax.Tuple([i, j])),
        [_X, np.array([[1], [0]]), np.array([0, 6, 2], "int32")],
        lambda x, i, j: [x[i, j]],
    ),
    "cumsum exclusive flat": (
        [((2, 7), "float32")],
        lambda x: O.cumsum(x, None, exclusive=True),
        [_X],
        lambda x: [np.concatenate([[0], np.cumsum(x)[:-1]])],
    ),
    "cumsum bool to int64": (
        [((1, 5), "bool")],
        lambda m: O.cumsum(m, 1, dtype="int64"),
        [_MASK],
        lambda m: [np.cumsum(m, 1)],
    ),
    "adaptive pool 2x2": (
        [((1, 2, 8, 8), "float32")],
        lambda x: O.nn.adaptive_avg_pool2d(x, 2),
        [_IMG],
        lambda x: [x.reshape(1, 2, 2, 4, 2, 4).mean((3, 5))],
    ),
    "max_pool ceil": (
        [((1, 2, 8, 8), "float32")],
        lambda x: O.nn.max_pool2d(x, 3, 2, padding=1, ceil_mode=True),
        [_IMG],
        lambda x: [
            torch.nn.functional.max_pool2d(torch.from_numpy(x), 3, 2, 1, ceil_mode=True).numpy()
        ],
    ),
    "gelu_tanh": (
        [((2, 7), "float32")],
        O.nn.gelu_tanh,
        [_X],
        lambda x: [torch.nn.functional.gelu(torch.from_numpy(x), approximate="tanh").numpy()],
    ),
    "batch_norm tuple": (
        [((1, 2, 8, 8), "float32")] + [((2,), "float32")] * 4,
        lambda x, g, b, m, v: O.nn.batch_norm(x, g, b, m, v, axis=1, training=False),
        [_IMG, *np.array([[1.5, 0.5], [0.1, -0.2], [0.3, 0.0], [2.0, 0.5]], "float32")],
        lambda x, g, b, m, v: [
            (x - m[:, None, None]) / np.sqrt(v[:, None, None] + 1e-5) * g[:, None, None]
            + b[:, None, None],
            m,
            v,
        ],
    ),
    "full from a tensor": (
        [((), "float32")],
        lambda v: O.full((2, 3), v, "int32"),
        [np.array(2.7, "float32")],
        lambda v: [np.full((2, 3), 2, "int32")],
    ),
    "conv1d strided grouped": (
        [((1, 4, 11), "float32"), ((6, 2, 3), "float32")],
        lambda x, w: O.nn.conv1d(x, w, strides=2, padding=(1, 2), dilation=2, groups=2),
        [_SEQ, _W1],
        lambda x, w: [
            torch.nn.functional.conv1d(
                torch.nn.functional.pad(torch.from_numpy(x), (1, 2)),
                torch.from_numpy(w),
                stride=2,
                dilation=2,
                groups=2,
            ).numpy()
        ],
    ),
    "conv2d_transpose": (
        [((1, 2, 8, 8), "float32"), ((2, 3, 3, 3), "float32")],
        lambda x, w: O.nn.conv2d_transpose(x, w, strides=2, padding=1, output_padding=1),
        [_IMG, _W2],
        lambda x, w: [
            torch.nn.functional.conv_transpose2d(
                torch.from_numpy(x), torch.from_numpy(w), stride=2, padding=1, output_padding=1
            ).numpy()
        ],
    ),
    "conv1d_transpose grouped": (
        [((1, 4, 11), "float32"), ((4, 3, 3), "float32")],
        lambda x, w: O.nn.conv1d_transpose(x, w, strides=2, groups=2),
        [_SEQ, _W1T],
        lambda x, w: [
            torch.nn.functional.conv_transpose1d(
                torch.from_numpy(x), torch.from_numpy(w), stride=2, groups=2
            ).numpy()
        ],
    ),
    "variance": (
        [((1, 2, 8, 8), "float32")],
        lambda x: O.variance(x, [2, 3], keepdims=True),
        [_IMG],
        lambda x: [x.var((2, 3), keepdims=True)],
    ),
    "gather_elements": (
        [((2, 7), "float32"), ((2, 3), "int64")],
        lambda x, i: O.gather_elements(x, i, axis=1),
        [_X, np.array([[0, 6, 2], [1, 1, 5]])],
        lambda x, i: [np.take_along_axis(x, i, 1)],
    ),
}


@pytest.mark.parametrize("case", list(SEMANTICS))
def test_op_semantics(backend: OnnxRuntimeBackend, case: str) -> None:
    params, body, inputs, reference = SEMANTICS[case]
    func = one_op(params, body)
    assert backend.accepts(first_binding(func))
    got = _run(backend, func, *inputs)
    for g, want in zip(got, reference(*inputs), strict=True):
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)


def _audio_front_end() -> relax.Function:
    """A Whisper-style encoder front end as the ONNX import gives it: two conv1d (bias added
    after), exact GELU, then tokens-major for the transformer that follows."""
    rng = np.random.default_rng(2)

    def const(*shape: int) -> relax.Constant:
        return relax.const(rng.standard_normal(shape).astype("float32") / np.sqrt(shape[-1]))

    mel = relax.Var("mel", relax.TensorType((1, 8, 40), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [mel]):
        with bb.dataflow():
            x = bb.emit(O.nn.conv1d(mel, const(16, 8, 3), padding=1))
            x = bb.emit(O.nn.gelu(O.add(x, const(1, 16, 1))))
            x = bb.emit(O.nn.conv1d(x, const(16, 16, 3), strides=2, padding=1))
            x = bb.emit(O.nn.gelu(O.add(x, const(1, 16, 1))))
            gv = bb.emit_output(bb.emit(O.permute_dims(x, [0, 2, 1])))
        bb.emit_func_output(gv)
    return bb.get()["main"]


def test_conv1d_front_end_is_one_region_of_conv_nodes(backend: OnnxRuntimeBackend) -> None:
    """conv1d once had no translation: the onnxruntime-only plan of a Whisper encoder ran its
    two convs on untuned TVM (6.7x onnxruntime on the user's file). Each conv1d must be
    accepted and become one Conv node, not a reshape to 2-D, a Pad or a MatMul."""
    func = _audio_front_end()
    assert all(backend.accepts(b) for blk in func.body.blocks for b in blk.bindings)
    model = relax_to_onnx(func)
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["Conv"] == 2 and not ops.keys() & {"Pad", "MatMul", "Unsqueeze", "Squeeze"}
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    assert [[a.ints for a in c.attribute if a.name == "kernel_shape"][0] for c in convs] == [
        [3],
        [3],
    ]
    x = np.random.default_rng(3).standard_normal((1, 8, 40)).astype("float32")
    (got,) = _run(backend, func, x)
    ex = tvm.compile(tvm.IRModule({"main": func}), tvm.target.Target({"kind": "llvm"}))
    want = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_sessions_leave_out_skip_layer_norm_fusion(tmp_path) -> None:
    """ORT's SkipLayerNormalization CPU kernel is several times slower than Add +
    LayerNormalization; the static graphs the translator emits would get it."""
    h = 32
    ty = relax.TensorType((1, 16, h), "float32")
    x, r = relax.Var("x", ty), relax.Var("r", ty)
    gamma, beta = relax.const(np.ones(h, "float32")), relax.const(np.zeros(h, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, r]):
        with bb.dataflow():
            gv = bb.emit_output(bb.emit(O.nn.layer_norm(O.add(x, r), gamma, beta, [-1])))
        bb.emit_func_output(gv)
    model = relax_to_onnx(bb.get()["main"])
    saved = str(tmp_path / "optimized.onnx")
    make_session(model, 1, saved)
    ops = Counter(n.op_type for n in onnx.load(saved).graph.node)
    assert ops["SkipLayerNormalization"] == 0 and ops["LayerNormalization"] == 1
