"""Layer 4 of 8, ``partune.runners``: build a plan or a region into something runnable,
and time it, in a local worker process or on an RPC server.

Imports ``partune.core``, ``partune.backends`` and ``partune.frontend`` (the zoo and
the ``.pt2`` reader, to rebuild a torch peer; see docs/architecture.md).
"""

from partune.core.exports import lazy_exports

__all__ = [
    "BF16_PEERS",
    "BuildPool",
    "DEFAULT_PEERS",
    "LIBRARY_PEERS",
    "LocalRunner",
    "Lookahead",
    "Measurement",
    "PEER_LABELS",
    "RPCRunner",
    "Runner",
    "available_peers",
    "build_model_file",
    "build_plan",
    "calibration_module",
    "compare_request",
    "has_bf16",
    "install_codegen",
    "main_compiler",
    "model_onnx",
    "model_origin",
    "overhead_request",
    "partition_plan",
    "peer_kind",
    "peer_label",
    "peer_specs",
    "plan_request",
    "region_request",
    "serve",
    "split_cores",
    "time_callable",
    "time_interleaved",
    "tune_request",
    "unpin_search_process",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "accuracy": ("has_bf16",),
        "build_pool": (
            "BuildPool",
            "Lookahead",
            "split_cores",
            "unpin_search_process",
        ),
        "builder": (
            "build_model_file",
            "build_plan",
            "calibration_module",
            "compare_request",
            "install_codegen",
            "main_compiler",
            "overhead_request",
            "partition_plan",
            "plan_request",
            "region_request",
            "tune_request",
        ),
        "local": ("LocalRunner",),
        "peers": (
            "BF16_PEERS",
            "DEFAULT_PEERS",
            "LIBRARY_PEERS",
            "PEER_LABELS",
            "available_peers",
            "model_onnx",
            "model_origin",
            "peer_kind",
            "peer_label",
            "peer_specs",
        ),
        "rpc": (
            "RPCRunner",
            "serve",
        ),
        "runner": ("Runner",),
        "timing": (
            "Measurement",
            "time_callable",
            "time_interleaved",
        ),
    },
)
