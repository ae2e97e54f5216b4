"""A time budget is spent, not only respected (``partune.search.budget``, ``partune tune
--timeout``)."""

from __future__ import annotations

import time

import pytest

from partune.cli import build_parser
from partune.commands.tune import DEFAULT_REFINE_TRIALS, _prepare
from partune.search.budget import RESERVE_MIN_S, TUNE_FROM_S, TUNE_SHARE, Budget
from tests.conftest import load_model


def test_a_budget_keeps_a_reserve_for_the_verdict_and_tunes_only_when_long():
    short, long = Budget.of(600.0), Budget.of(4 * 3600.0)
    now = time.monotonic()
    assert short.deadline - short.until == pytest.approx(
        RESERVE_MIN_S
    )  # 10% of 10 min is below the floor
    assert long.deadline - long.until == pytest.approx(0.1 * 4 * 3600.0)
    assert not short.tunes and short.tuning_s() == pytest.approx(
        TUNE_SHARE * (short.until - now), abs=1.0
    )
    assert long.tunes and long.tuning_s() == pytest.approx(TUNE_SHARE * (long.until - now), abs=1.0)
    spent = Budget(time.monotonic() - 10.0, TUNE_FROM_S)  # past its deadline: nothing left to share
    assert spent.tuning_s() == 0.0


def _job(monkeypatch, *flags: str):
    monkeypatch.setattr(
        "partune.commands.tune.load_model", lambda args: load_model(args.model)
    )  # the session's
    args = build_parser().parse_args(
        ["tune", "bert-small", "--storage", "memory", "--peers", "none", *flags]
    )
    return args, _prepare(args)


@pytest.mark.parametrize(
    "flags, tuned, trials, tune_budget",
    [
        ((), False, DEFAULT_REFINE_TRIALS, 0.0),  # no budget: a fixed amount of work
        (
            ("--timeout", "10m"),
            False,
            None,
            0.0,
        ),  # refinement until it converges; too short to tune
        (
            ("--timeout", "2h"),
            True,
            None,
            0.0,
        ),  # tvm-tuned joins, its time is the budget's share (0 here)
        (
            ("--timeout", "2h", "--refine-trials", "5", "--tune-budget", "90s"),
            True,
            5,
            90.0,
        ),  # the user's
        (
            ("--timeout", "2h", "--backends", "onnxruntime,openvino"),
            False,
            None,
            0.0,
        ),  # TVM not on offer
        (
            ("--timeout", "10m", "--backends", "tvm,tvm-tuned"),
            True,
            None,
            0.0,
        ),  # named: the budget's share
    ],
)
def test_what_a_budget_decides_and_what_the_user_keeps(
    monkeypatch, backend_settings, flags, tuned, trials, tune_budget
):
    args, job = _job(monkeypatch, *flags)
    assert ("tvm-tuned" in job.backends) == tuned
    # The study is named after what the user offered (and --tune-budget's backend): a budget's
    # tvm-tuned leaves the name alone, so runs with shorter and longer budgets are one job.
    assert job.study.study_name.endswith(
        args.backends + (",tvm-tuned" if "--tune-budget" in flags else "")
    )
    assert args.refine_trials == trials and job.tune_budget == tune_budget
    assert (job.budget is None) == ("--timeout" not in flags)
    if (
        job.budget is not None
    ):  # candidates and refinement stop before the deadline: the verdict's reserve
        assert job.budget.until < job.budget.deadline


def test_a_previous_plan_with_tuned_regions_is_offered_again_without_tuning(
    monkeypatch, tmp_path, backend_settings
):
    """A plain run after a long budget's run: its plan's tuned TVM regions are built from the
    records beside the store, and nothing is tuned (no budget, no --tune-budget)."""
    from partune.core.plan import Plan, Region
    from partune.core.scopes import CompilationConfig

    storage = f"sqlite:///{tmp_path / 'm.db'}"
    args, job = _job(monkeypatch, "--storage", storage, "--timeout", "2h")
    config = CompilationConfig.for_cpu(["tvm", "tvm-tuned"])
    plan = Plan("bert-small", "f", config, (Region((0,), config.scope_for("tvm-tuned")),))
    job.study.set_user_attr("best_plan", plan.to_json())
    args, again = _job(monkeypatch, "--storage", storage)
    assert again.study.study_name == job.study.study_name
    assert again.previous is not None and "tvm-tuned" in again.backends and again.tune_budget == 0.0
    from partune.backends import registry

    assert registry.settings().tuning_database == str(tmp_path / "m.tuning")
