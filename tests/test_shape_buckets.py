"""A job tuned at several shapes, exported and served: each call runs the plan of its shape,
padded up where a mask makes that safe, else the user's own file; a model without symbolic
axes is tuned as before."""

import json

import numpy as np
import onnxruntime as ort
import pytest

from partune.cli import main
from partune.core import ShapePlans, load_plans
from tests.shape_models import write_batched_cnn, write_masked_encoder


def _tune(model, tmp_path, *flags) -> list[str]:
    return [
        "tune",
        str(model),
        "--backends",
        "onnxruntime",
        "--peers",
        "onnxruntime",
        "--refine-trials",
        "0",
        "--storage",
        f"sqlite:///{tmp_path / 'shapes.db'}",
        "-o",
        str(tmp_path / "plan.json"),
        *flags,
    ]


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    """The masked encoder tuned at sequence 8 and 32, exported."""
    tmp = tmp_path_factory.mktemp("buckets")
    model = write_masked_encoder(tmp / "enc.onnx")
    assert main(_tune(model, tmp, "--shapes", "sequence=8,32")) == 0
    assert (
        main(["export", str(model), "--plan", str(tmp / "plan.json"), "-o", str(tmp / "dep")]) == 0
    )
    return tmp, model


@pytest.mark.xdist_group("shape_buckets")
def test_the_plan_file_holds_a_bucket_per_point(encoder, capsys):
    tmp, _ = encoder
    plans = load_plans(tmp / "plan.json")
    assert isinstance(plans, ShapePlans)
    assert [b.point for b in plans.buckets] == [{"batch": 1, "sequence": s} for s in (8, 32)]
    assert [b.inputs for b in plans.buckets] == [((1, 8), (1, 8)), ((1, 32), (1, 32))]
    assert plans.pad == {"sequence": "mask attention_mask"}
    assert plans.buckets[0].plan.fingerprint != plans.buckets[1].plan.fingerprint
    assert plans.fallback in ("onnxruntime", "openvino")


@pytest.mark.xdist_group("shape_buckets")
def test_the_export_serves_every_shape_within_tolerance_of_the_file(encoder):
    import partune.deployed

    tmp, model = encoder
    deployed = partune.deployed.load(tmp / "dep")
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for batch, seq in ((1, 5), (1, 8), (1, 20), (1, 32), (1, 40), (2, 8)):
        ids = rng.integers(0, 50, (batch, seq)).astype(np.int64)
        mask = np.ones((batch, seq), np.int64)
        mask[:, seq - 1 :] = 0 if seq > 4 else 1  # a padded position of the user's own
        (y,) = deployed(ids, mask)
        (want,) = sess.run(None, {"input_ids": ids, "attention_mask": mask})
        assert y.shape == want.shape
        np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)
    assert deployed.stats == {"bucket0": 2, "bucket1": 2, "padded": 2, "fallback": 2}
    with pytest.raises(partune.deployed.DeployError, match="takes 2 inputs"):
        deployed(ids)
    with pytest.raises(partune.deployed.DeployError, match="must be int64"):
        deployed(ids.astype(np.int32), mask)


@pytest.mark.xdist_group("shape_buckets")
def test_explain_shows_each_bucket_and_what_it_serves(encoder, capsys):
    tmp, model = encoder
    plan, storage = str(tmp / "plan.json"), f"sqlite:///{tmp / 'shapes.db'}"
    assert main(["explain", str(model), "--plan", plan, "--storage", storage]) == 0
    out = capsys.readouterr().out
    assert (
        "== bucket0: batch 1, sequence 1-8" in out and "== bucket1: batch 1, sequence 9-32" in out
    )
    assert "verdict per shape bucket" in out and "padded up to a bucket's point on: sequence" in out


def test_padding_only_where_declared_safe_on_a_batch(tmp_path):
    import partune.deployed

    model = write_batched_cnn(tmp_path / "cnn.onnx")
    flags = ("--shapes", "batch=1,4", "--pad-safe", "batch")
    assert main(_tune(model, tmp_path, *flags)) == 0
    assert (
        main(
            ["export", str(model), "--plan", str(tmp_path / "plan.json"), "-o", str(tmp_path / "d")]
        )
        == 0
    )
    deployed = partune.deployed.load(tmp_path / "d")
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    for batch in (1, 3, 4, 8):
        x = np.random.default_rng(batch).standard_normal((batch, 3, 8, 8)).astype("float32")
        (y,) = deployed(x)
        np.testing.assert_allclose(y, sess.run(None, {"x": x})[0], rtol=1e-4, atol=1e-4)
    assert deployed.stats == {"bucket0": 1, "bucket1": 2, "padded": 1, "fallback": 1}
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert manifest["shapes"]["pad"] == {"batch": "declared"}


def test_bad_shapes_fail_in_one_line_before_measuring(tmp_path, capsys):
    model = write_masked_encoder(tmp_path / "enc.onnx")
    for flags, why in (
        (("--shapes", "tokens=8"), "names no input or axis"),
        (("--shapes", "input_ids=1,8,2"), "does not fit"),
        (("--shapes", "sequence=8", "--pad-safe", "time"), "no such axis"),
    ):
        assert main(_tune(model, tmp_path, *flags)) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert why in err[-1] and len(err) == 1
    assert not (tmp_path / "shapes.db").exists()  # refused before any store or measuring


def test_a_helper_worker_of_a_bucket_runs_that_bucket_alone():
    from argparse import Namespace

    from partune.commands.tune import _helper_argv

    argv = ["--threads", "1", "tune", "enc.onnx", "--shapes", "sequence=8,32", "--workers=2"]
    argv += ["--pad-safe", "sequence", "-o", "p.json"]
    one = Namespace(argv=argv, shape_label="batch=1,sequence=8", input_shape=["ids=1,8"])
    assert _helper_argv(one, "enc:tvm:batch=1,sequence=8") == [
        "--threads", "1", "--input-shape=ids=1,8", "tune", "enc.onnx", "-o", "p.json",
        "--study", "enc:tvm:batch=1,sequence=8",
    ]  # fmt: skip
    whole = Namespace(argv=argv[:6] + ["--workers", "2"], shape_label=None, input_shape=None)
    assert _helper_argv(whole, "s") == argv[:6]
