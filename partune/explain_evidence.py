"""What ``partune explain`` reads: a device's measurements in the store, and what the backends
accept and propose for a model, as ``Evidence``. It reads; it neither builds nor times anything.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from partune.core import Plan, scope_name
from partune.runners import Measurement

if TYPE_CHECKING:
    from partune.frontend import Model

# After ":tuned" in a key: the trials (search/autotune.py).
_TUNED = re.compile(r"(?:-partial)?(\d+)")


@dataclass(frozen=True)
class Evidence:
    """What the store and the backends say about a model's plan, read once."""

    measured: Mapping[str, Measurement]  # store key -> latest measurement (this device)
    accepted: Mapping[str, frozenset[int]]  # backend -> the nodes it accepts
    proposed: Mapping[str, frozenset[tuple[int, ...]]]  # backend -> node sets its rule proposes
    # backend -> per-call cost in a model
    adjust_s: Mapping[str, float] = field(default_factory=dict)
    fusion: Mapping[str, str] = field(default_factory=dict)  # backend -> fusion style
    # candidate key -> its tuned measurement's key
    tuned: Mapping[str, str] = field(default_factory=dict)
    device: str = ""
    autotuned: frozenset[str] = frozenset()  # backends whose regions are measured once tuned


def read_measurements(storage: str, device: str) -> dict[str, Measurement] | None:
    """Every measurement of ``device`` in ``storage``, the latest per key; None when it holds
    none."""
    import optuna

    from partune.store import STUDY_PREFIX
    from partune.store import read_measurements as read_study

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        return read_study(storage, STUDY_PREFIX + device)
    except KeyError:
        return None


@dataclass(frozen=True)
class _ReadOnlyStore:
    """What ``calibrate`` asks a store, answered from stored measurements: it never takes one."""

    measured: Mapping[str, Measurement]

    def obtain(self, key: str, take: Callable[[], Measurement], label: str = "", *_, **__):
        m = self.measured.get(key)
        return (m if m is not None else Measurement.failed("not calibrated")), False


def _tuned_keys(measured: Mapping[str, Measurement]) -> dict[str, str]:
    """Candidate key -> the key of its tuned measurement with the most trials."""
    best: dict[str, tuple[int, str]] = {}
    for key in measured:
        base, sep, tail = key.rpartition(":tuned")
        if sep and (m := _TUNED.fullmatch(tail)) and int(m.group(1)) >= best.get(base, (-1, ""))[0]:
            best[base] = (int(m.group(1)), key)
    return {base: key for base, (_, key) in best.items()}


def gather_evidence(
    plan: Plan, model: Model, measured: Mapping[str, Measurement], device: str
) -> Evidence:
    """What the backends accept and propose for ``model``, and the per-call costs stored."""
    from partune.backends import registry
    from partune.search import (
        CANDIDATE_PROTOCOL,
        Counts,
        accepted_nodes,
        calibrate,
        enumerate_candidates,
        schedulable,
    )

    backends = plan.config.backends
    accepted = {b: frozenset(accepted_nodes(model.mod["main"], b)) for b in backends}
    proposed: dict[str, set[tuple[int, ...]]] = {b: set() for b in backends}
    for c in enumerate_candidates(model.mod, model.graph, plan.config, model.pins):
        if schedulable(c):
            proposed[c.backend].add(c.subgraph.nodes)
    adjust = calibrate(None, _ReadOnlyStore(measured), plan.config, Counts(), CANDIDATE_PROTOCOL)  # type: ignore[arg-type]
    return Evidence(
        measured,
        accepted,
        {b: frozenset(s) for b, s in proposed.items()},
        {scope_name(s): v for s, v in adjust.items() if s.backend},
        {b: registry.get(b).fusion_style.value for b in backends},
        _tuned_keys(measured),
        device,
        frozenset(b for b in backends if registry.get(b).autotuned),
    )
