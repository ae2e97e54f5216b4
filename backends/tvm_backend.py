"""Native TVM: every op TVM can lower, built with TVM's own pipeline.

TVM is the fallback that makes every plan complete: it accepts everything. Untuned, its
CPU kernels are only good at element-wise fusion (DESIGN.md); with a MetaSchedule
database its tuned schedules are applied.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import tvm
from tvm import relax
from tvm.s_tir import meta_schedule as ms

from partune.backends import build_cache
from partune.backends.base import Backend, FusionStyle, Level, RegionKernel
from partune.core import function_in_bf16

if TYPE_CHECKING:
    from partune.backends.settings import Settings
    from partune.core import SEScope


LIBRARY = "region.so"  # a region's compiled library in its build cache entry


def lower_fused(
    mod: tvm.IRModule, target: tvm.target.Target, database: ms.database.Database | None = None
) -> tvm.IRModule:
    """Legalize and fuse ``mod`` (TVM's "zero" pipeline); with ``database``, apply its schedules.

    Tuning (``partune.backends.tvm_tuning``) extracts its tasks from this same output, so the
    workloads it stores are exactly the ones a build looks up.
    """
    with target, tvm.transform.PassContext(opt_level=3):
        if database is None:
            return relax.get_pipeline("zero")(mod)
        with database:
            return relax.get_pipeline("zero")(mod)


def tuned_pipeline(target: tvm.target.Target, database: ms.database.Database) -> tvm.transform.Pass:
    """TVM's default pipeline for ``target``, with ``database``'s schedules applied right after
    fusion (before GPU default schedules, which then leave tuned functions alone)."""
    from tvm.relax import backend

    kind = backend.cuda.pipeline if target.kind.name == "cuda" else backend.cpu_generic.pipeline

    @tvm.transform.module_pass(opt_level=0)
    def pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        with target, database:  # passes read the target when they are made
            legalize = kind.legalize_passes(target)
            at = next(i for i, p in enumerate(legalize) if p.info.name == "FuseTIR") + 1
            passes = (
                kind.library_dispatch_passes(target)
                + legalize[:at]
                + [relax.transform.MetaScheduleApplyDatabase()]
                + legalize[at:]
                + kind.dataflow_lower_passes(target)
                + kind.finalize_passes(target)
            )
            return tvm.transform.Sequential(passes)(mod)

    return pipeline


def compile_module(
    mod: tvm.IRModule, target: tvm.target.Target, database: str | ms.database.Database | None = None
) -> tvm.runtime.Executable:
    """Build ``mod`` for ``target``; with ``database`` (a JSONDatabase directory or an opened
    database), its tuned schedules replace the default ones.

    The database is applied inside the target's own pipeline, so the module is fused once.
    Fusing first (the "zero" pipeline) and then running the default pipeline fused the
    tuned functions again and lost their schedules: gpt2-small's TVM code ran 2x slower.
    """
    if isinstance(database, str):
        database = ms.database.JSONDatabase(work_dir=database) if database else None
    if database is None:  # not truthiness: an empty Database has len 0
        return tvm.compile(mod, target=target)
    return tvm.compile(mod, target=target, relax_pipeline=tuned_pipeline(target, database))


def region_module(func: relax.Function) -> tvm.IRModule:
    """A region as a module of its own, its function public as ``main`` (what gets built and
    tuned)."""
    return tvm.IRModule({"main": _as_main(func)})


def set_tvm_threads(threads: int) -> None:
    """TVM's CPU thread pool size, for this process and the processes it starts."""
    os.environ["TVM_NUM_THREADS"] = str(threads)
    config = tvm.get_global_func("runtime.config_threadpool", allow_missing=True)
    if config is not None:
        config(1, threads)


def database_state(path: str | None) -> list:
    """What a build's result depends on in a MetaSchedule database directory: its files' sizes
    and modification times (tuning only appends), for the build cache's key."""
    if not path:
        return []
    state = []
    for name in ("database_workload.json", "database_tuning_record.json"):
        try:
            st = os.stat(os.path.join(path, name))
            state.append([name, st.st_size, st.st_mtime_ns])
        except OSError:
            state.append([name, None])
    return state


def build_region_kernel(
    func: relax.Function,
    scope: SEScope,
    database: str | ms.database.Database | None = None,
    database_dir: str | None = None,
) -> RegionKernel:
    """Build a region as its own module and VM; the kernel copies results into the destinations.

    With a build cache active (``partune.backends.build_cache``) the compiled library is loaded
    from it when there, else compiled and, in a build worker, exported into it.
    ``database_dir`` is where ``database`` was read from (it enters the cache key).
    """
    device = tvm.device(scope.device_type or "cpu", scope.virtual_device_id or 0)
    if scope.compute_precision == "bf16":
        func = function_in_bf16(func)
    entry = build_cache.current()
    vm = None
    if entry is not None:
        where = database_dir or (database if isinstance(database, str) else None)
        entry.refine("tvm", database is not None, database_state(where))
        vm = entry.load(
            lambda d: relax.VirtualMachine(
                tvm.runtime.load_module(os.path.join(d, LIBRARY)), device
            )
        )
    n_in = len(func.params)
    if vm is None:
        ex = compile_module(region_module(func), scope.tvm_target(), database)
        if (
            entry is not None
            and entry.write
            and entry.store(lambda d: ex.export_library(os.path.join(d, LIBRARY)))
        ):
            # A build worker does not run what it builds: the VM (whose set-up JIT-compiles
            # the code, as long as the compile itself) is made only if the kernel is called.
            made: list[RegionKernel] = []

            def lazy(*args) -> None:
                if not made:
                    made.append(_vm_kernel(relax.VirtualMachine(ex, device)["main"], n_in))
                made[0](*args)

            return lazy
        vm = relax.VirtualMachine(ex, device)
    return _vm_kernel(vm["main"], n_in)


def _vm_kernel(main, n_in: int) -> RegionKernel:
    """Destination-passing over a VM function: run it, copy its results into the outputs."""

    def kernel(*args) -> None:
        result = main(*args[:n_in])
        outs = [result] if hasattr(result, "copyto") else list(result)
        for src, dst in zip(outs, args[n_in:], strict=True):
            src.copyto(dst)

    return kernel


def _as_main(func: relax.Function) -> relax.Function:
    """The region as a public ``main``: without a global symbol, passes may drop it as dead."""
    attrs = {
        k: v
        for k, v in (func.attrs or {}).items()
        if k != "Codegen" and not k.startswith("partune.")
    }
    attrs["global_symbol"] = "main"
    return relax.Function(
        func.params, func.body, func.ret_ty, func.is_pure, tvm.ir.make_node("ir.DictAttrs", **attrs)
    )


class TvmBackend(Backend):
    """TVM's native lowering (default schedules, or tuned ones from a database)."""

    name = "tvm"
    level = Level.NATIVE
    fusion_style = FusionStyle.TVM
    device_types = ("cpu", "cuda")
    caches_builds = True
    # matmuls and convolutions on bf16 operands (``partune.core.bf16``), TIR's bf16 lowering
    bf16 = True

    def __init__(self, database_dir: str | None = None) -> None:
        self.database_dir = database_dir

    def configure(self, settings: Settings) -> None:
        """``--tvm-database``: the MetaSchedule records every build applies."""
        self.database_dir = settings.tvm_database

    def accepts(self, binding: relax.Binding) -> bool:
        return True  # every Relax op has a legalisation

    def set_threads(self, threads: int) -> None:
        set_tvm_threads(threads)

    def build_region(self, func: relax.Function, scope: SEScope, threads: int) -> RegionKernel:
        """Build the region as its own module and VM; copy results into the destinations."""
        self.set_threads(threads)
        return build_region_kernel(func, scope, self.database_dir)

    def compile(self, mod: tvm.IRModule, target: tvm.target.Target) -> tvm.runtime.Executable:
        """Build a whole (partitioned) module: TVM lowers whatever was not offloaded."""
        return compile_module(mod, target, self.database_dir)
