"""int8 regions: the QDQ rewrite alone (before/after), its error against f32 under the
libraries, the plan's calibrated ranges, and the order in which the repair hands regions back."""

import numpy as np
import pytest
import tvm
from tvm import relax

from partune.backends import relax_to_onnx
from partune.backends.onnxruntime_backend import make_session
from partune.core import Calibration, CompilationConfig, DataflowGraph, Plan, Region, plan_key
from partune.core.int8 import (
    INPUTS,
    INT8_LEVELS,
    PLACEHOLDER,
    activation_qparams,
    function_in_int8,
    quantize_int8,
    quantizes,
)
from partune.core.partition import apply
from partune.runners.accuracy import relative_error
from partune.search.int8_calibration import calibrated_tensors, ranges_over
from partune.search.precision import revert_order

RNG = np.random.default_rng(0)
W1 = (RNG.standard_normal((16, 32)) * 0.2).astype("float32")
W2 = (RNG.standard_normal((32, 8)) * 0.2).astype("float32")


def _mlp() -> relax.Function:
    """x @ W1 -> relu -> @ W2, and an activation-by-activation matmul (never quantized)."""
    x = relax.Var("x", relax.TensorType((4, 16), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            h = bb.emit(relax.op.matmul(x, relax.const(W1)), name_hint="h")
            r = bb.emit(relax.op.nn.relu(h), name_hint="r")
            y = bb.emit(relax.op.matmul(r, relax.const(W2)), name_hint="y")
            g = bb.emit(relax.op.matmul(y, relax.op.permute_dims(y)), name_hint="g")
            out = bb.emit_output(relax.Tuple([y, g]))
        bb.emit_func_output(out)
    return bb.get()["main"]


def _qdq(x: relax.Expr, rng) -> relax.Expr:
    scale, zero = activation_qparams(rng)
    s, z = relax.const(np.float32(scale)), relax.const(np.uint8(zero))
    return relax.op.dequantize(relax.op.quantize(x, s, z, axis=-1, out_dtype="uint8"), s, z)


def _dq_weight(w: np.ndarray, levels: int) -> relax.Expr:
    scale = (np.abs(w).max(axis=0) / levels).astype("float32")
    q = np.clip(np.round(w / scale), -levels, levels).astype("int8")
    return relax.op.dequantize(
        relax.const(q), relax.const(scale), relax.const(np.zeros(w.shape[1], "int8")), axis=1
    )


def test_quantizes_matmuls_and_convolutions_by_constant_weights_only():
    bindings = list(_mlp().body.blocks[0].bindings)
    assert [quantizes(b.value) for b in bindings] == [True, False, True, False, False, False]
    x = relax.Var("x", relax.TensorType((1, 3, 8, 8), "float32"))
    w = relax.const(np.ones((4, 3, 3, 3), "float32"))
    assert quantizes(relax.op.nn.conv2d(x, w))
    i = relax.Var("i", relax.TensorType((4, 16), "int32"))
    assert not quantizes(relax.op.matmul(i, relax.const(np.ones((16, 2), "int32"))))


def test_the_rewrite_before_and_after():
    """Each matmul by a constant reads a quantize-dequantize of its activation over the range
    given by name and an int8 weight per output channel, and its result is quantized too; the
    activation-by-activation matmul is left as it was."""
    ranges = {"x": (-3.0, 3.0), "h": (-2.0, 5.0), "r": (0.0, 5.0), "y": (-1.0, 1.0)}
    got = function_in_int8(_mlp(), ranges, levels=63)

    x = relax.Var("x", relax.TensorType((4, 16), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            h = bb.emit(
                _qdq(relax.op.matmul(_qdq(x, ranges["x"]), _dq_weight(W1, 63)), ranges["h"])
            )
            r = bb.emit(relax.op.nn.relu(h))
            y = bb.emit(
                _qdq(relax.op.matmul(_qdq(r, ranges["r"]), _dq_weight(W2, 63)), ranges["y"])
            )
            g = bb.emit(relax.op.matmul(y, relax.op.permute_dims(y)))
            out = bb.emit_output(relax.Tuple([y, g]))
        bb.emit_func_output(out)
    tvm.ir.assert_structural_equal(got, bb.get()["main"])
    tvm.ir.assert_structural_equal(function_in_int8(got, ranges, 63), got)  # idempotent


def test_the_rewrite_for_openvino_quantizes_only_what_the_ops_read():
    """OpenVINO's form (``int8_placement`` "inputs", NNCF's): no quantization between a matmul
    and what follows it (``y`` feeds the activation-by-activation matmul, but the function's
    output too: it stays as it is)."""
    from partune.backends import registry

    assert registry.get("openvino").int8_placement == INPUTS
    assert registry.get("onnxruntime").int8_placement == "units"
    ranges = {"x": (-3.0, 3.0), "h": (-2.0, 5.0), "r": (0.0, 5.0), "y": (-1.0, 1.0)}
    got = function_in_int8(_mlp(), ranges, levels=63, placement=INPUTS)

    x = relax.Var("x", relax.TensorType((4, 16), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            h = bb.emit(relax.op.matmul(_qdq(x, ranges["x"]), _dq_weight(W1, 63)))
            r = bb.emit(relax.op.nn.relu(h))
            y = bb.emit(relax.op.matmul(_qdq(r, ranges["r"]), _dq_weight(W2, 63)))
            g = bb.emit(relax.op.matmul(y, relax.op.permute_dims(y)))
            out = bb.emit_output(relax.Tuple([y, g]))
        bb.emit_func_output(out)
    tvm.ir.assert_structural_equal(got, bb.get()["main"])


def _attention() -> relax.Function:
    """One head: q and k projected (bias added), k transposed, softmax, times v."""
    x = relax.Var("x", relax.TensorType((4, 16), "float32"))
    v = relax.Var("v", relax.TensorType((4, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, v]):
        with bb.dataflow():
            q = bb.emit(relax.op.add(relax.op.matmul(x, relax.const(W1)), relax.const(1.0)))
            k = bb.emit(relax.op.matmul(x, relax.const(W1)))
            kb = bb.emit(relax.op.add(k, relax.const(-1.0)))
            kt = bb.emit(relax.op.permute_dims(kb))
            p = bb.emit(relax.op.nn.softmax(relax.op.matmul(q, kt)))
            out = bb.emit_output(relax.op.matmul(p, v))
        bb.emit_func_output(out)
    return bb.get()["main"]


def test_attention_is_quantized_where_its_operands_are_made_for_openvino():
    """NNCF's placement: the bias adds that make q and k (symmetric int8: they take both signs)
    and the softmax (u8 from zero), back through k's transpose; v, a parameter, is not made here;
    nothing of it under the units placement."""
    from partune.core.int8 import attention_sources

    func = _attention()
    bindings = list(func.body.blocks[0].bindings)
    made = sorted(bindings[i].value.op.name for i in attention_sources(bindings))
    # q's and k's bias adds (k's behind its transpose), and the softmax of q @ kt
    assert made == ["relax.add", "relax.add", "relax.nn.softmax"]
    text = function_in_int8(func, placement=INPUTS).script()
    assert text.count('out_dtype="int8"') == 2 and text.count('out_dtype="uint8"') == 3
    again = function_in_int8(function_in_int8(func, placement=INPUTS), placement=INPUTS)
    tvm.ir.assert_structural_equal(again, function_in_int8(func, placement=INPUTS))
    assert 'out_dtype="int8"' not in function_in_int8(func).script()


def test_an_attention_matmul_kept_in_f32_leaves_its_operands_unquantized():
    """The attention matmuls are units an OpenVINO int8 region may keep in f32: the scores
    matmul kept, q's and k's bias adds are not quantized (the softmax still is); the units the
    repair may hand back include them there, and not in onnxruntime's regions, which leave
    attention in f32."""
    from types import SimpleNamespace

    from partune.core.int8 import attention_operands
    from partune.search.precision import int8_units_of, keeping_f32

    func = _attention()
    mod = tvm.IRModule({"main": func})
    graph = DataflowGraph.from_function(func)
    bindings = list(func.body.blocks[0].bindings)
    operands = attention_operands(bindings)
    scores = next(m for i, m in operands.items() if "softmax" not in bindings[i].value.op.name)
    context = next(m for m in operands.values() if m != scores)
    config = CompilationConfig.for_cpu(
        ["tvm", "openvino", "onnxruntime"], int8=("openvino", "onnxruntime")
    )
    nodes = tuple(range(len(graph)))

    def plan(backend: str) -> Plan:
        region = Region(nodes, config.scope_for(backend, "int8"))
        return Plan("a", graph.fingerprint, config, (region,), calibration=Calibration("d"))

    def quantized(p: Plan) -> int:
        lifted = apply(p, mod, graph, lambda b: b, int8_placement=lambda b: INPUTS)
        return sum(f.script().count("R.quantize") for f in lifted.functions.values())

    whole = quantized(plan("openvino"))
    assert quantized(keeping_f32(plan("openvino"), [scores])) == whole - 2
    assert quantized(keeping_f32(plan("openvino"), [scores, context])) == whole - 3
    s = SimpleNamespace(mod=mod)
    matmuls = [n for n in nodes if quantizes(bindings[n].value)]
    assert int8_units_of(s, plan("openvino")) == sorted([*matmuls, scores, context])
    assert int8_units_of(s, plan("onnxruntime")) == matmuls
    assert int8_units_of(s, keeping_f32(plan("openvino"), [scores])) == sorted([*matmuls, context])


def test_the_named_pass_runs_on_a_module():
    mod = tvm.IRModule({"main": _mlp()})
    with tvm.transform.PassContext(disabled_pass=["QuantizeInt8"]):
        tvm.ir.assert_structural_equal(tvm.transform.Sequential([quantize_int8()])(mod), mod)
    out = quantize_int8(levels=127)(mod)
    tvm.ir.assert_structural_equal(out["main"], function_in_int8(mod["main"], levels=127))
    assert out["main"].script().count("R.quantize") == 4


def _run(func: relax.Function, x: np.ndarray) -> list[np.ndarray]:
    model = relax_to_onnx(func)
    return make_session(model, 1).run(None, {model.graph.input[0].name: x})


def test_an_int8_region_is_close_to_f32_under_onnxruntime():
    """Calibrated ranges and per-channel weights: within a few percent of f32 (a 16-deep matmul
    quantized in and out), not equal to it (the integer kernels did run), and closer than with
    ranges ten times too wide (the calibration is what keeps the error small)."""
    x = np.random.default_rng(7).standard_normal((4, 16)).astype("float32")
    h = x @ W1
    y = np.maximum(h, 0) @ W2
    ranges = {"x": (x.min(), x.max()), "h": (h.min(), h.max()), "y": (y.min(), y.max())}
    ranges["r"] = (0.0, h.max())
    f32 = _run(_mlp(), x)
    err = relative_error(_run(function_in_int8(_mlp(), ranges, INT8_LEVELS), x)[:1], f32[:1])
    assert 1e-5 < err < 0.1
    wide = {k: (10 * lo, 10 * hi) for k, (lo, hi) in ranges.items()}
    assert (
        relative_error(_run(function_in_int8(_mlp(), wide, INT8_LEVELS), x)[:1], f32[:1]) > 2 * err
    )
    assert PLACEHOLDER[0] < 0 < PLACEHOLDER[1]


def test_ranges_are_kept_per_quantized_tensor_over_every_sample():
    func = _mlp()
    tensors = calibrated_tensors(func)
    assert sorted(tensors.values()) == ["n0", "n1", "n2", "p0"]  # x, h, r, y: not g
    by_key = {k: v for v, k in tensors.items()}
    samples = [
        {by_key["p0"]: np.array([-1.0, 2.0]), by_key["n0"]: np.array([0.5, np.inf])},
        {by_key["p0"]: np.array([-3.0, 1.0]), by_key["n0"]: np.array([0.1, 0.2])},
    ]
    ranges = ranges_over(samples, tensors)
    assert ranges == {"p0": (-3.0, 2.0), "n0": (0.1, 0.5)}  # infinities left out


def test_a_plan_carries_its_ranges_and_its_int8_regions_use_them():
    func = _mlp()
    mod = tvm.IRModule({"main": func})
    graph = DataflowGraph.from_function(func)
    config = CompilationConfig.for_cpu(["tvm", "onnxruntime"], int8=("onnxruntime",))
    scope = config.scope_for("onnxruntime", "int8")
    calibration = Calibration("d1", {"p0": (-2.0, 2.0), "n0": (-1.0, 7.0)})
    plan = Plan(
        "mlp",
        graph.fingerprint,
        config,
        (Region(tuple(range(len(graph))), scope),),
        calibration=calibration,
    )
    assert Plan.from_json(plan.to_json()).calibration == calibration
    assert Plan.from_json(plan.to_json()).calibration.ranges == calibration.ranges
    assert plan_key(plan) != plan_key(
        Plan("mlp", graph.fingerprint, config, plan.regions, calibration=Calibration("d2"))
    )
    lifted = [
        f
        for gv, f in apply(plan, mod, graph, lambda b: b).functions.items()
        if gv.name_hint != "main"
    ]
    text = lifted[0].script()
    assert text.count("R.quantize") == 4  # x, h (matmul 1), r, y (matmul 2)
    scale = np.float32(activation_qparams((-2.0, 2.0))[0])  # x's calibrated range
    assert str(scale)[:8] in text
    inputs_only = apply(plan, mod, graph, lambda b: b, int8_placement=lambda b: INPUTS)
    assert (
        sum(
            f.script().count("R.quantize")
            for gv, f in inputs_only.functions.items()
            if gv.name_hint != "main"
        )
        == 2
    )  # x and r: what the matmuls read


def test_the_repair_hands_back_first_what_costs_least_speed_per_unit_of_error():
    gains = {0: 1e-3, 1: 1e-3, 2: 4e-3, 3: 1e-4}
    errors = {0: 1e-2, 1: 1e-3, 2: 1e-2, 3: 0.0}
    # 0: 0.1 s per unit of error, 1: 1.0, 2: 0.4; 3 has no error: kept to the last
    assert revert_order(gains, errors) == [0, 2, 1, 3]
    # The most sensitive region is 0 or 2 (1e-2); by speed per error 0 goes first, not 2.
    assert revert_order(gains, {i: 1.0 for i in gains}) == [3, 0, 1, 2]  # unknown: least gain


CW = (RNG.standard_normal((8, 4, 3, 3)) * 0.2).astype("float32")
CB = (RNG.standard_normal((1, 8, 1, 1)) * 0.1).astype("float32")


def _conv_block(shared_relu: bool = False) -> relax.Function:
    """conv -> + bias -> relu (a unit), then a second conv; ``shared_relu``: the relu's input is
    also an output, so the unit ends at the bias add."""
    x = relax.Var("x", relax.TensorType((1, 4, 8, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            c = bb.emit(relax.op.nn.conv2d(x, relax.const(CW), padding=[1, 1]), name_hint="c")
            a = bb.emit(relax.op.add(c, relax.const(CB)), name_hint="a")
            r = bb.emit(relax.op.nn.relu(a), name_hint="r")
            w2 = relax.const(CW[:, :4].repeat(2, axis=1))
            d = bb.emit(relax.op.nn.conv2d(r, w2, padding=[1, 1]), name_hint="d")
            out = bb.emit_output(relax.Tuple([d, a]) if shared_relu else d)
        bb.emit_func_output(out)
    return bb.get()["main"]


def test_a_convolution_unit_takes_its_bias_and_relu_where_it_alone_reads_them():
    from partune.core import int8_units, unit_chain

    bindings = list(_conv_block().body.blocks[0].bindings)
    assert int8_units(bindings) == {0: 2, 3: 3}
    assert unit_chain(bindings, 0, 2) == [0, 1, 2]
    shared = list(_conv_block(shared_relu=True).body.blocks[0].bindings)
    assert int8_units(shared, outputs=frozenset([shared[1].var])) == {0: 1, 3: 3}
    assert int8_units(bindings, inside=lambda i: i != 2) == {0: 1, 3: 3}  # a region cuts it


def test_a_convolution_unit_before_and_after():
    ranges = {"x": (-3.0, 3.0), "r": (0.0, 2.0), "d": (-5.0, 5.0)}
    got = function_in_int8(_conv_block(), ranges, levels=127)

    def dq_w(w: np.ndarray) -> relax.Expr:
        scale = (np.abs(w).max(axis=(1, 2, 3)) / 127).astype("float32")
        q = np.clip(np.round(w / scale[:, None, None, None]), -127, 127).astype("int8")
        zero = relax.const(np.zeros(w.shape[0], "int8"))
        return relax.op.dequantize(relax.const(q), relax.const(scale), zero, axis=0)

    x = relax.Var("x", relax.TensorType((1, 4, 8, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            c = bb.emit(relax.op.nn.conv2d(_qdq(x, ranges["x"]), dq_w(CW), padding=[1, 1]))
            a = bb.emit(relax.op.add(c, relax.const(CB)))
            r = bb.emit(_qdq(relax.op.nn.relu(a), ranges["r"]))
            w2 = CW[:, :4].repeat(2, axis=1)
            d = bb.emit(
                _qdq(
                    relax.op.nn.conv2d(_qdq(r, ranges["r"]), dq_w(w2), padding=[1, 1]), ranges["d"]
                )
            )
            out = bb.emit_output(d)
        bb.emit_func_output(out)
    tvm.ir.assert_structural_equal(got, bb.get()["main"])


def test_onnxruntime_runs_a_convolution_unit_as_one_integer_convolution(tmp_path):
    """The translation puts the bias inside the Conv, and a ReLU's quantization at zero point 0:
    onnxruntime then makes each unit one QLinearConv (no float Conv left)."""
    import onnx

    model = relax_to_onnx(function_in_int8(_conv_block()))
    assert [len(n.input) for n in model.graph.node if n.op_type == "Conv"] == [3, 2]
    make_session(model, 1, save_optimized=str(tmp_path / "opt.onnx"))
    ops = [n.op_type for n in onnx.load(str(tmp_path / "opt.onnx")).graph.node]
    assert ops.count("QLinearConv") == 2 and "Conv" not in ops and "Relu" not in ops


def test_units_kept_in_f32_stay_f32_inside_an_int8_region_and_change_the_plan_key():
    from dataclasses import replace

    from partune.search.precision import keeping_f32

    func = _conv_block()
    mod = tvm.IRModule({"main": func})
    graph = DataflowGraph.from_function(func)
    config = CompilationConfig.for_cpu(["tvm", "onnxruntime"], int8=("onnxruntime",))
    region = Region(tuple(range(len(graph))), config.scope_for("onnxruntime", "int8"))
    plan = Plan("c", graph.fingerprint, config, (region,), calibration=Calibration("d"))

    def quantizes_in(p: Plan) -> int:
        lifted = [f for gv, f in apply(p, mod, graph, lambda b: b).functions.items()]
        return sum(f.script().count("R.quantize") for f in lifted)

    kept = keeping_f32(plan, [0])
    assert kept.calibration.f32_units == (0,) and keeping_f32(kept, [3]).calibration.f32_units == (
        0,
        3,
    )
    assert quantizes_in(plan) == 4 and quantizes_in(kept) == 2  # only the second conv's unit
    assert plan_key(kept) != plan_key(plan)
    assert Plan.from_json(kept.to_json()).calibration.f32_units == (0,)
    assert plan_key(replace(kept, calibration=Calibration("d"))) == plan_key(plan)


def test_a_plan_keeping_every_unit_in_f32_computes_as_f32_when_built():
    """The backend builds the plan's QDQ form as it stands: a unit the plan keeps in f32 is not
    quantized again with placeholder ranges (which once made keeping a unit worse, not better)."""
    from partune.runners.builder import build_plan
    from partune.search.precision import keeping_f32

    func = _conv_block()
    mod = tvm.IRModule({"main": func})
    graph = DataflowGraph.from_function(func)
    config = CompilationConfig.for_cpu(["tvm", "onnxruntime"], int8=("onnxruntime",))
    nodes = tuple(range(len(graph)))
    f32 = Plan("c", graph.fingerprint, config, (Region(nodes, config.scope_for("onnxruntime")),))
    int8 = Plan(
        "c",
        graph.fingerprint,
        config,
        (Region(nodes, config.scope_for("onnxruntime", "int8")),),
        calibration=Calibration("d", {"p0": (-4.0, 4.0)}),
    )
    x = [np.random.default_rng(3).standard_normal((1, 4, 8, 8)).astype("float32")]
    want = build_plan(f32, mod, graph)(x)[0]
    assert not np.allclose(build_plan(int8, mod, graph)(x)[0], want, atol=1e-5)
    kept = build_plan(keeping_f32(int8, [0, 3]), mod, graph)(x)[0]
    np.testing.assert_allclose(kept, want, rtol=1e-5, atol=1e-5)


def test_a_units_estimated_noise_is_within_bounds_of_its_measured_int8_error():
    """``unit_noise`` costs no run; against the QDQ matmul computed in numpy it is within 2x."""
    from partune.core import unit_noise

    x = RNG.standard_normal((64, 16)).astype("float32")
    value = _mlp().body.blocks[0].bindings[0].value  # x @ W1
    rng = (float(x.min()), float(x.max()))
    scale, zero = activation_qparams(rng)
    xq = (np.clip(np.round(x / scale) + zero, 0, 255) - zero) * scale
    step = np.abs(W1).max(axis=0) / INT8_LEVELS
    wq = np.clip(np.round(W1 / step), -INT8_LEVELS, INT8_LEVELS) * step
    y = x @ W1
    measured = np.mean((xq @ wq - y) ** 2) / np.mean(y**2)
    estimated = unit_noise(value, x, rng)
    assert measured / 2 < estimated < measured * 2
    # a range twice as wide: steps twice as large, four times the activation's noise
    assert unit_noise(value, x, (2 * rng[0], 2 * rng[1])) > 2 * estimated


def test_units_go_back_until_their_drops_add_up_to_what_is_needed():
    from partune.search.precision import units_to_revert

    drops = {0: 0.5, 1: 0.3, 2: 0.15, 3: 0.05}
    order = [2, 0, 1, 3]
    assert units_to_revert(order, drops, 0.0) == 0
    assert units_to_revert(order, drops, 0.15) == 1
    assert units_to_revert(order, drops, 0.65) == 2  # 2 and 0: 0.65
    assert units_to_revert(order, drops, 0.7) == 3  # 0.65 is short: 1 goes too
    assert units_to_revert(order, drops, 2.0) == 4


def test_a_top1_repair_probes_in_relative_error_scaled_to_the_flipped_share():
    from partune.search.precision import NoiseScale, probe_metric

    assert probe_metric("top1") == "rel"  # a share of flipped classes barely moves per unit
    assert probe_metric("rel") == "rel" and probe_metric("cosine") == "cosine"
    rel = NoiseScale.of("rel")
    assert rel.noise(0.1) == pytest.approx(0.01)  # squared relative errors add
    assert NoiseScale.of("cosine").noise(0.1) == pytest.approx(0.1)  # cosine errors add as is
    # 9% of classes flipped where the relative error is 7.8%: 1% flipped is 0.87% relative
    top1 = NoiseScale.of("rel", per=0.09 / 0.078)
    assert top1.noise(0.09) == pytest.approx(0.078**2)
    assert top1.noise(0.01) == pytest.approx((0.01 * 0.078 / 0.09) ** 2)
    assert top1.noise(0.05, probed=True) == pytest.approx(0.05**2)  # a probe reads rel as is


def test_units_are_taken_best_first_while_their_noises_fit_the_allowance():
    from partune.search.precision import units_within

    noises = {0: 4.0, 1: 1.0, 2: 2.0, 3: 0.5}
    assert units_within([1, 0, 2, 3], noises, 3.6) == [1, 2, 3]  # 0 does not fit: passed over
    assert units_within([1, 0, 2, 3], noises, 0.4) == []
    assert units_within([0, 1], noises, 10.0) == [0, 1]


class _UnitsView:
    """A SessionView for the build-up repair: a plan's relative error is ``interaction`` times
    the root of the squared errors of the units it keeps in int8 (noises of independent units
    add), each unit's error alone being ``alone``."""

    def __init__(self, alone: dict[int, float], flops: dict[int, int], interaction: float = 1.0):
        from types import SimpleNamespace

        self.alone, self.interaction = alone, interaction
        nodes = {u: SimpleNamespace(flops=f) for u, f in flops.items()}
        self.graph = SimpleNamespace(nodes=nodes)
        self.options = SimpleNamespace(metric="rel", accuracy_budget=0.01)
        self.progress = SimpleNamespace(start_phase=lambda *a: None)
        self.probes: list[str] = []
        self.variants: dict[str, float] = {}

    def error(self, plan: Plan) -> float:
        int8 = [u for u in self.alone if u not in plan.calibration.f32_units]
        return self.interaction * float(np.sqrt(sum(self.alone[u] ** 2 for u in int8)))

    def measure(self, plan: Plan, label: str, metric: str | None = None):
        from partune.runners import Measurement

        self.probes.append(label)
        return Measurement(1e-3, 0.0, 1e-3, 1, 1, rel_error=self.error(plan) / self.interaction)

    def offer(self, label: str, plan: Plan) -> bool:
        return True

    def end_to_end(self, label: str, plan: Plan):
        from partune.runners import Measurement
        from partune.search.precision import budgeted

        self.variants[label] = err = self.error(plan)
        return budgeted(Measurement(1e-3, 0.0, 1e-3, 5, 1, rel_error=err), 0.01)


@pytest.mark.parametrize("interaction", [1.0, 1.6])
def test_the_build_up_repair_keeps_int8_where_flops_per_noise_are_highest(interaction):
    """A plan whose int8 noise must nearly all go (the early, sensitive units of a deep network
    carry most of it): the repair measures every unit alone and keeps in int8 the units of most
    FLOPs per unit of noise that fit the budget; where the units' noises add up to more than
    their sum (``interaction``), the next variant's allowance shrinks by what was measured."""
    from partune.search.precision import NoiseScale, build_up_units

    alone = {0: 0.05, 1: 0.02, 2: 0.004, 3: 0.004, 4: 0.003, 5: 0.002}
    flops = {0: 100, 1: 100, 2: 50, 3: 10, 4: 40, 5: 5}
    s = _UnitsView(alone, flops, interaction)
    config = CompilationConfig.for_cpu(["tvm"])
    plan = Plan("m", "f", config, (), calibration=Calibration("d"))
    label = build_up_units(s, plan, "int8 plan", list(alone), NoiseScale.of("rel"))
    assert label is not None and s.variants[label] <= 0.01
    assert len(s.probes) == len(alone)  # each unit's error alone, once
    # By FLOPs per noise 4, 2, 5, 3, 1, 0: the first four fit (0.7 * 0.01) ** 2; 1 and 0 do not.
    first = next(iter(s.variants))
    assert first == "int8 plan (int8 in 4 of 6 units)"
    if interaction == 1.0:
        assert list(s.variants) == [first]
    else:  # 1.6x what the four promised: the allowance shrinks to fit 4 and 5 alone
        assert list(s.variants) == [first, "int8 plan (int8 in 2 of 6 units)"]


def test_a_probe_is_timed_by_one_call_after_one_warm_up():
    """A repair's probe is read for its error: two calls of the plan, not a contender's 0.7 s."""
    from partune.runners.timing import Protocol, time_callable
    from partune.search.session import PROBE_PROTOCOL

    calls = []
    m = time_callable(lambda: calls.append(1), Protocol(**PROBE_PROTOCOL))
    assert m.ok and len(calls) == 2 and m.repeats == 1
