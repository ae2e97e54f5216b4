"""Layer 2 of 8, ``partune.backends``: real libraries and compilers, one module a backend.

The search reaches them only through ``registry``. Imports ``partune.core`` only
(see docs/architecture.md).
"""

from partune.core.exports import lazy_exports

__all__ = [
    "BackendError",
    "LIBRARIES",
    "ModelFileError",
    "OnnxGraph",
    "Settings",
    "UnknownBackendError",
    "checksums",
    "compile_config",
    "compile_module",
    "first_damaged",
    "open_model_file",
    "openvino_core",
    "openvino_model",
    "relax_to_onnx",
    "sha256",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "base": ("BackendError",),
        "checksum": (
            "checksums",
            "first_damaged",
        ),
        "model_file": (
            "LIBRARIES",
            "ModelFileError",
            "open_model_file",
            "openvino_model",
            "sha256",
        ),
        "onnx_graph": ("OnnxGraph",),
        "openvino_backend": (
            "compile_config",
            "openvino_core",
        ),
        "registry": ("UnknownBackendError",),
        "relax_onnx": ("relax_to_onnx",),
        "settings": ("Settings",),
        "tvm_backend": ("compile_module",),
    },
)
