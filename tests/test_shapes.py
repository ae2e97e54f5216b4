"""The shapes a job tunes at (``--shapes``) and the bucket each call's shapes go to."""

import pytest

from partune.core import (
    CompilationConfig,
    ModelError,
    Plan,
    PlanError,
    Region,
    SEScope,
    ShapeBucket,
    ShapePlans,
    load_plans,
)
from partune.frontend import FileShapes, pad_safe, tuning_points

BERT = FileShapes(
    (("input_ids", ("batch", "sequence")), ("attention_mask", ("batch", "sequence"))),
    (("last_hidden_state", ("batch", "sequence", 64)),),
)
CNN = FileShapes((("x", ("N", 3, 16, 16)),), (("y", ("N", 4)),))


def test_axes_take_their_points_and_defaults():
    points = tuning_points(BERT, "sequence=32,128,384")
    assert [p.values for p in points] == [{"batch": 1, "sequence": s} for s in (32, 128, 384)]
    assert points[1].shapes == {"input_ids": (1, 128), "attention_mask": (1, 128)}
    (default,) = tuning_points(BERT, None)  # a sequence is never tuned as one token
    assert default.values == {"batch": 1, "sequence": 128}
    grid = tuning_points(BERT, "sequence=16,64; batch=1,8")
    assert len(grid) == 4 and {p.label for p in grid} >= {"batch=8,sequence=64"}
    (whole,) = tuning_points(CNN, "x=2,3,16,16")  # one input's whole shape, as --input-shape
    assert whole.values == {"N": 2} and whole.shapes == {"x": (2, 3, 16, 16)}


@pytest.mark.parametrize(
    "text, why",
    [
        ("length=32", "names no input or axis"),
        ("sequence=0", "at least 1"),
        ("sequence=a,b", "whole numbers"),
        ("x=2,3,32,32", "does not fit"),
        ("x=2,3,16", "does not fit"),
    ],
)
def test_bad_shapes_are_refused_in_one_line(text, why):
    fs = BERT if text.startswith(("sequence", "length")) else CNN
    with pytest.raises(ModelError, match=why) as e:
        tuning_points(fs, text)
    assert "\n" not in str(e.value)


def test_padding_is_safe_on_a_masked_sequence_or_where_declared():
    assert pad_safe(BERT) == {"sequence": "mask attention_mask"}
    assert pad_safe(CNN) == {}
    assert pad_safe(CNN, ("N",)) == {"N": "declared"}
    gpt = FileShapes((("input_ids", ("batch", "sequence")),))
    assert pad_safe(gpt) == {}  # no mask: a padded token could change what others see
    with pytest.raises(ModelError, match="no such axis"):
        pad_safe(CNN, ("batch",))


def _plan() -> Plan:
    config = CompilationConfig.for_cpu(["tvm"])
    return Plan("m", "f" * 16, config, (Region((0, 1), SEScope("cpu", backend="tvm")),))


def _plans(pad: dict[str, str]) -> ShapePlans:
    plan = _plan()
    return ShapePlans(
        BERT.axes(),
        tuple(
            ShapeBucket(p.values, tuple(p.shapes.values()), plan)
            for p in tuning_points(BERT, "sequence=32,128,384")
        ),
        BERT.output_axes(),
        pad,
        "onnxruntime",
    )


def test_a_call_goes_to_its_own_point_else_padded_up_where_safe_else_the_file():
    plans = _plans(pad_safe(BERT))
    assert plans.route([(1, 128), (1, 128)]).bucket == 1
    padded = plans.route([(1, 100), (1, 100)])
    assert padded.bucket == 1 and padded.padded == {"sequence": (100, 128)}
    assert plans.route([(1, 16), (1, 16)]).bucket == 0
    assert plans.route([(1, 500), (1, 500)]).bucket is None  # above every point
    assert plans.route([(2, 128), (2, 128)]).bucket is None  # batch is not padded
    assert plans.route([(1, 100), (1, 90)]).bucket is None  # the inputs disagree
    unsafe = _plans({})
    assert unsafe.route([(1, 128), (1, 128)]).bucket == 1
    assert unsafe.route([(1, 100), (1, 100)]).bucket is None  # padding not known safe
    assert plans.ranges()[1] == {"batch": (1, 1), "sequence": (33, 128)}
    assert unsafe.ranges()[1]["sequence"] == (128, 128)


def test_the_plan_file_with_buckets_round_trips(tmp_path):
    plans = _plans(pad_safe(BERT))
    plans.save(tmp_path / "plan.json")
    again = load_plans(tmp_path / "plan.json")
    assert isinstance(again, ShapePlans)
    assert again.to_json() == plans.to_json()
    assert again.route([(1, 300), (1, 300)]).bucket == 2
    with pytest.raises(PlanError, match="3 shape buckets"):
        Plan.load(tmp_path / "plan.json")
    _plan().save(tmp_path / "one.json")
    assert isinstance(load_plans(tmp_path / "one.json"), Plan)


def test_a_file_with_a_symbolic_sequence_is_imported_at_128_and_says_so(tmp_path):
    from partune.frontend import load
    from tests.shape_models import write_masked_encoder

    model = load(str(write_masked_encoder(tmp_path / "enc.onnx")))
    assert [a.shape for a in model.inputs] == [(1, 128), (1, 128)]
    assert model.assumed == [
        "input_ids: batch taken as 1, sequence taken as 128",
        "attention_mask: batch taken as 1, sequence taken as 128",
    ]
