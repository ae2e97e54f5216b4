"""TVM with MetaSchedule-tuned schedules, offered as a backend of its own.

Untuned, TVM loses to every library on matmul and conv (DESIGN.md); tuned, it can win
where its fusion beats the library's. Which regions deserve tuning is for the search to
decide, so tuned TVM is a separate backend: the search tunes a region
(``partune.backends.tvm_tuning.tune_region``) and then measures it here, next to plain TVM.

Its regions are offloaded through BYOC like a graph compiler's: each region is built as
its own module (as ``TvmBackend.build_region`` does) with the tuning database applied.
Tasks without records keep TVM's default schedules, so every region still builds. The
database directory is a setting (``Settings.tuning_database``, beside the store by
default), which every request carries into worker processes and RPC servers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tvm import relax

from partune.backends.base import Backend, BackendError, FusionStyle, Level, RegionKernel
from partune.backends.tvm_backend import build_region_kernel, set_tvm_threads

if TYPE_CHECKING:
    from partune.backends.settings import Settings
    from partune.core import SEScope


class TunedTvmBackend(Backend):
    """TVM's lowering with the schedules of the persistent tuning database applied."""

    name = "tvm-tuned"
    level = Level.NATIVE
    fusion_style = FusionStyle.TVM
    device_types = ("cpu", "cuda")
    offered_by_default = False  # pays off only after tuning: offered when a budget is given
    autotuned = True
    caches_builds = True

    def __init__(self, database_dir: str | None = None) -> None:
        # Not an error yet when unset: listing the backends must not fail.
        self.database_dir = database_dir

    def configure(self, settings: Settings) -> None:
        self.database_dir = settings.tuning_database

    def database(self) -> str:
        """The tuning database directory; a clear error when none was given."""
        if not self.database_dir:
            raise BackendError(
                f"{self.name} needs a tuning database: Settings.tuning_database "
                "(`partune tune` puts it beside the store)"
            )
        return self.database_dir

    @property
    def codegen(self) -> None:
        """None: tuned regions stay inline in ``main``, as native TVM's do. Offloaded as
        modules of their own, each call paid a VM hand-off (+4 us on gpt2-small's glue)
        that ate what tuning won; inline, ``compile`` applies the tuned schedules."""
        return None

    def compile(self, mod, target):
        """Build a whole partitioned module with the tuned schedules applied to its TVM code
        (every inline region: a workload tuned for one region serves all that share it)."""
        from partune.backends.tvm_backend import compile_module
        from partune.backends.tvm_tuning import tuning_target
        from partune.backends.tvm_tuning_database import database_path, open_snapshot

        return compile_module(
            mod, target, open_snapshot(database_path(self.database(), tuning_target(target)))
        )

    def accepts(self, binding: relax.Binding) -> bool:
        return True  # every Relax op has a legalisation

    def set_threads(self, threads: int) -> None:
        set_tvm_threads(threads)

    def tune_region(
        self, func: relax.Function, scope: SEScope, trials: int, timeout_s: float
    ) -> dict:
        """MetaSchedule on the region's tasks, in a child process (a crash costs the region)."""
        from partune.backends.tvm_tuning import tune_region
        from partune.backends.tvm_tuning_database import TuningError

        try:
            report = tune_region(
                func, scope.tvm_target(), self.database(), trials, timeout_s, isolate=True
            )
        except TuningError as e:
            raise BackendError(str(e)) from e
        return report.to_json()

    def build_region(self, func: relax.Function, scope: SEScope, threads: int) -> RegionKernel:
        """Build the region as its own module, applying the tuned schedules for its target."""
        from partune.backends.tvm_tuning import tuning_target
        from partune.backends.tvm_tuning_database import database_path, open_snapshot

        if scope.device_type not in (None, *self.device_types):
            raise BackendError(
                f"{self.name} runs on {'/'.join(self.device_types)}, not {scope.device_type}"
            )
        self.set_threads(threads)
        # The same directory tune_region wrote for this target (num-cores defaulted alike).
        path = database_path(self.database(), tuning_target(scope.tvm_target()))
        try:
            database = open_snapshot(path)
        except Exception as e:  # noqa: BLE001 - a damaged database is this backend's failure
            raise BackendError(f"cannot read tuning database {path}: {e}") from e
        return build_region_kernel(func, scope, database, database_dir=path)
