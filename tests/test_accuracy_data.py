"""``partune tune``'s accuracy data: the user's samples checked against the model before anything
is measured, the split, the synthetic fallback said plainly, and the metric that must fit."""

import argparse
from types import SimpleNamespace

import numpy as np
import pytest

from partune.commands.tune import _accuracy_data, _study_name
from partune.core import PartuneError
from tests.graphs import Diamond


def _model(reference: np.ndarray):
    return SimpleNamespace(
        mod=Diamond,
        inputs=[np.zeros((4, 4), "float32")],
        reference=[reference],
        name="diamond",
    )


def _args(**kw) -> argparse.Namespace:
    base = dict(
        precision="int8",
        calibration=None,
        validation=None,
        metric="rel",
        tolerance=0.01,
        fewer_threads="on",
        threads=1,
    )
    return argparse.Namespace(**(base | kw))


def test_without_samples_the_summary_says_accuracy_was_judged_on_synthetic_data():
    data = _accuracy_data(_args(), _model(np.ones((4, 4), "float32")))
    assert data.calibration == () and data.validation == ()
    assert "synthetic" in data.note


def test_samples_are_split_and_a_validation_set_is_kept_apart(tmp_path):
    x = np.random.default_rng(0).standard_normal((8, 4, 4)).astype("float32")
    np.savez(tmp_path / "all.npz", x=x)
    data = _accuracy_data(
        _args(calibration=str(tmp_path / "all.npz")), _model(np.ones((4, 4), "float32"))
    )
    assert (len(data.calibration), len(data.validation)) == (6, 2)
    assert np.array_equal(data.validation[-1][0], x[-1])  # the last ones held out
    assert "6 samples to calibrate, 2 samples to validate" in data.note


@pytest.mark.parametrize(
    "write, expect",
    [
        (lambda p: np.savez(p / "s.npz", x=np.zeros((3, 4, 5), "float32")), "shape"),
        (lambda p: np.savez(p / "s.npz", x=np.zeros((3, 4, 4), "int64")), "int64"),
        (lambda p: (p / "s.npz").write_bytes(b"not numpy"), "not a .npy/.npz file"),
    ],
)
def test_samples_that_do_not_fit_are_refused_in_one_line(tmp_path, write, expect):
    write(tmp_path)
    with pytest.raises(PartuneError, match=expect) as e:
        _accuracy_data(
            _args(calibration=str(tmp_path / "s.npz")), _model(np.ones((4, 4), "float32"))
        )
    assert "\n" not in str(e.value)


def test_an_empty_folder_and_a_misplaced_flag_are_refused(tmp_path):
    with pytest.raises(PartuneError, match="no .npy or .npz"):
        _accuracy_data(_args(calibration=str(tmp_path)), _model(np.ones((4, 4), "float32")))
    with pytest.raises(PartuneError, match="need --precision"):
        _accuracy_data(
            _args(precision="f32", calibration=str(tmp_path)), _model(np.ones((4, 4), "float32"))
        )
    with pytest.raises(PartuneError, match="--validation needs --calibration"):
        _accuracy_data(_args(validation=str(tmp_path)), _model(np.ones((4, 4), "float32")))


def test_top1_needs_a_class_axis():
    with pytest.raises(PartuneError, match="class axis"):
        _accuracy_data(_args(metric="top1"), _model(np.ones((4, 1), "float32")))
    with pytest.raises(PartuneError, match="int64"):
        _accuracy_data(_args(metric="top1"), _model(np.ones((4, 4), "int64")))
    assert _accuracy_data(_args(metric="top1"), _model(np.ones((4, 4), "float32"))).note


def test_the_study_name_tells_precision_budget_and_metric_apart():
    names = {
        _study_name(_args(precision=p, metric=m), "m", ["tvm", "onnxruntime"])
        for p in ("f32", "int8", "bf16")
        for m in ("rel", "top1")
        if p != "f32" or m == "rel"
    }
    assert len(names) == 5
    assert _study_name(_args(precision="f32"), "m", ["tvm"]) == "m:tvm"  # as it always was
