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
    from partune.frontend.models import load

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
    """Change the backends' settings (``partune.backends.settings``) for one test; restored
    after."""
    from dataclasses import replace

    from partune.backends import registry

    before = registry.settings()

    def change(**values) -> None:
        registry.configure(replace(registry.settings(), **values))

    yield change
    registry.configure(before)


@pytest.fixture(scope="session")
def postgres_server():
    """A real PostgreSQL on loopback for this session (``tests.postgres``).

    Skipped only where the server binaries are absent; a server that is there and will not
    start is an error, never a silent pass.
    """
    from tests.postgres import local_postgres, postgres_bin

    if postgres_bin() is None:
        pytest.skip("no PostgreSQL server binaries (/usr/lib/postgresql/*/bin)")
    with local_postgres() as server:
        yield server


@pytest.fixture
def postgres_url(postgres_server, request):
    """A fresh, empty database on the session's PostgreSQL, as a storage URL."""
    name = "t_" + "".join(c if c.isalnum() else "_" for c in request.node.name)[-50:].lower()
    return postgres_server.create_database(name)


@pytest.fixture(params=["sqlite", "postgres"])
def storage_url(request, tmp_path):
    """The same test on SQLite and on a real PostgreSQL (``-k postgres`` selects the latter)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'm.db'}"
    return request.getfixturevalue("postgres_url")
