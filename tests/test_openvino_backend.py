"""The OpenVINO backend: ops and regions against TVM, whole models under plans, the dtype
policy of ``accepts``, f32 precision, and kernel I/O (zero-copy, rebinding, copy fallback)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import openvino as ov
import pytest
import tvm
from tvm import relax
from tvm.relax import op as O

import partune.backends.openvino_backend as ovb
from partune.backends import registry
from partune.backends.base import BackendError, FusionStyle, Level
from partune.backends.openvino_backend import OpenVinoBackend, OvRegionKernel
from partune.backends.tvm_backend import TvmBackend
from partune.bench import max_abs_error
from partune.core.plan import Plan, Region
from partune.core.scopes import CompilationConfig, SEScope
from partune.runners.builder import build_plan, region_request
from partune.runners.worker import handle
from partune.search.candidates import accepted_nodes, backend_plan
from tests.regions import first_binding, one_op, run_region

SCOPE = SEScope("cpu", 0, {"kind": "llvm"}, "global", "openvino")
TVM_SCOPE = SEScope("cpu", 0, {"kind": "llvm"}, "global", "tvm")
CONFIG = CompilationConfig.for_cpu(["torch", "onnxruntime", "openvino"])
TOL = 1e-4  # whole models: relative to the output's scale


@pytest.fixture(scope="module")
def backend() -> OpenVinoBackend:
    return OpenVinoBackend()


@pytest.fixture(scope="module")
def reference() -> TvmBackend:
    return TvmBackend()


def _assert_matches(got: list[np.ndarray], want: list[np.ndarray], rtol: float = 1e-5) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        if w.dtype.kind in "biu":
            np.testing.assert_array_equal(g, w)
        else:
            scale = max(1.0, float(np.abs(w.astype(np.float64)).max(initial=0.0)))
            np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * scale)


def test_backend_identity(backend: OpenVinoBackend) -> None:
    assert backend.name == "openvino"
    assert backend.level is Level.COMPILER
    assert backend.fusion_style is FusionStyle.ARBITRARY
    assert backend.device_types == ("cpu",)
    assert backend.codegen == "partune_openvino"
    assert isinstance(registry.get("openvino"), OpenVinoBackend)


def test_compiled_model_runs_in_f32_on_one_thread(backend: OpenVinoBackend) -> None:
    """Read the properties back: the AMX default (bf16) would silently change results."""
    kernel = backend.build_region(
        one_op([((4, 8), "float32"), ((8, 3), "float32")], O.matmul), SCOPE, 1
    )
    compiled = kernel.compiled
    assert compiled.get_property("INFERENCE_PRECISION_HINT") == ov.Type.f32
    assert compiled.get_property("EXECUTION_MODE_HINT") == ov.properties.hint.ExecutionMode.ACCURACY
    # One thread, Partune's default. (Asking for 2 gets 1 once another library in the
    # process has set up its thread pool first, so only the default is asserted.)
    assert compiled.get_property("INFERENCE_NUM_THREADS") == 1
    assert compiled.get_property("NUM_STREAMS") == 1
    assert compiled.get_property("ENABLE_CPU_PINNING") is False
    assert compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE") == 0


def test_set_threads_sets_the_core_default(backend: OpenVinoBackend) -> None:
    core = ovb.openvino_core()
    try:
        backend.set_threads(2)
        assert core.get_property("CPU", "INFERENCE_NUM_THREADS") == 2
    finally:
        backend.set_threads(1)
    assert core.get_property("CPU", "INFERENCE_NUM_THREADS") == 1


_RNG = np.random.default_rng(3)


def _randn(*shape: int) -> np.ndarray:
    return _RNG.standard_normal(shape).astype("float32")


_I64 = np.array([2**62 + 7, -(2**40) - 3, 2**31 + 1, -5], "int64")
_I32 = np.array([2**31 - 1, -(2**31), 2**30 + 3, -7], "int32")
_I8 = np.array([[127, -128, 5], [-1, 0, -128]], "int8")

# Ops (and dtype edge cases the policy accepts) against TVM: (params, body, inputs).
OPS: dict[str, tuple[list, Callable[..., relax.Expr], list[np.ndarray]]] = {
    "conv2d grouped strided": (
        [((1, 4, 9, 9), "float32"), ((6, 2, 3, 3), "float32")],
        lambda x, w: O.nn.conv2d(x, w, strides=2, padding=1, groups=2),
        [_randn(1, 4, 9, 9), _randn(6, 2, 3, 3)],
    ),
    "matmul batched": (
        [((2, 5, 8), "float32"), ((8, 3), "float32")],
        O.matmul,
        [_randn(2, 5, 8), _randn(8, 3)],
    ),
    "softmax": ([((3, 7), "float32")], lambda x: O.nn.softmax(x, -1), [_randn(3, 7) * 5]),
    "log_softmax": ([((3, 7), "float32")], lambda x: O.nn.log_softmax(x, 0), [_randn(3, 7)]),
    "layer_norm": (
        [((2, 3, 8), "float32"), ((8,), "float32"), ((8,), "float32")],
        lambda x, g, b: O.nn.layer_norm(x, g, b, [-1]),
        [_randn(2, 3, 8), _randn(8), _randn(8)],
    ),
    "gelu": ([((4, 9), "float32")], O.nn.gelu, [_randn(4, 9) * 3]),
    "gelu_tanh": ([((4, 9), "float32")], O.nn.gelu_tanh, [_randn(4, 9) * 3]),
    "silu": ([((4, 9), "float32")], O.nn.silu, [_randn(4, 9) * 3]),
    "erf exp rsqrt": ([((4, 9), "float32")], lambda x: O.rsqrt(O.exp(O.erf(x))), [_randn(4, 9)]),
    "batch_norm tuple": (
        [((1, 3, 5, 5), "float32")] + [((3,), "float32")] * 4,
        lambda x, g, b, m, v: O.nn.batch_norm(x, g, b, m, v, 1, training=False),
        [_randn(1, 3, 5, 5), _randn(3), _randn(3), _randn(3), np.abs(_randn(3)) + 0.5],
    ),
    "max_pool ceil": (
        [((1, 2, 8, 8), "float32")],
        lambda x: O.nn.max_pool2d(x, 3, 2, padding=1, ceil_mode=True),
        [_randn(1, 2, 8, 8)],
    ),
    "avg_pool no pad count": (
        [((1, 2, 7, 7), "float32")],
        lambda x: O.nn.avg_pool2d(x, 3, 2, padding=1, count_include_pad=False),
        [_randn(1, 2, 7, 7)],
    ),
    "adaptive pool 1x1": (
        [((1, 3, 6, 6), "float32")],
        lambda x: O.nn.adaptive_avg_pool2d(x, 1),
        [_randn(1, 3, 6, 6)],
    ),
    "mean keepdims": (
        [((2, 3, 4), "float32")],
        lambda x: O.mean(x, [1, 2], keepdims=True),
        [_randn(2, 3, 4)],
    ),
    "pad reflect": (
        [((2, 7), "float32")],
        lambda x: O.nn.pad(x, [1, 0, 2, 3], pad_mode="reflect"),
        [_randn(2, 7)],
    ),
    "strided_slice negative step": (
        [((4, 7), "float32")],
        lambda x: O.strided_slice(x, [0, 1], [-1, 100], [-100, -100], [-1, -3]),
        [_randn(4, 7)],
    ),
    "split uneven": ([((2, 7), "float32")], lambda x: O.split(x, 3, axis=1), [_randn(2, 7)]),
    "cumsum exclusive": (
        [((2, 7), "float32")],
        lambda x: O.cumsum(x, 1, exclusive=True),
        [_randn(2, 7)],
    ),
    "where bool": (
        [((2, 3), "bool"), ((2, 3), "float32"), ((1, 3), "float32")],
        O.where,
        [_RNG.integers(0, 2, (2, 3)).astype(bool), _randn(2, 3), _randn(1, 3)],
    ),
    "float16 add": (
        [((3, 4), "float16")] * 2,
        O.add,
        [_randn(3, 4).astype("float16"), _randn(3, 4).astype("float16")],
    ),
    # dtype edge cases: accepted only because the plugin is exact on them
    "take int64 indices": (
        [((5, 3), "float32"), ((4,), "int64")],
        lambda x, i: O.take(x, i, 0),
        [_randn(5, 3), np.array([4, 0, 2, 4], "int64")],
    ),
    "index_tensor int64": (
        [((5, 3), "float32"), ((2, 1), "int64"), ((3,), "int64")],
        lambda x, i, j: O.index_tensor(x, relax.Tuple([i, j])),
        [_randn(5, 3), np.array([[4], [1]]), np.array([0, 2, 1])],
    ),
    "gather_elements int64": (
        [((3, 4), "float32"), ((3, 2), "int64")],
        lambda x, i: O.gather_elements(x, i, axis=1),
        [_randn(3, 4), np.array([[3, 0], [1, 1], [2, 3]], "int64")],
    ),
    "astype int64->int32 wraps": ([((4,), "int64")], lambda x: O.astype(x, "int32"), [_I64]),
    "astype int64->float32": ([((4,), "int64")], lambda x: O.astype(x, "float32"), [_I64]),
    "int32 extremes maximum": ([((4,), "int32")] * 2, O.maximum, [_I32, _I32[::-1].copy()]),
    "int32 extremes less": ([((4,), "int32")] * 2, O.less, [_I32, _I32 - np.int32(1)]),
    "int32 extremes concat": (
        [((4,), "int32")] * 2,
        lambda a, b: O.concat([a, b]),
        [_I32, _I32[::-1].copy()],
    ),
    "int8 max reduction": ([((2, 3), "int8")], lambda x: O.max(x, 1), [_I8]),
    "int8 to bool": ([((2, 3), "int8")], lambda x: O.astype(x, "bool"), [_I8]),
}


@pytest.mark.parametrize("case", list(OPS))
def test_op_matches_tvm(backend: OpenVinoBackend, reference: TvmBackend, case: str) -> None:
    params, body, inputs = OPS[case]
    func = one_op(params, body)
    assert backend.accepts(first_binding(func))
    want = run_region(reference, TVM_SCOPE, func, *inputs)
    _assert_matches(run_region(backend, SCOPE, func, *inputs), want)


REFUSED: dict[str, tuple[list, Callable[..., relax.Expr]]] = {
    "int8 add saturates": ([((4,), "int8")] * 2, O.add),
    "int32 multiply": ([((4,), "int32")] * 2, O.multiply),
    "int32 sum in f32": ([((4,), "int32")], lambda x: O.sum(x)),
    "int32 max reduction in f32": ([((4,), "int32")], lambda x: O.max(x)),
    "int64 reshape narrows": ([((4,), "int64")], lambda x: O.reshape(x, (2, 2))),
    "int64 comparison narrows": ([((4,), "int64")] * 2, O.less),
    "float64 runs in f32": ([((4,), "float64")] * 2, O.multiply),
    "uint32": ([((4,), "uint32")] * 2, O.maximum),
    "float to bool (NaN)": ([((4,), "float32")], lambda x: O.astype(x, "bool")),
    "int32 to bool": ([((4,), "int32")], lambda x: O.astype(x, "bool")),
    "logical_and of floats": ([((4,), "float32")] * 2, O.logical_and),
    "conv2d NHWC (no translation)": (
        [((1, 8, 8, 3), "float32"), ((4, 3, 3, 3), "float32")],
        lambda x, w: O.nn.conv2d(x, w, data_layout="NHWC"),
    ),
    "unsupported op": ([((1, 4, 2, 8), "float32")] * 3, O.nn.attention),
    "bfloat16": ([((4,), "bfloat16")] * 2, O.add),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refuses_what_it_cannot_do_exactly(backend: OpenVinoBackend, case: str) -> None:
    params, body = REFUSED[case]
    assert not backend.accepts(first_binding(one_op(params, body)))


def test_refuses_structural_int64_and_accepts_other_structure(backend: OpenVinoBackend) -> None:
    ty = relax.TensorType((2, 3), "float32")
    x, y = relax.Var("x", ty), relax.Var("y", ty)
    tup = relax.Var("t", relax.TupleType([ty, ty]))
    for value in (
        x,
        relax.Tuple([x, y]),
        relax.TupleGetItem(tup, 1),
        relax.const(np.ones((2, 3), "float32")),
    ):
        assert backend.accepts(relax.VarBinding(relax.Var("v", value.ty), value))
    big = relax.const(np.ones((2, 3), "int64"), "int64")
    assert not backend.accepts(relax.VarBinding(relax.Var("v", big.ty), big))


def test_compile_probe_is_consulted_and_cached(
    backend: OpenVinoBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A binding the ONNX probe takes is still refused when OpenVINO cannot compile it."""
    calls: list[int] = []

    def failing(model, threads):
        calls.append(threads)
        raise BackendError("no kernel")

    monkeypatch.setattr(ovb, "_ACCEPT_CACHE", {})
    monkeypatch.setattr(ovb, "compile_onnx", failing)
    binding = first_binding(one_op([((3, 5, 7), "float32")], O.nn.relu))
    assert not backend.accepts(binding)
    assert not backend.accepts(first_binding(one_op([((3, 5, 7), "float32")], O.nn.relu)))
    assert calls == [1]  # one compile per op signature


def test_probe_takes_weights_as_inputs() -> None:
    """The compile probe needs the weight's type, not its values (embeddings are 100s of MB)."""
    func = one_op(
        [((1, 3, 8, 8), "float32")], lambda x: O.nn.conv2d(x, relax.const(_randn(8, 3, 3, 3)))
    )
    probe = ovb.one_binding_function(first_binding(func))
    assert [[int(d) for d in p.ty.shape.values] for p in probe.params] == [
        [1, 3, 8, 8],
        [8, 3, 3, 3],
    ]


def test_region_with_tuple_outputs(backend: OpenVinoBackend) -> None:
    """Nested tuple results, a passthrough input, an unused input, one value returned twice."""
    ty = relax.TensorType((2, 3), "float32")
    x, y, unused = relax.Var("x", ty), relax.Var("y", ty), relax.Var("u", ty)
    bb = relax.BlockBuilder()
    with bb.function("main", [x, unused, y]):
        with bb.dataflow():
            s = bb.emit(O.add(x, y))
            r = bb.emit(O.nn.relu(s))
            gv = bb.emit_output(relax.Tuple([s, relax.Tuple([r, x]), s]))
        bb.emit_func_output(gv)
    a, u, b = _RNG.standard_normal((3, 2, 3)).astype("float32")
    got = run_region(backend, SCOPE, bb.get()["main"], a, u, b)
    for g, want in zip(got, [a + b, np.maximum(a + b, 0), a, a + b], strict=True):
        np.testing.assert_array_equal(g, want)


def test_constant_outputs(backend: OpenVinoBackend) -> None:
    """Results OpenVINO folds to constants are still written to the destinations."""
    x = relax.Var("x", relax.TensorType((2, 3), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            z = bb.emit(O.zeros((2, 3), "float32"))
            a = bb.emit(O.arange(0, 6, 1, "float32"))
            c = bb.emit(relax.const(np.full((2, 3), 7, "float32")))
            gv = bb.emit_output(relax.Tuple([z, a, c, O.add(c, c)]))
        bb.emit_func_output(gv)
    func = bb.get()["main"]
    assert all(backend.accepts(b) for b in func.body.blocks[0].bindings)
    got = run_region(backend, SCOPE, func, np.ones((2, 3), "float32"))
    for g, want in zip(
        got, [np.zeros((2, 3)), np.arange(6), np.full((2, 3), 7), np.full((2, 3), 14)], strict=True
    ):
        np.testing.assert_array_equal(g, want.astype("float32"))


def test_conv_bn_relu_region_with_weights(backend: OpenVinoBackend, reference: TvmBackend) -> None:
    """A region as the search lifts it: weights are constants, several ops, one output."""
    w, gamma, beta = _randn(8, 3, 3, 3), _randn(8), _randn(8)
    mean, var = _randn(8), np.abs(_randn(8)) + 0.5
    x = relax.Var("x", relax.TensorType((1, 3, 10, 10), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            c = bb.emit(O.nn.conv2d(x, relax.const(w), padding=1))
            bn = bb.emit(
                O.nn.batch_norm(
                    c, *(relax.const(v) for v in (gamma, beta, mean, var)), axis=1, training=False
                )
            )
            r = bb.emit(O.nn.relu(bb.emit(relax.TupleGetItem(bn, 0))))
            gv = bb.emit_output(O.nn.max_pool2d(r, 2, 2))
        bb.emit_func_output(gv)
    func = bb.get()["main"]
    inp = _randn(1, 3, 10, 10)
    _assert_matches(
        run_region(backend, SCOPE, func, inp), run_region(reference, TVM_SCOPE, func, inp)
    )


def test_inlines_composite_functions(backend: OpenVinoBackend, reference: TvmBackend) -> None:
    """A region as BYOC hands it over: calls to local composite functions."""
    from tvm.relax.dpl import is_op, wildcard

    func = one_op(
        [((1, 3, 6, 6), "float32")],
        lambda x: O.nn.relu(O.nn.conv2d(x, relax.const(_randn(2, 3, 3, 3)), padding=1)),
    )
    pattern = is_op("relax.nn.relu")(is_op("relax.nn.conv2d")(wildcard(), wildcard()))
    mod = tvm.IRModule({"main": func})
    mod = relax.transform.FuseOpsByPattern([("partune_openvino.cr", pattern)])(mod)
    mod = relax.transform.MergeCompositeFunctions()(mod)
    region = next(
        f
        for _, f in mod.functions.items()
        if isinstance(f, relax.Function) and f.attrs is not None and "Codegen" in f.attrs
    )
    x = _randn(1, 3, 6, 6)
    _assert_matches(
        run_region(backend, SCOPE, region, x), run_region(reference, TVM_SCOPE, func, x)
    )


def test_kernel_binds_in_place_rebinds_and_validates(
    backend: OpenVinoBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernel = backend.build_region(
        one_op([((4,), "float32"), ((4,), "float32")], O.multiply), SCOPE, 1
    )
    assert isinstance(kernel, OvRegionKernel)
    binds: list[tuple] = []
    bind = kernel._bind
    monkeypatch.setattr(kernel, "_bind", lambda args, key: binds.append(key) or bind(args, key))
    sets = [
        [tvm.runtime.tensor(np.full(4, v, "float32")) for v in (k + 2.0, 3.0, 0.0)]
        for k in range(2)
    ]
    for _ in range(3):  # later rounds hit the cached bindings
        for k, (x, y, out) in enumerate(sets):
            x.copyfrom(np.full(4, k + 2.0, "float32"))
            kernel(x, y, out)
            np.testing.assert_array_equal(out.numpy(), np.full(4, (k + 2.0) * 3.0))
    assert len(binds) == 2  # one setup per buffer set, none on repeated calls
    assert kernel.zero_copy
    fresh = [tvm.runtime.tensor(np.full(4, 5.0, "float32")) for _ in range(3)]
    kernel(*fresh)
    np.testing.assert_array_equal(fresh[2].numpy(), np.full(4, 25.0))
    with pytest.raises(BackendError):
        kernel(*fresh[:2])
    with pytest.raises(BackendError):
        kernel(*fresh[:2], tvm.runtime.tensor(np.zeros(5, "float32")))
    with pytest.raises(BackendError):
        kernel(*fresh[:2], tvm.runtime.tensor(np.zeros(4, "int32")))


def test_kernel_falls_back_to_copying(
    backend: OpenVinoBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    func = one_op([((2, 3), "float32"), ((3,), "float32")], O.subtract)
    kernel = backend.build_region(func, SCOPE, 1)

    def refuse(*_):
        raise RuntimeError("cannot share")

    monkeypatch.setattr(kernel, "bind_zero_copy", refuse)
    a, b = _randn(2, 3), _randn(3)
    args = [
        tvm.runtime.tensor(a),
        tvm.runtime.tensor(b),
        tvm.runtime.tensor(np.zeros((2, 3), "f4")),
    ]
    for _ in range(2):
        kernel(*args)
        np.testing.assert_array_equal(args[2].numpy(), a - b)
    assert not kernel.zero_copy


def test_region_measures_in_the_worker() -> None:
    from tests.conftest import load_model

    model = load_model("resnet50-small")
    req = region_request(
        model.mod,
        model.graph,
        tuple(range(6)),
        CONFIG.scope_for("openvino"),
        {"warmup": 1, "warmup_ms": 1.0, "repeat": 2, "min_repeat_ms": 1.0},
    )
    reply = handle(req)
    assert reply.measurement.error is None, reply.trace
    assert 0 < reply.measurement.median_s < 1


def _scale(model) -> float:
    return max(1.0, max(float(np.abs(r).max()) for r in model.reference))


@pytest.mark.parametrize("name", ["bert", "resnet"])
def test_single_backend_plan_matches_reference(request: pytest.FixtureRequest, name: str) -> None:
    model = request.getfixturevalue(name)
    assert accepted_nodes(model.mod["main"], "openvino") == set(range(len(model.graph)))
    plan = backend_plan(model.name, model.mod, model.graph, CONFIG, "openvino")
    assert {r.scope.backend for r in plan.regions} == {"openvino"}
    out = build_plan(plan, model.mod, model.graph)(model.inputs)
    assert max_abs_error(out, model.reference) < TOL * _scale(model)


@pytest.mark.parametrize("name", ["bert", "resnet"])
def test_mixed_plan_with_all_four_backends(request: pytest.FixtureRequest, name: str) -> None:
    """Regions rotate tvm -> torch -> onnxruntime -> openvino (a region openvino refuses
    stays on tvm), so every kind of boundary between the backends is crossed."""
    model = request.getfixturevalue(name)
    order = ["tvm", "torch", "onnxruntime", "openvino"]
    ok = {b: accepted_nodes(model.mod["main"], b) for b in order[1:]}
    n, size = len(model.graph), 7
    regions = []
    for i, start in enumerate(range(0, n, size)):
        nodes = tuple(range(start, min(start + size, n)))
        backend = order[i % len(order)]
        if backend != "tvm" and not set(nodes) <= ok[backend]:
            backend = "tvm"
        regions.append(Region(nodes, CONFIG.scope_for(backend)))
    plan = Plan(model.name, model.graph.fingerprint, CONFIG, tuple(regions))
    built = build_plan(plan, model.mod, model.graph)
    codegens = {
        f.attrs["Codegen"]
        for _, f in built.module.functions.items()
        if f.attrs is not None and "Codegen" in f.attrs
    }
    assert codegens == {"partune_torch", "partune_onnxruntime", "partune_openvino"}
    assert max_abs_error(built(model.inputs), model.reference) < TOL * _scale(model)
