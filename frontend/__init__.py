"""Layer 3 of 8, ``partune.frontend``: from what a user hands Partune to a Relax module.

The loaders (zoo names, ONNX, torch ExportedProgram, TVMScript), ONNX-level folding, and the
import pipeline of named passes (``frontend.pipeline``, ``frontend/passes``). Imports
``partune.core`` and ``partune.backends`` (see docs/architecture.md).
"""

from partune.frontend.models import Model, load
from partune.frontend.pipeline import NAMES as PASS_NAMES
from partune.frontend.pipeline import PASSES, PassRun, describe_passes, normalise

__all__ = ["PASSES", "PASS_NAMES", "Model", "PassRun", "describe_passes", "load", "normalise"]
