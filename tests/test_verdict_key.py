"""The verdict's key: what its stored measurements are found by, in this search and the next."""

from partune.core.keys import verdict_key
from partune.runners.timing import Measurement
from partune.search.verdict import _never_stored
from partune.store.measurements import MEMORY, MeasurementStore


def test_a_verdict_is_keyed_by_its_labels_and_a_done_one_missing_a_label_is_timed_again():
    """bf16 searches name the DP's plan "partune dp" or "partune dp (f32)" depending on what it
    holds: keyed by plans alone, a second search found the first's verdict done, its own labels
    never stored, and waited for ever (seen in the bf16 benchmark)."""
    plans = {"partune dp": "plan:1", "openvino-only": "plan:2"}
    key = verdict_key("fp", plans, ["onnxruntime"])
    assert key == verdict_key("fp", dict(reversed(plans.items())), ("onnxruntime",))  # order-free
    assert key != verdict_key(
        "fp", {"partune dp (f32)": "plan:1", "openvino-only": "plan:2"}, ["onnxruntime"]
    )
    store, labels = MeasurementStore(MEMORY, "test-device"), list(plans)
    assert not _never_stored(store, key, labels)  # nobody timed it: the one who claims it will
    assert store.claims.claim(key)
    store.put(key + "partune dp", Measurement(1e-3, 0.0, 1e-3, 5, 1))
    store.claims.done(key)
    assert _never_stored(store, key, labels)  # done, and a label will never come: time it again
    store.put(key + "openvino-only", Measurement(1e-3, 0.0, 1e-3, 5, 1))
    assert not _never_stored(store, key, labels)
