"""Partune's own settings, as one object that travels with every request.

Where TVM's MetaSchedule records are (``--tvm-database``), where the tuned-TVM backend
keeps its tuning database, and which backends beyond the built-in ones exist (test-only
backends, say). The front end sets them once in the registry (``registry.configure``);
runners copy them into every request, so a measuring worker or an RPC server builds
with exactly what the search process has, and nothing rides on environment variables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Settings:
    """The settings backends read (``Backend.configure``); immutable, compared by value."""

    tvm_database: str | None = None  # MetaSchedule records every TVM build applies
    tuning_database: str | None = None  # where tvm-tuned tunes into and builds from
    extra_backends: tuple[
        tuple[str, str], ...
    ] = ()  # (name, "module:Class"), beyond the built-in ones

    def to_json(self) -> dict[str, Any]:
        return {
            "tvm_database": self.tvm_database,
            "tuning_database": self.tuning_database,
            "extra_backends": [list(e) for e in self.extra_backends],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Settings:
        return cls(
            data.get("tvm_database"),
            data.get("tuning_database"),
            tuple((str(n), str(t)) for n, t in data.get("extra_backends", ())),
        )
