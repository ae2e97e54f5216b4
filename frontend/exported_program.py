"""Reading a torch ExportedProgram (``.pt2``) without running pickle.

A ``.pt2`` file holds pickled tensors; ``torch.export.load`` falls back to full pickle for
them unless told otherwise, and a file from elsewhere could then run anything. The loader
of ``.pt2`` models and the runners that rebuild a torch peer both read through here.
"""

from __future__ import annotations

import io
import os
import warnings


def load_program(data: bytes):
    """An ExportedProgram read with torch's weights-only unpickler forced for every tensor
    file inside: ``torch.export.load`` otherwise falls back to full pickle, and a .pt2 file
    from elsewhere could run anything."""
    import torch

    before = os.environ.get(_WEIGHTS_ONLY)
    os.environ[_WEIGHTS_ONLY] = "1"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.export.load(io.BytesIO(data))
    finally:
        if before is None:
            os.environ.pop(_WEIGHTS_ONLY, None)
        else:
            os.environ[_WEIGHTS_ONLY] = before


_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
