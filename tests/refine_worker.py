"""One refinement worker in its own process, for the multi-worker tests.

``python -m tests.refine_worker URL STUDY N_TRIALS LOG [SLOW_AT]``: refines the Diamond
plan of ``tests.test_refine`` on a shared storage. Each measurement it takes is logged
as "PID PLAN_KEY"; the SLOW_AT-th measurement of this process logs "SLOW" and sleeps a
minute (a worker to kill mid-trial).
"""

from __future__ import annotations

import os
import sys
import time

from partune.core.keys import plan_key
from partune.core.plan import Plan
from partune.runners.timing import Measurement
from partune.search.refine import refine
from partune.store.measurements import MeasurementStore
from tests.test_refine import ACCEPTED, BASE, CONFIG, GRAPH, _cost


def main(url: str, study: str, n_trials: int, log: str, slow_at: int = -1) -> None:
    store = MeasurementStore(url, "test-device", heartbeat_s=1)
    taken = [0]

    def measure(plan: Plan) -> Measurement:
        def take() -> Measurement:
            with open(log, "a") as f:
                f.write(f"{os.getpid()} {plan_key(plan)}\n")
                if taken[0] == slow_at:
                    f.write("SLOW\n")
            taken[0] += 1
            time.sleep(60 if taken[0] - 1 == slow_at else 0.3)
            c = _cost(plan)
            return Measurement(c, 0.0, c, 1, 1, best_s=c)

        m, _ = store.obtain(plan_key(plan), take, "refine test")
        return m

    refine(
        GRAPH, BASE, CONFIG, ACCEPTED, measure, store.storage, study, n_trials, claims=store.claims
    )


if __name__ == "__main__":
    main(
        sys.argv[1],
        sys.argv[2],
        int(sys.argv[3]),
        sys.argv[4],
        int(sys.argv[5]) if len(sys.argv) > 5 else -1,
    )
