"""What a search reports: counts, tuning, the plans it measured, and the verdict.

Split by kind so a front end reads only what it shows: the CLI summary reads counts
and tuning, the report reads plans, the plan's notes come from the verdict.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from partune.core import Plan
from partune.cost_models import BorderModel
from partune.runners import Measurement
from partune.search.dp import Cover
from partune.search.refine import Refined


@dataclass
class Progress:
    """Callbacks a front end implements to show progress (all optional)."""

    start_phase: Callable[[str, int], None] = lambda name, total: None
    advance: Callable[[str], None] = lambda status: None


@dataclass
class Counts:
    """How much was measured, reused and left out."""

    candidates: int = 0
    measured: int = 0
    reused: int = 0
    failed: int = 0
    skipped: int = 0  # candidates the cost model ranked out of measuring

    def took(self, taken: bool, ok: bool) -> None:
        """Count one measurement: taken now (ok or failed), or reused from the store."""
        self.measured += taken
        self.failed += taken and not ok
        self.reused += not taken


@dataclass
class TuningStats:
    """What auto-tuning (MetaSchedule) did in this run."""

    regions: int = 0
    trials: int = 0
    seconds: float = 0.0
    achieved: dict[str, list[float]] = field(
        default_factory=dict
    )  # speed-ups measured, per op kind


@dataclass
class MemoryPeaks:
    """The highest resident size (bytes) each kind of process reached; 0 where not known (a
    remote runner, no build pool). Shown so that a search near the machine's memory says where."""

    search: int = 0
    measuring: int = 0  # the measuring workers, each replaced one included
    measuring_recycled: int = 0  # measuring workers replaced for their size or age
    build_pool: int = 0
    build_pool_recycled: int = 0

    @classmethod
    def of(cls, runner: object, pool: object = None) -> MemoryPeaks:
        """This process's peak, and what ``runner`` and ``pool`` saw of their workers' peaks
        (``LocalRunner.peak_rss_bytes``, ``BuildPool.peak_rss_bytes``)."""
        import resource

        return cls(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # KiB on Linux
            getattr(runner, "peak_rss_bytes", 0),
            getattr(runner, "recycled", 0),
            getattr(pool, "peak_rss_bytes", 0),
            getattr(pool, "recycled", 0),
        )


@dataclass
class Verdict:
    """Finalist plans and peers, timed interleaved in one process."""

    measurements: dict[str, Measurement] = field(default_factory=dict)  # label -> measurement
    peers: tuple[str, ...] = ()  # which labels are peers (not Partune plans)
    threads: int = 1  # at more than one, each contender was timed in a process of its own
    tolerance: float | None = None  # with bf16: a peer whose error is above it is no bar to beat
    left_out: str = ""  # finalists not timed, and why (the memory they would need)

    def over_budget(self, label: str) -> bool:
        m = self.measurements.get(label)
        return (
            self.tolerance is not None
            and m is not None
            and m.rel_error is not None
            and not m.rel_error <= self.tolerance
        )

    @property
    def how(self) -> str:
        """How the contenders were timed, in words."""
        return (
            "one process"
            if self.threads == 1
            else f"{self.threads} threads, a process each, one at a time"
        )

    @property
    def best_peer(self) -> str | None:
        ok = [
            p
            for p in self.peers
            if self.measurements.get(p) is not None
            and self.measurements[p].ok
            and not self.over_budget(p)
        ]
        return min(ok, key=lambda p: self.measurements[p].median_s) if ok else None


@dataclass
class TuneResult:
    counts: Counts = field(default_factory=Counts)
    tuning: TuningStats = field(default_factory=TuningStats)
    verdict: Verdict = field(default_factory=Verdict)
    plan: Plan | None = None  # the emitted plan: fastest measured end to end
    dp_plan: Plan | None = None
    cover: Cover | None = None
    end_to_end: dict[str, Measurement] = field(default_factory=dict)  # plan label -> measurement
    plans: dict[str, Plan] = field(default_factory=dict)  # plan label -> the plan measured under it
    search_s: float = 0.0
    timed_out: bool = False
    adjust_s: dict[str, float] = field(
        default_factory=dict
    )  # per scope: whole-model minus isolated
    border: BorderModel = field(default_factory=BorderModel)  # learned from the plans measured
    dp_label: str | None = None  # the DP's final plan (after border refinement) among end_to_end
    dp_estimate_s: float | None = None  # its cost predicted before it was measured
    inputs_from: str = "model"  # what candidates were measured on: "model" values or "random"
    trained: list = field(default_factory=list)  # (candidate, measurement) taken this run
    cost_model: object = None  # the cost model after learning from this run's measurements
    refine_study: str | None = None  # the Optuna study of the refinement
    refined: Refined | None = None  # its outcome: the fastest variant, trials, whether it converged
    # latency+memory refinement: the Pareto front, (Plan, Measurement), fastest first
    front: tuple = ()
    memory: MemoryPeaks = field(default_factory=MemoryPeaks)  # peak resident size of each process
