"""The verdict: the finalist plans meet the peers, and the plan to emit is chosen.

Finalists and peers (the tools a user would pick instead, ``partune.runners.peers``)
are timed in interleaved rounds (one process at one thread; a process each, one at a
time, at more: ``partune.runners.isolated``) and stored like every other measurement. The
emitted plan is the fastest of them by interleaved median; when a library on the
model's own file beats every partitioned plan, that file under that library is the
plan, so Partune never emits something slower than what the user already has.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from partune.core import (
    DataflowGraph,
    ModelFile,
    Plan,
    Region,
    clean_error,
    digest,
    model_file_plan,
    plan_key,
    verdict_key,
)
from partune.runners import (
    ACCURACY_CONTROL,
    BF16_PEERS,
    INT8_PEERS,
    LIBRARY_PEERS,
    Measurement,
    available_peers,
    compare_request,
    model_origin,
    peer_kind,
    peer_label,
    peer_specs,
    peers_at,
)
from partune.search.int8_calibration import quantization_data
from partune.search.model_file_recipe import quantized_model_file
from partune.search.result import Verdict
from partune.store import FIRST_POLL_S, POLL_S

if TYPE_CHECKING:
    from partune.search.session_view import SessionView
    from partune.store import MeasurementStore

FINALISTS = 3
VERDICT_ROUNDS = 7
VERDICT_TIMEOUT_S = 900.0  # torch.compile of a whole model inside the measuring process


# The verdict builds every contender in one process (interleaved timing needs them all at once):
# at 24 BERT-768 layers six of them took 13 GB and the out-of-memory killer ended it. Sizes as
# measured at 12 layers, per byte of the model's weights: a peer holds up to 3.4x (onnxruntime
# keeps the file and its session's copy), the worker's parse of the model 3x; a plan's own
# footprint is measured with it (``Measurement.peak_bytes``), else taken as 2.5x.
PEER_PER_WEIGHT, MODEL_PER_WEIGHT, PLAN_PER_WEIGHT = 3.5, 3.0, 2.5
MEMORY_SHARE = 0.7  # of the memory free when the verdict starts, what its contenders may take


def fit_in_memory(s: SessionView, finalists: dict[str, Plan]) -> dict[str, Plan]:
    """The finalists that fit beside the peers in the memory the device has free: the slowest
    go first, the fastest always stays. A device that does not say (RPC) gets them all."""
    free = s.runner.available_bytes()
    if free is None or len(finalists) < 2:
        return finalists
    weights = sum(node.const_bytes for node in s.graph.nodes)
    e2e = s.result.end_to_end
    size = {
        label: (
            e2e[label].peak_bytes
            if label in e2e and e2e[label].peak_bytes
            else PLAN_PER_WEIGHT * weights
        )
        for label in finalists
    }
    fixed = (
        MODEL_PER_WEIGHT + PEER_PER_WEIGHT * len(_wanted(s))
    ) * weights  # the peers judge will build
    kept = sorted(finalists, key=lambda label: e2e[label].cost_s if label in e2e else float("inf"))
    while len(kept) > 1 and fixed + sum(size[label] for label in kept) > MEMORY_SHARE * free:
        kept.pop()
    if len(kept) < len(finalists):
        gone = [label for label in finalists if label not in kept]
        s.result.verdict.left_out = (
            f"{', '.join(gone)} left out: the contenders would need about "
            f"{(fixed + sum(size.values())) / 2**30:.1f} GB, "
            f"{free / 2**30:.1f} GB was free"
        )
    return {label: finalists[label] for label in finalists if label in kept}


def refine_study_name(
    graph: DataflowGraph, dp_plan: Plan, memory: bool, space: list[list[str]]
) -> str:
    """The refinement study of a model's DP plan over ``space``
    (``partune.search.refine.search_space``): the same for every worker and every rerun. A rerun
    whose choices changed (a backend now offers more) starts a study of its own; variants timed
    before are read from the store."""
    return f"refine:{graph.fingerprint}:{plan_key(dp_plan)}:{digest(space, 8)}" + (
        ":latency+memory" if memory else ""
    )


def _wanted(s: SessionView) -> tuple[str, ...]:
    """The peers of the verdict: those asked for that the model can have (with bf16 or int8 on
    offer, the bf16 and int8 peers of the libraries asked for too, ``peers_at``)."""
    return available_peers(s.model, peers_at(s.options.peers, s.config.precisions))


def _verdict_key(s: SessionView, finalists: dict[str, Plan], wanted: tuple[str, ...]) -> str:
    """The verdict's key: its plans and peers, and what the reduced-precision ones' numbers
    depend on (the int8 calibration the peers are quantized on, the user's validation set);
    an f32 verdict's key as it always was."""
    depends = (f"int8-calibration:{s.calibration.digest}",) if s.calibration else ()
    if s.validation is not None:
        depends += (f"judged:{s.validation.digest}",)
    if ACCURACY_CONTROL in wanted:  # quantized to the budget
        depends += (f"budget:{s.options.accuracy_budget:g}",)
    return verdict_key(
        s.graph.fingerprint,
        {label: plan_key(p) for label, p in finalists.items()},
        wanted + depends,
    )


def await_verdict(s: SessionView, finalists: dict[str, Plan]) -> None:
    """While another worker of this search times the verdict, wait for it with short polls
    (``judge`` looks every ``POLL_S``), so a worker that follows ends when the verdict lands.

    The key is the one ``judge`` claims; were the two to differ, nothing would be held
    under this one and ``judge`` would simply wait on its own."""
    from partune.store import alive

    key = _verdict_key(s, finalists, _wanted(s))
    claims, pause, waited = s.store.claims, FIRST_POLL_S, False
    # Not past the claim's time to live: a dead worker's claim is then judge's to take over.
    until = time.monotonic() + getattr(claims, "ttl_s", 0.0)
    while (
        time.monotonic() < until
        and (holder := claims.holder(key)) not in (None, claims.owner)
        and alive(holder)
        and not claims.is_done(key)
    ):
        if not waited:
            s.progress.start_phase("plans vs peers, interleaved by another worker: waiting", 1)
        time.sleep(pause)
        pause, waited = min(2 * pause, POLL_S), True
    if waited:
        s.store.refresh()


def judge(s: SessionView, finalists: dict[str, Plan]) -> None:
    """Finalist plans against the peers, in one process, interleaved; stored like the rest.

    One worker times the verdict (it claims the key); the others wait and read it.
    """
    model, store, counts = s.model, s.store, s.counts
    wanted = _wanted(s)
    key = _verdict_key(s, finalists, wanted)
    labels = list(finalists) + [peer_label(p, model) for p in wanted]
    s.progress.start_phase("plans vs peers, interleaved", 1)
    while not all(key + label in store for label in labels):
        if store.claims.claim(key) or _never_stored(store, key, labels):
            specs = peer_specs(
                model,
                wanted,
                s.module_file.parent,
                quantization_data(model, s.options),
            )
            request = compare_request(
                s.module_file, finalists, specs, model.inputs, VERDICT_ROUNDS, s.validation
            )
            measured = s.runner.compare(
                request, timeout_s=max(VERDICT_TIMEOUT_S, s.runner.timeout_s)
            )
            for label, m in measured.items():
                store.put(key + label, m, f"{model.name} verdict {label}")
            store.claims.done(key)
            counts.measured += len(measured)
            break
        time.sleep(POLL_S)
        store.refresh()
    else:
        measured = {label: store.get(key + label) for label in labels}
        counts.reused += len(labels)
    s.result.verdict = Verdict(
        measured,
        tuple(peer_label(p, model) for p in wanted),
        s.options.threads,
        s.options.tolerance,
        s.result.verdict.left_out,
    )
    best = min((m.median_s for m in measured.values() if m.ok), default=float("nan"))
    s.progress.advance(f"fastest median {best * 1e3:.3f} ms")


def _never_stored(store: MeasurementStore, key: str, labels: list[str]) -> bool:
    """Whether the verdict under ``key`` is done without some of ``labels``: waiting for them
    would never end (``judge`` then times it itself)."""
    if not store.claims.is_done(key):
        return False
    store.refresh()  # done was seen first, so what its worker stored is read now
    return not all(key + label in store for label in labels)


def fastest_library_peer(verdict: Verdict) -> str | None:
    """The verdict's fastest library peer on the model's own graph (onnxruntime, OpenVINO; in
    f32, or in bf16 or int8 within the accuracy budget): the one a model-file plan can be made
    of. None when no such peer ran."""
    ms = verdict.measurements
    ok = [
        p
        for p in verdict.peers
        if (kind := peer_kind(p)) is not None
        and kind.split()[0] in LIBRARY_PEERS
        and ms.get(p) is not None
        and ms[p].ok
        and not verdict.over_budget(p)
    ]
    return min(ok, key=lambda p: ms[p].median_s) if ok else None


def peer_model_file(s: SessionView, label: str) -> ModelFile:
    """The model-file plan that runs what the library peer ``label`` ran: the model's own file,
    under OpenVINO's bf16 hint for its bf16 peer, quantized for an int8 one."""
    kind = peer_kind(label)
    assert kind is not None
    library = kind.split()[0]
    origin, sha = model_origin(s.model), getattr(s.model, "onnx_sha256", None)
    if kind in INT8_PEERS:
        return quantized_model_file(library, origin, sha, kind, s.model, s.options)
    return ModelFile(library, origin, sha, precision="bf16" if kind in BF16_PEERS else "f32")


def emit(s: SessionView, finalists: dict[str, Plan]) -> None:
    """The plan to emit: the fastest finalist by interleaved median, or the model's file under
    the fastest library peer within budget when no finalist beat it; its notes say how it
    stands."""
    result = s.result
    verdict = result.verdict.measurements
    ok = {label: m for label, m in result.end_to_end.items() if m.ok}
    judged = {label: m for label, m in verdict.items() if label in finalists and m.ok}
    if judged:  # the interleaved medians decide; the search's best samples break no ties here
        best = min(judged, key=lambda label: judged[label].median_s)
    else:
        best = min(ok, key=lambda label: ok[label].cost_s)
    chosen = result.plans[best]
    notes = {**chosen.notes, **_search_notes(s, best, ok)}
    file_peer = fastest_library_peer(result.verdict)
    file = None
    if file_peer is not None and (
        not judged or verdict[file_peer].median_s < judged[best].median_s
    ):
        # No plan beat a library on the model's own file: that is the plan (never slower than it).
        file = peer_model_file(s, file_peer)
        notes = {k: v for k, v in notes.items() if k not in ("rel_error", "tolerance")}
        if (error := verdict[file_peer].rel_error) is not None:
            notes |= {"rel_error": error, "tolerance": s.options.tolerance}
        notes |= {
            "kind": "model file",
            "chosen_as": file_peer,
            "measured_s": verdict[file_peer].cost_s,
            "best_partitioned": best,
            "best_partitioned_median_s": judged[best].median_s if judged else None,
        }
        best, judged = file_peer, {file_peer: verdict[file_peer]}
    if (peer := result.verdict.best_peer) is not None and best in judged:
        ratio = verdict[peer].median_s / judged[best].median_s
        notes |= {"best_peer": peer, "speedup_vs_best_peer": ratio, "beats_best_peer": ratio >= 1.0}
    if file is not None:
        result.plan = model_file_plan(s.model.name, s.graph, s.config, file, notes)
    else:
        regions = tuple(
            r if r.cost_s is not None else Region(r.nodes, r.scope, s.stored_cost(r))
            for r in chosen.regions
        )
        result.plan = Plan(chosen.model, chosen.fingerprint, chosen.config, regions, notes=notes)


def _search_notes(s: SessionView, best: str, ok: dict[str, Measurement]) -> dict:
    """What the plan's notes record of the search behind it."""
    result = s.result
    verdict = result.verdict.measurements
    notes = {
        "chosen_as": best,
        "measured_s": ok[best].cost_s,
        **(
            {"rel_error": ok[best].rel_error, "tolerance": s.options.tolerance}
            if ok[best].rel_error is not None
            else {}
        ),
        "end_to_end_s": {k: v.cost_s for k, v in ok.items()},
        "verdict_median_s": {k: v.median_s for k, v in verdict.items() if v.ok},
        "peers": list(result.verdict.peers),
        # (a plan's error is in its end-to-end measurement, a peer's in the verdict's)
        **(
            {"rel_errors": errors}
            if (
                errors := {
                    k: m.rel_error
                    for k, m in [*verdict.items(), *ok.items()]
                    if m.rel_error is not None
                }
            )
            else {}
        ),
        "peers_unavailable": {
            k: clean_error(v.error or "")
            for k, v in verdict.items()
            if k in result.verdict.peers and not v.ok
        },
    }
    if result.dp_label is not None:
        notes |= {
            "dp_label": result.dp_label,
            "dp_estimate_s": result.dp_estimate_s,
            "border_model": result.border.describe(),
        }
    if result.front:
        notes["pareto_front"] = [
            {
                "latency_s": m.cost_s,
                "peak_bytes": m.peak_bytes,
                "backends": list(p.backends),
                "regions": len(p.regions),
            }
            for p, m in result.front
        ]
    return notes
