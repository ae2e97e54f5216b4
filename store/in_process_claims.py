"""Claims held in this process: the in-memory store has one worker, so a dict will do."""

from __future__ import annotations

from partune.store.claims import DONE, Claims, worker_id


class InProcessClaims(Claims):
    """Claims that never leave this process (``MeasurementStore(MEMORY, ...)``)."""

    def __init__(self) -> None:
        self.owner = worker_id()
        self._expires: dict[str, float] = {}

    def claim(self, key: str) -> bool:
        if key in self._expires:
            return False
        self._expires[key] = 0.0
        return True

    def done(self, key: str) -> None:
        if key in self._expires:
            self._expires[key] = DONE

    def release(self, key: str) -> None:
        if self._expires.get(key) != DONE:
            self._expires.pop(key, None)

    def is_done(self, key: str) -> bool:
        return self._expires.get(key) == DONE

    def holder(self, key: str) -> str | None:
        return self.owner if key in self._expires else None
