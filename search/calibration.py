"""Fixed per-call costs: what a region costs inside a whole model beyond its isolated time.

An isolated region is called from Python; inside the model the VM calls it. Native TVM
regions run inline (their isolated VM call is not paid: a negative adjustment); a
library region pays the VM-to-kernel transition (the penalty Collage lacked). Both come
from timing the one-add calibration model, isolated and end to end.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tvm

from partune.backends import registry
from partune.core import CompilationConfig, DataflowGraph, Plan, Region, SEScope, calibration_keys
from partune.runners import Measurement, Runner, calibration_module, overhead_request, plan_request
from partune.search.result import Counts
from partune.store import MeasurementStore


def calibrate(
    runner: Runner,
    store: MeasurementStore,
    config: CompilationConfig,
    counts: Counts,
    protocol: dict,
) -> dict[SEScope, float]:
    """Per scope, the seconds to add to a region's isolated time (``protocol``: how it is timed)."""
    model_json = tvm.ir.save_json(calibration_module())
    graph = DataflowGraph.from_function(calibration_module()["main"])

    def measured(key: str, request, label: str) -> float | None:
        m, took = store.obtain(key, lambda: runner.run(request), label)
        counts.measured += took
        counts.reused += not took
        return m.cost_s if m.ok else None

    isolated, whole = {}, {}
    for scope in config.primitives:
        overhead, transition = calibration_keys(scope)
        isolated[scope] = measured(
            overhead, overhead_request(scope, protocol), f"{scope} isolated call"
        )
        plan = Plan("calibration", graph.fingerprint, config, (Region((0,), scope),))
        whole[scope] = measured(
            transition,
            plan_request(model_json, plan, [np.ones(1, "float32")], protocol),
            f"{scope} in a model",
        )
    native = config.default
    out: dict[SEScope, float] = {}
    if isolated[native] is not None and whole[native] is not None:
        out[native] = -isolated[native]
        for scope in config.primitives:
            if scope == native or isolated[scope] is None or whole[scope] is None:
                continue
            if registry.get(scope.backend).codegen is None:  # inline in main, as native TVM is
                out[scope] = -isolated[scope]
            else:
                out[scope] = max(
                    (whole[scope] - isolated[scope]) - (whole[native] - isolated[native]), 0.0
                )
    return out


_HELD = Measurement(0.0, 0.0, 0.0, 0, 0, error="held by another worker")


class CalibrationView:
    """The store as ``calibrate`` sees it from a session: keys through the session's
    ``obtain``, counted in the session's counts (each key once: measured if this session took
    it, else reused). ``early``: a key another worker holds is skipped, ``_HELD`` standing in."""

    def __init__(self, session: Any, early: bool) -> None:
        self.session, self.early = session, early

    def obtain(
        self, key: str, take, label: str = "", deadline: float | None = None, wait: bool = True
    ) -> tuple[Measurement, bool]:
        s = self.session
        m, took = s.obtain(key, take, label, wait=not self.early)
        if took:
            s.calibrated.add(key)
        if not self.early:  # the pass that reads every key counts them
            s.counts.measured += key in s.calibrated
            s.counts.reused += key not in s.calibrated
        s.progress.advance(
            f"{label}: " + ("another worker's" if m is None else "measured" if took else "stored")
        )
        return (m if m is not None else _HELD), took
