"""Layer 3 of 8, ``partune.frontend``: from what a user hands Partune to a Relax module.

The loaders (zoo names, ONNX, torch ExportedProgram, TVMScript), the shapes a job tunes at
(``--shapes``), the user's calibration and validation samples, ONNX-level folding, and the
import pipeline of named passes (``frontend.pipeline``, ``frontend/passes``). Imports
``partune.core`` and ``partune.backends`` (see docs/architecture.md).
"""

from partune.core.exports import lazy_exports

__all__ = [
    "FileShapes",
    "Model",
    "ShapePoint",
    "ZOO",
    "describe_passes",
    "describe_runs",
    "file_shapes",
    "load",
    "load_program",
    "load_samples",
    "pad_safe",
    "read_file_shapes",
    "split_samples",
    "synthetic_samples",
    "tuning_points",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "exported_program": ("load_program",),
        "models": (
            "Model",
            "load",
        ),
        "pipeline": (
            "describe_passes",
            "describe_runs",
        ),
        "samples": (
            "load_samples",
            "split_samples",
            "synthetic_samples",
        ),
        "shapes": (
            "FileShapes",
            "ShapePoint",
            "file_shapes",
            "pad_safe",
            "read_file_shapes",
            "tuning_points",
        ),
        "zoo": ("ZOO",),
    },
)
