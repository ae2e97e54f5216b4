"""What travels between the search and the processes that measure: arrays as text.

Requests and replies cross a pipe (a local worker) or TVM RPC (a remote one) as
JSON-able dicts, so arrays travel as base64 ``.npy`` (no pickle: a reply never runs code).
"""

from __future__ import annotations

import base64
import io

import numpy as np


def encode_array(a: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def decode_array(s: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(s)), allow_pickle=False)


def random_array(shape: tuple[int, ...], dtype: str, rng: np.random.Generator) -> np.ndarray:
    """Random data of a dtype: normal floats; 0/1 integers and bools, valid as any index."""
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if np.issubdtype(np.dtype(dtype), np.integer):
        return rng.integers(0, 2, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)
