"""How one search runs: the options ``partune.search.collage.tune`` passes to a
``SearchSession``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from partune.core import Plan, SEScope
from partune.cost_models import CostModel
from partune.runners import DEFAULT_PEERS, BuildPool
from partune.search.budget import Budget
from partune.search.result import Progress

DEFAULT_TOLERANCE = 1e-2  # the accuracy budget a reduced precision gets unless told otherwise


@dataclass
class TuneOptions:
    """How a search runs; see ``partune.search.collage.tune`` for what each one does."""

    threads: int = 1
    pins: dict[int, SEScope] | None = None
    deadline: float | None = None  # ``time.monotonic``: candidate measuring and refinement stop
    progress: Progress | None = None
    peers: tuple[str, ...] = DEFAULT_PEERS
    refine_trials: int | None = 0  # None: until refinement converges, or the deadline
    previous: Plan | None = None  # what an earlier run of the same job emitted: it competes again
    cost_model: CostModel | None = None
    memory: bool = False
    worker_only: bool = False
    tune_budget_s: float = 0.0  # 0 with a budget: a share of the time the candidates left
    tune_trials: int = 32
    build_pool: BuildPool | None = None
    precision: str = (
        "f32"  # "bf16": regions may compute in bf16 where a backend can (``search.precision``);
        # "int8": in int8 too (``search.int8_calibration``)
    )
    tolerance: float | None = None  # with bf16 or int8: the largest relative error a plan may have
    calibration: tuple[list[np.ndarray], ...] = ()  # int8's samples (none: drawn like the inputs)
    # What reduced-precision plans and peers are judged on: the user's samples by ``metric``
    # (none: the inputs and a held-out draw like them, by relative error).
    validation: tuple[list[np.ndarray], ...] = ()
    metric: str = "rel"
    one_thread_regions: bool = (
        True  # on many threads, library regions may run on one (``SEScope.threads``)
    )
    budget: Budget | None = (
        None  # a time budget to spend (``partune.search.budget``), not only respect
    )

    @property
    def accuracy_budget(self) -> float:
        """``tolerance``, or the default budget a reduced precision gets."""
        return self.tolerance if self.tolerance is not None else DEFAULT_TOLERANCE
