"""Layer 5 of 8, ``partune.store``: every measurement kept in Optuna storage under a
stable key, and the claims that keep workers sharing a storage from taking one twice.

Imports the layers below: core, backends, runners (see docs/architecture.md).
"""

from partune.core.exports import lazy_exports

__all__ = [
    "Claims",
    "FIRST_POLL_S",
    "MEMORY",
    "MeasurementStore",
    "Notes",
    "POLL_S",
    "STUDY_PREFIX",
    "alive",
    "fleet_activity",
    "pid_alive",
    "read_measurements",
    "shown",
    "with_driver",
    "worker_id",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "activity": ("fleet_activity",),
        "claims": (
            "Claims",
            "alive",
            "pid_alive",
            "worker_id",
        ),
        "measurements": (
            "FIRST_POLL_S",
            "MEMORY",
            "MeasurementStore",
            "POLL_S",
            "STUDY_PREFIX",
            "read_measurements",
            "shown",
            "with_driver",
        ),
        "notes": ("Notes",),
    },
)
