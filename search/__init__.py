"""Layer 7 of 8, ``partune.search``: partition rules, candidates, the DP, auto-tuning,
refinement, the verdict, and the session that runs them in order.

Imports every layer below it (see docs/architecture.md).
"""

from partune.core.exports import lazy_exports

__all__ = [
    "Budget",
    "CANDIDATE_PROTOCOL",
    "Counts",
    "MemoryPeaks",
    "NOT_MEASURED",
    "PATIENCE",
    "Progress",
    "Samples",
    "TuneOptions",
    "accepted_nodes",
    "anchor_kind",
    "backend_plan",
    "calibrate",
    "enumerate_candidates",
    "expected_speedup",
    "leave_one_model_out",
    "model_file_data",
    "samples_for",
    "schedulable",
    "tune",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "budget": (
            "Budget",
            "PATIENCE",
        ),
        "calibration": ("calibrate",),
        "candidates": (
            "accepted_nodes",
            "backend_plan",
            "enumerate_candidates",
        ),
        "cost_model_eval": (
            "Samples",
            "leave_one_model_out",
            "samples_for",
        ),
        "dp": ("schedulable",),
        "model_file_recipe": ("model_file_data",),
        "options": ("TuneOptions",),
        "result": (
            "Counts",
            "MemoryPeaks",
            "Progress",
        ),
        "session": (
            "CANDIDATE_PROTOCOL",
            "NOT_MEASURED",
        ),
        "collage": ("tune",),
        "tuning": (
            "anchor_kind",
            "expected_speedup",
        ),
    },
)
