"""File checksums for directories whose files are checked before a library loads them.

Both the deploy directory (``partune.deployed``) and the build cache
(``partune.backends.build_cache``) hand files to ``dlopen`` or a model loader; a truncated or
edited file must be refused first, not crash the process.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping


def sha256_file(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def checksums(directory: str | os.PathLike, names: Iterable[str]) -> dict[str, str]:
    """``{name: sha256}`` of the named files of ``directory``."""
    return {name: sha256_file(os.path.join(directory, name)) for name in names}


def first_damaged(directory: str | os.PathLike, files: Mapping[str, str]) -> str | None:
    """Why the first damaged file of ``files`` (name -> sha256) is damaged; None when all match."""
    for name, digest in files.items():
        full = os.path.join(directory, name)
        if not os.path.isfile(full):
            return f"{name} is missing"
        if sha256_file(full) != digest:
            return f"{name} was modified (checksum mismatch)"
    return None
