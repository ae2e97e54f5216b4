"""What the phases kept apart read of a search session: auto-tuning, border rounds, refinement,
the finalists, the verdict and precision repair.

They are phases of ``SearchSession`` kept in modules of their own, and the session calls
them; typed by the session itself they would import it back (a cycle, type-only but real to
a reader and to the architecture test). So they are typed by this ``Protocol``: the
attributes and methods they use, and nothing else of the session.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from partune.core import PRECISIONS

if TYPE_CHECKING:
    import tvm

    from partune.core import Calibration, CompilationConfig, DataflowGraph, Plan, Region, SEScope
    from partune.cost_models import BorderModel
    from partune.frontend import Model
    from partune.runners import Measurement, Runner, Validation
    from partune.search.candidates import Candidate
    from partune.search.dp import Cover
    from partune.search.options import TuneOptions
    from partune.search.result import Counts, Progress, TuneResult
    from partune.store import MeasurementStore


class SessionView(Protocol):
    """The narrow face of ``SearchSession`` its phase modules see."""

    model: Model
    backends: list[str]
    mod: tvm.IRModule
    graph: DataflowGraph
    config: CompilationConfig
    options: TuneOptions
    store: MeasurementStore
    runner: Runner
    progress: Progress
    result: TuneResult
    cands: list[Candidate]
    keys: dict[Candidate, str]
    autotuned: set[str]
    adjust: dict[SEScope, float]
    tuned: dict[str, str]
    label_of: dict[str, str]
    validation: Validation | None
    calibration: Calibration | None
    values: dict | None  # the model's intermediate values, once captured

    def capture(self) -> dict: ...

    @property
    def counts(self) -> Counts: ...

    @property
    def module_file(self) -> Path: ...

    def cost(self, c: Candidate) -> float: ...

    def stored_cost(self, region: Region) -> float | None: ...

    def measure_candidates(
        self, batch: dict[str, Candidate], meanwhile: Any = None, phase: bool = True
    ) -> None: ...

    def offer(self, label: str, plan: Plan, always: bool = False) -> bool: ...

    def measure(
        self,
        plan: Plan,
        label: str,
        fresh: bool = False,
        wait: bool = True,
        metric: str | None = None,
    ) -> Measurement | None: ...

    def end_to_end(self, label: str, plan: Plan) -> Measurement: ...

    def end_to_end_all(self, plans: dict[str, Plan]) -> None: ...

    def dp(
        self,
        allowed: set[str],
        border: BorderModel | None = None,
        precisions: tuple[str, ...] = PRECISIONS,
    ) -> tuple[Cover, Plan] | None: ...

    def hopeless(self, estimate_s: float) -> Measurement | None: ...

    def second_opinions(self, border: BorderModel | None = None, suffix: str = "") -> list[str]: ...
