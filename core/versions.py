"""What a measurement or an artifact depends on: library versions and the device.

One place for both fingerprints, so the store, plans and deploy directories agree on
what "the same machine and libraries" means.
"""

from __future__ import annotations

import os
import platform
from importlib.metadata import PackageNotFoundError, version

from partune.core.cpu import cpu_flags
from partune.core.keys import FINGERPRINT_DIGITS, digest

# Packages whose version decides whether a plan's costs still hold.
TOOLS = ("partune", "apache-tvm", "torch", "onnxruntime", "openvino")
# Packages whose version changes what a deployed artifact computes or whether it loads.
PINNED = ("apache-tvm", "apache-tvm-ffi")
BACKEND_PACKAGES = {"torch": "torch", "onnxruntime": "onnxruntime", "openvino": "openvino"}


def tool_versions() -> dict[str, str]:
    """Versions that decide whether a plan's costs still hold (absent packages left out)."""
    out = {"python": platform.python_version()}
    for pkg in TOOLS:
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def instruction_set() -> str:
    """The reduced-precision instructions of this CPU, as benchmark tables name them: AMX
    (bf16 and int8 tiles), VNNI (int8 dot products), else AVX2 or the plain ISA."""
    flags = cpu_flags()
    found = [
        name
        for name, flag in (
            ("AMX-BF16", "amx_bf16"),
            ("AMX-INT8", "amx_int8"),
            ("AVX512-BF16", "avx512_bf16"),
            ("AVX512-VNNI", "avx512_vnni"),
            ("AVX-VNNI", "avx_vnni"),
        )
        if flag in flags
    ]
    if found:
        return ", ".join(found)
    return "AVX-512 (no VNNI)" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no SIMD"


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` says."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    return cpu


def device_fingerprint(threads: int) -> str:
    """What decides whether a measurement still holds: CPU, thread count, library versions."""
    doc = {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "threads": threads,
        "versions": tool_versions(),
    }
    return digest(doc, FINGERPRINT_DIGITS, sort_keys=True)


def deploy_environment(backends: list[str]) -> dict[str, str]:
    """The versions that must match between ``partune export`` and loading the artifact."""
    out = {"python": ".".join(platform.python_version_tuple()[:2]), "machine": platform.machine()}
    for pkg in (*PINNED, *(BACKEND_PACKAGES[b] for b in backends if b in BACKEND_PACKAGES)):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "missing"
    return out
