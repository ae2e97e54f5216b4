"""How a search spends a time budget (``partune tune --timeout``) that nothing else bounds.

Without a budget, a search does a fixed amount of work: every candidate, a few end-to-end
plans, ``--refine-trials`` variants, and a small model is done in minutes. Given a budget
(an overnight job), the time left after the candidates goes where the search expects gains:

- **tuning** (MetaSchedule) of the TVM regions that the DP would take if they tuned as
  expected, or on longer budgets as hoped (``Budget.optimism``; ``partune.search.autotune``
  picks them, most gain first), with half of what is left; budgets of at least
  ``TUNE_FROM_S`` put tvm-tuned on offer (below that, a tuning run buys too little),
  shorter ones tune only where the user named it;
- **refinement** (Optuna) for the rest, until no variant in ``PATIENCE`` trials beat the
  best, the variants run out, or the time is up;
- the **verdict** keeps the last ``RESERVE_SHARE`` of the budget (at least ``RESERVE_MIN_S``).

Each share stops early when it has nothing left to gain, so a small model does not spend
the night on nothing: an explicit ``--refine-trials`` or ``--tune-budget`` overrides its share.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

TUNE_FROM_S = 1800.0  # budgets from 30 minutes on tune TVM regions (tvm-tuned joins the backends)
TUNE_SHARE = 0.5  # of the time left after the candidates, before the reserve
RESERVE_SHARE = 0.1  # kept for the end-to-end plans' verdict against the peers
RESERVE_MIN_S = 60.0
PATIENCE = 16  # refinement has converged when this many trials in a row found nothing faster
TRIALS_CAP = 10_000  # the refinement study's bound when time and convergence bound it instead


@dataclass(frozen=True)
class Budget:
    """A search's time budget: ``deadline`` is ``time.monotonic``-based, ``total_s`` its length."""

    deadline: float
    total_s: float

    @classmethod
    def of(cls, total_s: float) -> Budget:
        return cls(time.monotonic() + total_s, total_s)

    @property
    def tunes(self) -> bool:
        """Whether this budget is long enough to tune TVM regions."""
        return self.total_s >= TUNE_FROM_S

    @property
    def optimism(self) -> float:
        """How much more than usual tuning may be hoped to buy when picking regions to tune:
        1 up to ``TUNE_FROM_S``, then growing with the square root of the budget (1.7 at 90
        minutes, 4 at 8 hours). The night is spent on regions that would win only if
        tuning went unusually well; each region tuned corrects the hope for its kind."""
        return max(1.0, self.total_s / TUNE_FROM_S) ** 0.5

    @property
    def until(self) -> float:
        """When tuning and refinement stop: the verdict's reserve is left."""
        return self.deadline - max(RESERVE_MIN_S, RESERVE_SHARE * self.total_s)

    def tuning_s(self) -> float:
        """Seconds for tuning, asked once the candidates are measured: a share of what is left
        (where tuning is on offer: by ``tunes``, or because the user named tvm-tuned)."""
        return TUNE_SHARE * max(self.until - time.monotonic(), 0.0)
