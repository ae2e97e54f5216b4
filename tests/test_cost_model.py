"""Cost-model features, training and the frontier scores."""

from __future__ import annotations

import json

import numpy as np
import pytest

from partune.core.graph import DataflowGraph
from partune.cost_models.features import FEATURE_VERSION, NAMES, featurize
from partune.cost_models.xgboost_model import XGBoostCostModel
from partune.search.cost_model_eval import rank_correlation, score
from tests.graphs import Diamond, Residual


def test_features_are_deterministic_well_shaped_and_structural():
    g = DataflowGraph.from_function(Diamond["main"])
    a = featurize(g, [1, 2, 3], "onnxruntime")
    assert a.shape == (len(NAMES),) and np.all(np.isfinite(a))
    assert np.array_equal(
        a, featurize(DataflowGraph.from_function(Diamond["main"]), [3, 2, 1], "onnxruntime")
    )
    named = dict(zip(NAMES, a, strict=True))
    assert (
        named["nodes"] == 3
        and named["op:exp"] == 1
        and named["op:tanh"] == 1
        and named["op:add"] == 1
    )
    assert named["backend:onnxruntime"] == 1 and named["backend:tvm"] == 0
    assert named["inputs"] == 1 and named["exits"] == 1 and named["depth"] == 2
    assert not np.array_equal(a, featurize(g, [1, 2, 3], "tvm"))  # the backend is a feature


def test_conv_regions_count_flops_and_weights():
    g = DataflowGraph.from_function(Residual["main"])
    named = dict(zip(NAMES, featurize(g, [0, 1], "torch"), strict=True))
    assert named["op:nn.conv2d"] == 1 and named["log_flops"] > 0
    assert named["kind:out_elemwise_fusable"] + named["kind:opaque"] >= 1


def test_training_recovers_a_planted_ranking():
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 10, size=(600, len(NAMES)))
    true = np.exp(0.3 * x[:, NAMES.index("log_flops")] - 0.2 * x[:, NAMES.index("nodes")] - 8)
    model = XGBoostCostModel().fit(x[:500], true[:500])
    assert rank_correlation(model.predict(x[500:]), true[500:]) > 0.9


def test_scores_of_a_perfect_and_a_reversed_predictor():
    truth = np.array([3.0, 1.0, 2.0, 5.0, 4.0])
    frontier = np.array([0, 0, 0, 1, 1])
    perfect = score("m", truth, truth, frontier)
    assert perfect.spearman == pytest.approx(1.0) and perfect.top1 == 1.0 and perfect.frontiers == 2
    reversed_ = score("m", -truth, truth, frontier)
    assert reversed_.spearman == pytest.approx(-1.0) and reversed_.top1 == 0.0


def test_saved_model_loads_only_with_its_feature_version(tmp_path):
    rng = np.random.default_rng(1)
    x, y = rng.uniform(size=(50, len(NAMES))), rng.uniform(1e-5, 1e-3, size=50)
    model = XGBoostCostModel().fit(x, y, rounds=5)
    model.save(tmp_path / "cm.json")
    np.testing.assert_allclose(
        XGBoostCostModel.load(tmp_path / "cm.json").predict(x), model.predict(x), rtol=1e-6
    )
    meta = tmp_path / "cm.meta.json"
    meta.write_text(
        json.dumps(json.loads(meta.read_text()) | {"feature_version": FEATURE_VERSION + 1})
    )
    with pytest.raises(ValueError, match="feature version"):
        XGBoostCostModel.load(tmp_path / "cm.json")


def test_leave_one_model_out_never_trains_on_the_held_out_regions(monkeypatch):
    from partune.search import cost_model_eval as evaluate
    from partune.search.cost_model_eval import Samples, leave_one_model_out

    sizes = []
    real_fit = evaluate.XGBoostCostModel.fit
    monkeypatch.setattr(
        evaluate.XGBoostCostModel,
        "fit",
        lambda self, x, y, rounds=300: sizes.append(len(y)) or real_fit(self, x, y, rounds),
    )

    rng = np.random.default_rng(2)

    def samples(name, keys):
        x = rng.uniform(0, 5, size=(len(keys), len(NAMES)))
        return Samples(name, x, np.exp(x[:, 0] - 9), np.arange(len(keys)) // 4, keys)

    shared = [f"k{i}" for i in range(20)]
    a = samples("a", shared + [f"a{i}" for i in range(40)])
    b = samples("b", shared)  # all of b also occurs in a: only the a-only regions train for b
    c = samples("c", [f"c{i}" for i in range(60)])
    scores = {s.model: s for s in leave_one_model_out([a, b, c])}
    assert set(scores) == {"a", "b", "c"} and all(s.frontiers > 0 for s in scores.values())
    assert sizes == [60, 100, 80]  # a: b's 20 are a's too, so c only; b: a-only 40 + c; c: a + b
    assert scores["c"].spearman > 0.8  # learned from a and b: the planted cost is one feature


def test_eval_on_an_empty_storage_is_a_clear_error(tmp_path, capsys):
    from partune.cli import main

    assert main(["costmodel", "eval", "--storage", f"sqlite:///{tmp_path / 'e.db'}"]) == 2
    assert "holds no measurements" in capsys.readouterr().err


class _Backwards:
    """A 'cost model' that predicts the opposite of sense: big regions cheap."""

    def predict(self, x):
        return 1e-3 / (1.0 + x[:, NAMES.index("nodes")])

    def update(self, x, seconds):
        return self  # never learns: the search must still measure what its plan uses


def _chain_search(cost_model):
    from partune.runners.local import LocalRunner
    from partune.search.collage import tune
    from partune.store.measurements import MEMORY, MeasurementStore
    from tests.graphs import Chain

    class M:
        name, mod = "chain", Chain
        graph = DataflowGraph.from_function(Chain["main"])
        inputs = [np.random.default_rng(0).standard_normal((64, 64)).astype("float32")]
        torch_module = onnx_bytes = None

    store = MeasurementStore(MEMORY, "test-device")
    with LocalRunner(timeout_s=120) as runner:
        return (
            tune(M(), ["tvm", "onnxruntime"], runner, store, peers=(), cost_model=cost_model),
            store,
            M.graph,
        )


def test_pruning_keeps_a_measured_candidate_in_every_frontier():
    from partune.core.keys import candidate_key
    from partune.core.scopes import CompilationConfig
    from partune.search.candidates import enumerate_candidates
    from partune.search.dp import schedulable
    from partune.search.pruning import features as _features
    from partune.search.pruning import prune as _prune
    from tests.graphs import Chain

    g = DataflowGraph.from_function(Chain["main"])
    cands = [
        c
        for c in enumerate_candidates(Chain, g, CompilationConfig.for_cpu(["tvm", "onnxruntime"]))
        if schedulable(c)
    ]
    todo = {candidate_key(g, c.subgraph.nodes, c.scope): c for c in cands}
    predicted, kept = _prune(cands, _features(g, cands), todo, _Backwards())
    assert set(predicted) == set(cands) and 0 < len(kept) < len(todo)
    assert {c.subgraph.nodes[0] for c in todo.values()} == {
        c.subgraph.nodes[0] for c in kept.values()
    }


def test_optimism_follows_the_asks_between_its_floor_and_one():
    """Accurate predictions let the DP price candidates near their prediction (fewer asks); a
    model far off keeps the floor, never asking less cautiously than it did before."""
    from partune.search.pruning import OPTIMISM, OPTIMISM_SAMPLES, Optimism

    close = Optimism()
    close.observe([(2.0, 1.8)] * (OPTIMISM_SAMPLES - 1))
    assert close.share == OPTIMISM  # too few asks to judge by
    close.observe([(1.0, 1.0)])
    assert close.share == pytest.approx(0.9)  # nearly every ask came out 10% under its guess
    cheap = Optimism()  # predictions far too high: candidates measured much cheaper
    cheap.observe([(1.0, 0.3)] * OPTIMISM_SAMPLES)
    assert cheap.share == OPTIMISM
    low = Optimism()  # predictions too low everywhere: the share stops at the prediction itself
    low.observe([(1.0, 3.0), (0.0, 1.0)] * OPTIMISM_SAMPLES)
    assert low.share == 1.0 and len(low.ratios) == OPTIMISM_SAMPLES


def test_a_plan_found_with_predictions_carries_only_measured_costs():
    from partune.core.keys import candidate_key

    result, store, graph = _chain_search(_Backwards())
    assert result.counts.skipped > 0  # the model ranked candidates out of measuring

    def measured(r) -> bool:
        return candidate_key(graph, r.nodes, r.scope) in store

    assert all(measured(r) for r in result.dp_plan.regions)  # the DP measured what it picked
    # The emitted plan's costs are measurements (or absent, for a single-backend plan's
    # region that was never a measured candidate), never predictions.
    assert all(measured(r) for r in result.plan.regions if r.cost_s is not None)


def test_the_search_learns_from_its_own_measurements():
    """Transfer, then in-run learning: a model trained elsewhere keeps boosting on this model."""
    from tests.graphs import Chain

    g = DataflowGraph.from_function(Chain["main"])
    x = np.stack([featurize(g, (n,), b) for n in range(len(g)) for b in ("tvm", "onnxruntime")])
    start = XGBoostCostModel().fit(x, np.full(len(x), 1e-3))  # knows nothing useful yet
    result, store, _ = _chain_search(start)
    assert result.cost_model is not None and result.cost_model.trained_on > len(x)
    # What it learned is this model's costs: it predicts them far better than it started.
    taken = [(c, m) for c, m in result.trained if m.ok]
    xs = np.stack([featurize(g, c.subgraph.nodes, c.backend) for c, _ in taken])
    log_s = np.log([m.cost_s for _, m in taken])

    def error(model) -> float:
        return float(np.mean(np.abs(np.log(model.predict(xs)) - log_s)))

    assert len(taken) > 10 and error(result.cost_model) < error(start) / 2


def test_cost_model_off_measures_everything_and_keeps_no_model(tmp_path):
    from partune.cli import main
    from tests.model_files import write_onnx

    model = write_onnx(tmp_path / "tiny.onnx")
    url = f"sqlite:///{tmp_path / 'm.db'}"
    assert (
        main(
            [
                "tune",
                str(model),
                "--backends",
                "onnxruntime",  # the cost model, not the backends, is under test
                "--peers",
                "none",
                "--storage",
                url,
                "--cost-model",
                "off",
                "-o",
                str(tmp_path / "plan.json"),
            ]
        )
        == 0
    )
    assert not list(tmp_path.glob("*.costmodel.json"))


def test_an_unusable_default_cost_model_is_replaced_but_a_named_one_is_an_error(tmp_path, capsys):
    from partune.cli import main
    from partune.cost_models.features import FEATURE_VERSION
    from partune.cost_models.xgboost_model import XGBoostCostModel
    from tests.model_files import write_onnx

    model = write_onnx(tmp_path / "tiny.onnx")
    url = f"sqlite:///{tmp_path / 'm.db'}"
    kept = tmp_path / "m.costmodel.json"
    kept.write_text("{ half a file")
    (tmp_path / "m.costmodel.meta.json").write_text(
        json.dumps({"feature_version": FEATURE_VERSION, "trained_on": 3})
    )
    common = [
        "tune",
        str(model),
        "--backends",
        "onnxruntime",
        "--peers",
        "none",
        "--storage",
        url,
    ]
    assert main([*common, "--cost-model", str(kept)]) == 2  # named: one line, exit 2
    assert "cannot use cost model" in capsys.readouterr().err
    assert main([*common, "-o", str(tmp_path / "plan.json")]) == 0  # auto: warned, and trained anew
    assert "cannot be used" in capsys.readouterr().err
    assert XGBoostCostModel.load(kept).trained_on > 0


def test_postgres_storage_keeps_the_default_cost_model_for_its_workers(
    tmp_path, postgres_url, capsys, monkeypatch
):
    """A shared storage has no "beside": the default model is kept inside it, where every worker
    of a fleet reads it and adds to it; nothing is left in the working directory. One that this
    Partune cannot read is replaced with a warning, as beside an SQLite store."""
    import optuna

    from partune.cli import main
    from partune.cost_models.storage_kept import ATTR, STUDY, StorageKeptModel
    from partune.store.measurements import with_driver
    from tests.model_files import write_onnx

    monkeypatch.chdir(tmp_path)
    model = write_onnx(tmp_path / "tiny.onnx")
    common = [
        "tune",
        str(model),
        "--backends",
        "onnxruntime",
        "--peers",
        "none",
        "--storage",
        postgres_url,
        "-o",
        str(tmp_path / "plan.json"),
    ]
    kept = StorageKeptModel(optuna.storages.RDBStorage(with_driver(postgres_url)), postgres_url)
    optuna.create_study(study_name=STUDY, storage=kept.storage).set_user_attr(
        ATTR, "{ half a model"
    )
    assert main(common) == 0  # unreadable: warned, every candidate measured, and a new one kept
    assert "cannot be used" in capsys.readouterr().err
    first = kept.load()
    assert first is not None and first.trained_on > 0
    assert main(common) == 0  # the next run (any worker's) reads it
    assert f"{kept}: nothing new to learn" in capsys.readouterr().out  # it was read: all is stored
    assert not list(tmp_path.glob("*.costmodel*"))
