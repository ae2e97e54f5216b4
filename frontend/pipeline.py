"""The import pipeline (``normalise``): the named passes every imported module goes through.

Each pass keeps the model's meaning exactly (the same values, or the same products summed in
another order, as any backend's kernel may) and makes it buildable, uniform, faster, or
takeable by more backends. They run as one ``tvm.transform.Sequential`` under a
``PassContext``, so any of them can be switched off by name (``disabled_pass``; the CLI's
``--disable-pass``), and an instrument times each. The order is the one constraint between
them, and it is stated here, once:

- the cumsum and pool rewrites first: they make the module buildable for the folding;
- ``FoldConstant``, then ``FoldInputFree``: work that depends on no input, done once (masks
  built from constants; then what FoldConstant cannot, work rooted in ``R.arange``);
- the exact idioms after folding: they read constants (mask shapes, Gather's ``n``);
- the softmax guards after folding: the bounds read the folded masks;
- shears and frames on the folded weights (the relative-position keys are folded constants);
- dead code last.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import tvm
from tvm import relax

from partune.core import PartuneError
from partune.frontend.passes.bool_cumsum import CUMSUM_OF_BOOL
from partune.frontend.passes.exact_idioms import CAST_BEFORE_MOVES, FLOAT_TO_BOOL, TAKE_WRAP
from partune.frontend.passes.import_pass import ImportPass, tvm_pass
from partune.frontend.passes.input_free import FOLD_INPUT_FREE
from partune.frontend.passes.relative_shear import RELATIVE_SHEARS
from partune.frontend.passes.softmax_guards import DROP_SOFTMAX_GUARDS
from partune.frontend.passes.waveform_frames import WAVEFORM_FRAMES
from partune.frontend.passes.whole_input_pool import WHOLE_INPUT_POOL

PASSES: tuple[ImportPass, ...] = (
    CUMSUM_OF_BOOL,
    WHOLE_INPUT_POOL,
    tvm_pass(
        "FoldConstant",
        "TVM's constant folding: work on constants done once",
        relax.transform.FoldConstant,
    ),
    FOLD_INPUT_FREE,
    CAST_BEFORE_MOVES,
    FLOAT_TO_BOOL,
    TAKE_WRAP,
    DROP_SOFTMAX_GUARDS,
    RELATIVE_SHEARS,
    WAVEFORM_FRAMES,
    tvm_pass(
        "DeadCodeElimination",
        "TVM's dead code elimination: what the rewrites left unused",
        lambda: relax.transform.DeadCodeElimination(["main"]),
    ),
)
NAMES: tuple[str, ...] = tuple(p.name for p in PASSES)


@dataclass(frozen=True)
class PassRun:
    """What one pass did to one model: whether it ran, its time, and the places it rewrote."""

    name: str
    ran: bool
    seconds: float
    rewrites: int


@tvm.instrument.pass_instrument
class _Timer:
    """Wall time of each pipeline pass (outermost run only: a pass may call TVM's of the same
    name)."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = set(names)
        self.seconds: dict[str, float] = {}
        self._depth: dict[str, int] = {}
        self._start: dict[str, float] = {}

    def run_before_pass(self, _mod, info) -> None:
        if info.name in self.names:
            self._depth[info.name] = self._depth.get(info.name, 0) + 1
            if self._depth[info.name] == 1:
                self._start[info.name] = time.perf_counter()

    def run_after_pass(self, _mod, info) -> None:
        if info.name in self.names:
            self._depth[info.name] -= 1
            if self._depth[info.name] == 0:
                self.seconds[info.name] = time.perf_counter() - self._start[info.name]


def check_pass_names(names: Iterable[str]) -> tuple[str, ...]:
    """``names`` if each is a pipeline pass; a one-line error naming the passes otherwise."""
    names = tuple(names)
    if unknown := [n for n in names if n not in NAMES]:
        raise PartuneError(
            f"no import pass named {', '.join(unknown)} (passes: {', '.join(NAMES)}; "
            "see partune --list-passes)"
        )
    return names


def normalise(
    mod: tvm.IRModule, disabled: Iterable[str] = ()
) -> tuple[tvm.IRModule, list[PassRun]]:
    """``mod`` through every pipeline pass not in ``disabled``, and what each pass did."""
    disabled = check_pass_names(disabled)
    counts: dict[str, int] = {}
    timer = _Timer(NAMES)
    pipeline = tvm.transform.Sequential([p.make(counts) for p in PASSES], name="PartuneImport")
    with tvm.transform.PassContext(disabled_pass=list(disabled), instruments=[timer]):
        mod = pipeline(mod)
    runs = [
        PassRun(n, n in timer.seconds, timer.seconds.get(n, 0.0), counts.get(n, 0)) for n in NAMES
    ]
    return mod, runs


def describe_passes() -> str:
    """The pipeline, one pass a line, in the order it runs (``partune --list-passes``)."""
    width = max(map(len, NAMES))
    return "\n".join(f"{p.name:<{width}}  {p.summary}" for p in PASSES)


def describe_runs(runs: list[PassRun]) -> str:
    """What each pass did to one model (``partune run -v``)."""
    width = max(len(r.name) for r in runs)
    return "\n".join(
        f"pass {r.name:<{width}}  "
        + (f"{r.seconds * 1e3:8.1f} ms  {r.rewrites} rewritten" if r.ran else "disabled")
        for r in runs
    )
