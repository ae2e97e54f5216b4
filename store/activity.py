"""What a fleet is doing now: per device, the workers measuring and how fast, read from the store.

Every stored measurement carries its worker (``host:pid``) and the time it was stored, so
the storage itself tells which workers are alive (a recent measurement is their
heartbeat) and how many measurements a minute each device serves. Nothing else has to
run for ``partune status`` to show a fleet.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import optuna

from partune.store.measurements import STUDY_PREFIX


@dataclass(frozen=True)
class WorkerActivity:
    worker: str  # host:pid
    last_s: float  # seconds since its latest measurement
    recent: int  # its measurements within the window


@dataclass(frozen=True)
class DeviceActivity:
    device: str
    measurements: int
    per_minute: float  # over the window
    workers: tuple[WorkerActivity, ...]  # seen within the window, latest first


def fleet_activity(
    storage, window_s: float = 600.0, now: dt.datetime | None = None
) -> list[DeviceActivity]:
    """Per device study in ``storage``: its measurements, the rate over the last
    ``window_s`` and the workers that stored one in that window."""
    now = now or dt.datetime.now()
    out = []
    for summary in optuna.get_all_study_summaries(storage):
        if not summary.study_name.startswith(STUDY_PREFIX):
            continue
        trials = optuna.load_study(study_name=summary.study_name, storage=storage).get_trials(
            deepcopy=False
        )
        seen: dict[str, list[float]] = {}
        for t in trials:
            when = t.datetime_complete or t.datetime_start
            age = (now - when).total_seconds() if when else float("inf")
            if age <= window_s:
                who = t.user_attrs.get("worker") or f"?:{t.user_attrs.get('pid', '?')}"
                seen.setdefault(who, []).append(age)
        workers = tuple(
            sorted(
                (WorkerActivity(w, min(ages), len(ages)) for w, ages in seen.items()),
                key=lambda a: a.last_s,
            )
        )
        recent = sum(a.recent for a in workers)
        out.append(
            DeviceActivity(
                summary.study_name[len(STUDY_PREFIX) :],
                len(trials),
                recent / (window_s / 60.0),
                workers,
            )
        )
    return out
