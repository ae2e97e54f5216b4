"""Layer 1 of 8, ``partune.core``: the vocabulary every other layer speaks.

Errors a user can cause, SEScope and CompilationConfig, the dataflow graph and its
sub-graphs, plans, applying a plan to a Relax module, the keys measurements are stored
under, and version fingerprints. Imports TVM and nothing of Partune
(see docs/architecture.md).
"""

from partune.core.exports import lazy_exports

__all__ = [
    "CompilationConfig",
    "DataflowGraph",
    "FINGERPRINT_DIGITS",
    "ModelError",
    "ModelFile",
    "OpKind",
    "PartuneError",
    "Plan",
    "PlanError",
    "Region",
    "SEScope",
    "SubGraph",
    "calibration_keys",
    "candidate_key",
    "casts",
    "clean_error",
    "contiguous_runs",
    "cpu_name",
    "cpu_target",
    "deploy_environment",
    "device_fingerprint",
    "digest",
    "fit_table",
    "flatten_outputs",
    "function_in_bf16",
    "known_shape",
    "last_line",
    "lift_region",
    "main_bindings",
    "model_file_plan",
    "op_counts",
    "op_summary",
    "plan_key",
    "random_array",
    "region_key",
    "region_label",
    "region_order",
    "scope_name",
    "short_op",
    "single_backend_plan",
    "static_shape",
    "tensor_types",
    "trim",
    "variant_label",
    "verdict_key",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "bf16": (
            "casts",
            "function_in_bf16",
        ),
        "describe": (
            "fit_table",
            "op_counts",
            "op_summary",
            "region_label",
            "scope_name",
            "short_op",
            "variant_label",
        ),
        "errors": (
            "ModelError",
            "PartuneError",
            "PlanError",
            "clean_error",
            "last_line",
        ),
        "graph": (
            "DataflowGraph",
            "OpKind",
            "main_bindings",
        ),
        "keys": (
            "FINGERPRINT_DIGITS",
            "calibration_keys",
            "candidate_key",
            "digest",
            "plan_key",
            "region_key",
            "verdict_key",
        ),
        "memory": ("trim",),
        "partition": ("lift_region",),
        "plan": (
            "ModelFile",
            "Plan",
            "Region",
            "contiguous_runs",
            "model_file_plan",
            "region_order",
            "single_backend_plan",
        ),
        "scopes": (
            "CompilationConfig",
            "SEScope",
            "cpu_target",
        ),
        "subgraph": ("SubGraph",),
        "tensors": (
            "flatten_outputs",
            "known_shape",
            "random_array",
            "static_shape",
            "tensor_types",
        ),
        "versions": (
            "cpu_name",
            "deploy_environment",
            "device_fingerprint",
        ),
    },
)
