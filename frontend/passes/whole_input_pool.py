"""``WholeInputPoolAsReduction``: a 2-D pool whose one window covers the whole unpadded input
is a mean (max) over H, W.

Hugging Face EfficientNet pools with ``AvgPool2d(hidden_dim, ceil_mode=True)``: a 1280-wide
window over a 7x7 map. Every framework clips the window to the input (the divisor is H*W),
but kept as a pool it costs untuned TVM a loop over 1280^2 taps per channel (the
OpenVINO-only plan ran it there: 0.7 s), and OpenVINO refuses a kernel larger than its
input. As a reduction it is a global pool for every backend.
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.dpl import is_op, wildcard

from partune.core import known_shape
from partune.frontend.passes.import_pass import ImportPass, by_pattern

_X = wildcard()
_POOL = is_op("relax.nn.avg_pool2d")(_X) | is_op("relax.nn.max_pool2d")(_X)


def _whole_window(call: relax.Call) -> bool:
    """NCHW in and out, no padding or dilation, a 1x1 output and a window no smaller than
    the input."""
    a = call.attrs
    hw, out = known_shape(call.args[0].ty), known_shape(call.ty)
    if (
        str(a.layout) != "NCHW"
        or str(a.out_layout) != "NCHW"
        or hw is None
        or out is None
        or len(hw) != 4
    ):
        return False
    return (
        list(out[2:]) == [1, 1]
        and not any(int(p) for p in a.padding)
        and all(int(d) == 1 for d in a.dilation)
        and all(int(k) >= n for k, n in zip(a.pool_size, hw[2:], strict=True))
    )


def _as_reduction(call: relax.Call, matched: dict) -> relax.Expr | None:
    if not _whole_window(call):
        return None
    op = relax.op.mean if call.op.name == "relax.nn.avg_pool2d" else relax.op.max
    return op(matched[_X], axis=[2, 3], keepdims=True)


WHOLE_INPUT_POOL = ImportPass(
    "WholeInputPoolAsReduction",
    "a pool whose window covers its whole "
    "input as a mean/max over H, W (a global pool for every backend)",
    by_pattern(_POOL, _as_reduction),
)
