"""The report a person looks at: the graph with its regions (Graphviz and matplotlib), each
region against its best alternative from the store, and advice that follows the data."""

from __future__ import annotations

import numpy as np
import pytest

from partune.core.keys import calibration_keys, candidate_key
from partune.core.plan import Plan, Region, region_order
from partune.core.scopes import CompilationConfig
from partune.frontend.models import load
from partune.report_graph import DETAILED_UP_TO, boxes, has_dot, layers
from partune.report_regions import Facts, facts, next_steps, region_times
from partune.runners.timing import Measurement
from tests.conftest import load_model
from tests.model_files import write_onnx

# One test process runs this module under ``make test`` (pytest-xdist): its module fixture tunes a
# model once.
pytestmark = pytest.mark.xdist_group("report")

CONFIG = CompilationConfig.for_cpu(["tvm", "onnxruntime"])
TVM, ORT = CONFIG.scope_for("tvm"), CONFIG.scope_for("onnxruntime")


def took(us: float) -> Measurement:
    return Measurement(us * 1e-6, 0.0, us * 1e-6, 10, 1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """conv, add, relu, mean, reshape, matmul: six nodes."""
    return load(str(write_onnx(tmp_path_factory.mktemp("tiny") / "tiny.onnx")))


def tiny_plan(model, notes: dict | None = None) -> Plan:
    regions = (Region((0,), ORT, 10e-6), Region((1, 2), TVM, 3e-6), Region((3, 4, 5), ORT, 4e-6))
    return Plan(model.name, model.graph.fingerprint, CONFIG, regions, notes=notes or {})


def tiny_store(model) -> dict[str, Measurement]:
    """The conv is 10 us on onnxruntime, 50 us untuned on TVM (10x expected from tuning); the
    add and relu are 3 us together on TVM, 1 us each on onnxruntime; the tail is 4 us on
    onnxruntime, 40 us on TVM (its matmul: 10x expected from tuning, not enough). An empty TVM
    call takes 2.8 us, which no schedule speeds up."""
    g = model.graph

    def key(nodes, scope):
        return candidate_key(g, nodes, scope)

    return {
        key((0,), ORT): took(10),
        key((0,), TVM): took(50),
        key((1, 2), TVM): took(3),
        key((1,), ORT): took(1),
        key((2,), ORT): took(1),
        key((3, 4, 5), ORT): took(4),
        key((3, 4, 5), TVM): took(40),
        calibration_keys(TVM)[0]: took(2.8),
    }


def test_each_region_against_its_best_alternative(tiny):
    rows = region_times(tiny.graph, tiny_plan(tiny), tiny_store(tiny))
    conv, glue, tail = rows
    assert conv.measured and conv.time_s == pytest.approx(10e-6)
    assert conv.best.backend == "tvm" and conv.best.exact and not conv.beaten
    assert conv.tuned_estimate_s == pytest.approx(
        7.52e-6
    )  # the call, 2.8 us, + 47.2 us / 10: under 10 us
    assert glue.best.backend == "onnxruntime" and not glue.best.exact  # 1 us + 1 us, over two runs
    assert glue.best.time_s == pytest.approx(2e-6) and glue.beaten
    assert glue.tuned_estimate_s is None  # 2.8 us + 0.2 us / 1.4 is not under 0.9 x 3 us
    assert tail.tuned_estimate_s is None and tail.best.time_s == pytest.approx(40e-6)


def test_a_tuned_measurement_is_no_estimate(tiny):
    store = tiny_store(tiny) | {candidate_key(tiny.graph, (0,), TVM) + ":tuned32": took(6)}
    conv = region_times(tiny.graph, tiny_plan(tiny), store)[0]
    assert conv.tuned_estimate_s is None and conv.best.time_s == pytest.approx(6e-6)


def test_regions_the_store_lacks_fall_back_to_the_plan(tiny):
    rows = region_times(tiny.graph, tiny_plan(tiny), {})
    assert [r.time_s for r in rows] == [10e-6, 3e-6, 4e-6] and not any(
        r.measured or r.best for r in rows
    )


def test_advice_follows_the_data(tiny):
    advice = next_steps(
        facts(tiny_plan(tiny), region_times(tiny.graph, tiny_plan(tiny), tiny_store(tiny)))
    )
    assert len(advice) == 2
    assert advice[0].startswith("Set --tune-budget") and "1 region would" in advice[0]
    assert "about 2.5 us saved of the regions' 17.0 us, timed alone" in advice[0]
    assert "1 region of 3 had an alternative that measured faster alone" in advice[1]


def test_advice_on_constructed_facts():
    assert (
        "raise --tune-budget".capitalize()
        in next_steps(
            Facts(
                regions=5,
                would_win_tuned=3,
                tuning_offered=True,
                tuned_saving_s=1e-3,
                regions_s=10e-3,
            )
        )[0]
    )
    # a saving too small to matter is not worth a tuning budget
    quiet = next_steps(
        Facts(regions=5, compared=5, would_win_tuned=3, tuned_saving_s=1e-6, regions_s=10e-3)
    )
    assert "tune" not in quiet[0] and quiet[0].startswith("Nothing measured points to an easy gain")
    file = next_steps(Facts(regions=1, model_file="onnxruntime", partitioned_slower=1.2))
    assert file == [
        "The plan is the model's own file under onnxruntime: no partitioned mix beat it "
        "(the best partitioned one was 1.20x slower)."
    ]
    random = next_steps(Facts(regions=4, random_inputs="no backend could build the whole model"))
    assert "random inputs (no backend could build the whole model)" in random[0]
    slower = next_steps(Facts(regions=4, best_peer="torch.compile", speedup_vs_best_peer=0.5))
    assert slower[0].startswith("torch.compile runs this model 2.00x faster than the plan")
    fine = next_steps(
        Facts(regions=4, compared=4, best_peer="onnxruntime", speedup_vs_best_peer=1.25)
    )
    assert fine == [
        "Nothing measured points to an easy gain: no other backend ran any region's nodes in "
        "under 90% of its time; the plan runs 1.25x as fast as onnxruntime."
    ]
    blind = next_steps(Facts(regions=4, best_peer="onnxruntime", speedup_vs_best_peer=1.25))
    assert blind[0].startswith(
        "No region could be held against its alternatives"
    )  # not "nothing to gain"
    many = next_steps(
        Facts(
            regions=9,
            would_win_tuned=2,
            tuned_saving_s=1e-3,
            regions_s=2e-3,
            beaten=4,
            random_inputs="x",
            best_peer="p",
            speedup_vs_best_peer=0.9,
        )
    )
    assert len(many) == 2  # one or two sentences, never a list of everything


def test_random_inputs_are_read_from_the_notes(tiny):
    plan = tiny_plan(tiny, {"inputs_from": "random (no backend could build the whole model)"})
    assert facts(plan, []).random_inputs == "no backend could build the whole model"
    assert facts(tiny_plan(tiny, {"inputs_from": "model"}), []).random_inputs is None


def rotating(model, size: int) -> Plan:
    n = len(model.graph)
    regions = tuple(
        Region(tuple(range(s, min(s + size, n))), (TVM, ORT)[i % 2])
        for i, s in enumerate(range(0, n, size))
    )
    return Plan(model.name, model.graph.fingerprint, CONFIG, regions)


def test_big_graphs_collapse(monkeypatch):
    from partune import report_graph

    model = load_model("bert-small")
    assert len(model.graph) > DETAILED_UP_TO
    plan = rotating(model, 9)
    drawn = boxes(model.graph, plan)
    assert len(drawn) < len(model.graph)
    assert sorted(n for b in drawn for n in b.nodes) == list(range(len(model.graph)))
    region_of = {n: k for k, r in enumerate(plan.regions) for n in r.nodes}
    assert all({region_of[n] for n in b.nodes} == {b.region} for b in drawn)
    assert any("(" in line and "nodes)" in line for b in drawn for line in b.lines)  # op summaries
    place = layers(drawn, region_order(model.graph, plan.regions))
    cells = {}
    for b in drawn:  # each region keeps rows of its own: clusters never overlap
        c, r, _ = place[b.id]
        assert cells.setdefault((c, r), b.region) == b.region
    monkeypatch.setattr(report_graph, "MAX_BOXES", 5)
    assert len(boxes(model.graph, plan)) == len(plan.regions)


@pytest.mark.parametrize("dot", [True, False], ids=["graphviz", "matplotlib"])
def test_the_report_writes_its_pictures_and_the_onnx(tiny, tmp_path, monkeypatch, dot):
    from matplotlib.image import imread

    from partune import report_graph
    from partune.report import write_report
    from partune.store.measurements import MeasurementStore

    if dot and not has_dot():
        pytest.skip("Graphviz's dot is not installed (apt-get install graphviz)")
    if not dot:
        monkeypatch.setattr(report_graph, "has_dot", lambda: False)
    url = f"sqlite:///{tmp_path / 'm.db'}"
    store = MeasurementStore(url, "dev", heartbeat_s=None)
    for key, m in tiny_store(tiny).items():
        store.put(key, m)
    notes = {
        "chosen_as": "partune dp",
        "measured_s": 20e-6,
        "end_to_end_s": {"partune dp": 20e-6},
        "verdict_median_s": {"partune dp": 21e-6},
    }
    path = write_report(url, "job", tiny_plan(tiny, notes), tmp_path / "report", tiny)
    out = path.parent
    text = path.read_text()
    assert "## What to try next" in text and "--tune-budget" in text
    assert "| r00 conv2d | onnxruntime | 10.0 | tvm | 50.0 |" in text
    assert (out / "partition.onnx").is_file() and "open it in Netron" in text
    assert (out / "graph.svg").is_file() == dot
    for name in ("graph.png", "regions.png", "shares.png", "history.png"):
        pixels = imread(out / name)  # real pictures, not empty canvases
        assert min(pixels.shape[:2]) > 100 and np.ptp(pixels[..., :3]) > 0.1, name
