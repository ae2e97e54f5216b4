"""Shared fixtures: imported small zoo models are cached for the whole session."""

from __future__ import annotations

import os
import warnings

import pytest

os.environ.setdefault("TVM_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore", category=FutureWarning)

_cache: dict = {}


def load_model(name: str):
    from partune.models import load

    if name not in _cache:
        _cache[name] = load(name)
    return _cache[name]


@pytest.fixture(scope="session")
def bert():
    return load_model("bert-small")


@pytest.fixture(scope="session")
def resnet():
    return load_model("resnet50-small")


@pytest.fixture
def backend_settings():
    """Change the backends' settings (``partune.backends.settings``) for one test; restored after."""
    from dataclasses import replace

    from partune.backends import registry

    before = registry.settings()

    def change(**values) -> None:
        registry.configure(replace(registry.settings(), **values))

    yield change
    registry.configure(before)
