"""A named rewrite of an imported module: what ``normalise`` runs, and what a user can switch off.

Each import rewrite is a TVM module pass with a name (``tvm.transform.module_pass``), so the
pipeline is a ``tvm.transform.Sequential`` under a ``PassContext``: ``disabled_pass`` turns
any of them off by name (``partune --disable-pass NAME``), and a pass instrument times each.
A rewrite also says how many places it changed, which no TVM pass reports: ``ImportPass``
pairs the pass with that count, kept per pipeline run (no state outlives one ``normalise``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import tvm
from tvm import relax
from tvm.relax.dpl import DFPattern

Rewrite = Callable[[tvm.IRModule], tuple[tvm.IRModule, int]]  # the module and places rewritten


@dataclass(frozen=True)
class ImportPass:
    """One rewrite: its pass name, a line on what it does and why, and the rewrite itself."""

    name: str
    summary: str
    rewrite: Rewrite

    def make(self, counts: dict[str, int]) -> tvm.transform.Pass:
        """The TVM pass; each run adds the places it rewrote to ``counts[name]``."""

        def run(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
            out, n = self.rewrite(mod)
            counts[self.name] = counts.get(self.name, 0) + n
            return out

        return tvm.transform.module_pass(run, opt_level=0, name=self.name)


def on_main(mutator_type: type) -> Rewrite:
    """The rewrite of ``main`` by a fresh ``PyExprMutator`` of ``mutator_type`` that counts its
    rewrites in ``self.rewrites``."""

    def rewrite(mod: tvm.IRModule) -> tuple[tvm.IRModule, int]:
        mutator = mutator_type()
        main = mutator.visit_expr(mod["main"])
        if not mutator.rewrites:
            return mod, 0
        return with_main(mod, main), mutator.rewrites

    return rewrite


def by_pattern(
    pattern: DFPattern, rewriter: Callable[[relax.Call, dict], relax.Expr | None]
) -> Rewrite:
    """The rewrite of ``main`` by TVM's pattern language: each call that ``pattern`` matches
    (through ``main``'s bindings) becomes what ``rewriter(call, matches)`` returns, or stays
    where it returns None.

    Matched with ``DFPattern.extract_matched_expr`` inside a mutator rather than rewritten by
    ``rewrite_call``: that one also drops every var-to-var binding of the function, which
    would change the graph (and so every store key) of a model it only touched elsewhere.
    """

    def rewrite(mod: tvm.IRModule) -> tuple[tvm.IRModule, int]:
        mutator = _PatternMutator(pattern, rewriter, relax.analysis.get_var2val(mod["main"]))
        main = mutator.visit_expr(mod["main"])
        return (with_main(mod, main), mutator.rewrites) if mutator.rewrites else (mod, 0)

    return rewrite


@relax.expr_functor.mutator
class _PatternMutator(relax.PyExprMutator):
    def __init__(self, pattern: DFPattern, rewriter: Callable, var2val: dict) -> None:
        super().__init__()
        self.pattern, self.rewriter, self.var2val = pattern, rewriter, var2val
        self.var_of = {
            value: var for var, value in var2val.items()
        }  # the matcher sees through vars
        self.rewrites = 0

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        matched = self.pattern.extract_matched_expr(call, self.var2val)
        new = super().visit_call_(call)
        if matched is None:
            return new
        # the matched values by the vars that hold them, as this mutator names those vars
        leaves = {p: self.visit_expr(self.var_of.get(e, e)) for p, e in matched.items()}
        out = self.rewriter(new, leaves)
        if out is None:
            return new
        self.rewrites += 1
        return out


def with_main(mod: tvm.IRModule, main: tvm.ir.BaseFunc) -> tvm.IRModule:
    """A copy of ``mod`` with ``main`` replaced (a module pass leaves its input as it was)."""
    mod = mod.clone() if hasattr(mod, "clone") else mod
    mod["main"] = main
    return mod


def bindings(mod: tvm.IRModule) -> list:
    """The values bound in ``main``, in order."""
    return [b.value for block in mod["main"].body.blocks for b in block.bindings]


def changed_bindings(before: tvm.IRModule, after: tvm.IRModule) -> int:
    """How many of ``main``'s bindings a pass that does not count its own rewrites (TVM's)
    changed: values removed or new, by identity (an untouched binding keeps its object)."""
    old, new = bindings(before), bindings(after)
    return max(len(set(old) - set(new)), len(set(new) - set(old)))


def tvm_pass(name: str, summary: str, make: Callable[[], tvm.transform.Pass]) -> ImportPass:
    """One of TVM's own passes in the pipeline, under its own name."""

    def rewrite(mod: tvm.IRModule) -> tuple[tvm.IRModule, int]:
        out = make()(mod)
        return out, changed_bindings(mod, out)

    return ImportPass(name, summary, rewrite)
