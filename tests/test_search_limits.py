"""Bounded search inputs (issue 37): the runs formulation of the stage partition against brute
force, the byte scale of models with thousands of units, the schedule tables' limits (closed
forms, bit-set dominance, the action cap, the bounded memo), the search's progress reports,
the what-if's total budget and the CLI's status lines when piped. Time and memory targets are
in bench/limits.py, not here."""

from __future__ import annotations

import itertools
import json
import random
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import autoplan.analysis.whatif as whatif_module
import autoplan.cli.progress as progress_module
import cost_model.schedule_memory as schedule_memory
import cost_model.schedules as schedules
from autoplan._format import WIDTH
from autoplan.analysis.whatif import MAX_SEARCHES, WhatIfInputError, whatif
from autoplan.cli import cli
from autoplan.planner import partition
from autoplan.planner import search as search_module
from autoplan.planner.partition import (
    ModeCosts,
    PartitionProblem,
    brute_force,
    min_peak_memory,
    solve,
    unit_runs,
)
from autoplan.planner.search import SearchProgress, search_plans
from autoplan.planner.space import SearchSpace, recompute_modes, strategies
from cost_model.estimate import CostModel
from cost_model.schedule_memory import held_microbatches
from cost_model.schedules import (
    MAX_SCHEDULE_ACTIONS,
    SCHEDULES,
    ScheduleError,
    ScheduleSpec,
    pipeline_order,
)
from tests.conftest import run_cli
from tests.cost_profiles import gpt_profile, round_cluster
from tests.test_partition import random_spec

MODEL = "gpt:num_layers=4,hidden_size=256,num_heads=8,seq_len=128,vocab_size=1024"


# ------------------------------------------------------------------------------ partition


def runs_problem(seed: int) -> PartitionProblem:
    """Units in four runs, as a mixture of experts with a dense first layer traces: an
    embedding, a few dense blocks, more expert blocks, a head; a tight memory cap."""
    rng = random.Random(seed)
    dense, experts = rng.randint(1, 3), rng.randint(2, 5)
    n = 2 + dense + experts
    spec = random_spec(rng, max_stages=min(n, 6))
    kinds = [0] + [1] * dense + [2] * experts + [3]

    def per_kind(low: float, high: float) -> tuple[float, ...]:
        values = [rng.uniform(low, high) for _ in range(4)]
        return tuple(values[k] for k in kinds)

    forward, act, static = per_kind(0.1, 1.0), per_kind(1.0, 4.0), per_kind(0.5, 3.0)
    tails = (per_kind(0.0, 0.2), per_kind(-0.3, 0.4))
    modes = {}
    for name in rng.sample(["none", "selective", "full"], rng.randint(1, 3)):
        extra, keep = {"none": (0.0, 1.0), "selective": (0.1, 0.6), "full": (0.35, 0.1)}[name]
        modes[name] = ModeCosts(
            forward_s=forward,
            backward_s=tuple((2.0 + extra) * f for f in forward),
            weight_s=tuple(0.8 * f for f in forward),
            activation_bytes=tuple(a * keep for a in act),
            retained_bytes=act,
            tail_s=tails,
        )
    link = per_kind(0.0, 0.1)
    crossing = [
        link if spec.stage_rank(s) != spec.stage_rank(s + 1) else (0.0,) * n
        for s in range(spec.num_stages - 1)
    ]
    problem = PartitionProblem(
        spec=spec,
        modes=modes,  # type: ignore[arg-type]
        static_bytes=static,
        transfer_s=(*crossing, (0.0,) * n),
        message_s=tuple(
            0.01
            if s < spec.num_stages - 1 and spec.stage_rank(s) != spec.stage_rank(s + 1)
            else 0.0
            for s in range(spec.num_stages)
        ),
        memory_capacity_bytes=1e18,
        tail_constants_s=(0.05, rng.uniform(-0.2, 0.2)),
    )
    least = min_peak_memory(problem, model="cut").least_bytes
    assert least is not None
    return replace(problem, memory_capacity_bytes=least * rng.uniform(1.0, 1.5) + 1e-9)


@pytest.mark.parametrize("seed", range(30))
def test_runs_formulation_matches_brute_force(seed: int) -> None:
    problem = runs_problem(seed)
    runs = unit_runs(problem)
    # every run is a stretch of equal units, and the runs cover the units in order
    assert [first for first, _ in runs] == list(
        itertools.accumulate((length for _, length in runs[:-1]), initial=0)
    )
    assert sum(length for _, length in runs) == problem.num_units
    assert len(runs) <= 4
    expected = brute_force(problem)
    assert expected is not None
    found, stats = solve(problem, model="runs")
    assert found is not None and stats.status == "OPTIMAL", stats
    assert found.peak_memory_bytes <= problem.memory_capacity_bytes
    assert found.step_time_s == pytest.approx(expected.step_time_s, rel=1e-3)
    assert found.step_time_s >= expected.step_time_s * (1 - 1e-12)
    peak = min_peak_memory(problem, model="runs")
    assert peak.least_bytes == pytest.approx(
        min_peak_memory(problem, model="cut").least_bytes, rel=1e-5
    )


def test_the_runs_formulation_takes_over_from_large_cut_models(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    problem = next(p for p in map(runs_problem, range(30)) if p.num_stages > 1)
    assert not partition._uniform_middle(problem)
    assert isinstance(partition._step_model(problem, None), partition._CutModel)
    # past the cut formulation's size the default is the runs one, with the same optimum
    monkeypatch.setattr(partition.formulations, "_CUT_MODEL_ENTRIES", 0)  # (read there)
    assert isinstance(partition._step_model(problem, None), partition._RunsModel)
    found, stats = solve(problem)
    expected = brute_force(problem)
    assert found is not None and expected is not None and stats.status == "OPTIMAL"
    assert found.step_time_s == pytest.approx(expected.step_time_s, rel=1e-3)


def _scaled_rank_memory(
    scaled: Any, problem: PartitionProblem, starts: tuple[int, ...], modes: tuple[str, ...]
) -> list[float]:
    """`partition.rank_memory` computed from the model's rounded integers, in bytes."""
    ends = (*starts[1:], problem.num_units)
    static, act, kept = [], [], []
    for s, (a, b) in enumerate(zip(starts, ends, strict=True)):
        static.append(sum(scaled.static[a:b]))
        act.append(sum(scaled.act[modes[s]][a:b]))
        kept.append(act[-1] if s == 0 else sum(scaled.kept[modes[s]][a:b]))
    out = []
    for held in held_microbatches(problem.spec):
        peak = max(
            sends * scaled.send
            + sum(h * act[s] + k * kept[s] for (h, k), s in zip(point, held.stages, strict=True))
            for point, sends in zip(held.points, held.sends, strict=True)
        )
        out.append((sum(static[s] for s in held.stages) + peak) * scaled.byte_unit)
    return out


def test_thousands_of_units_round_within_the_memory_margin() -> None:
    # 2,050 units on 16 pipeline ranks: the former byte scale (the worst total over all units
    # in 10^6 units) rounded a block's recomputed activations to a fraction of themselves, and
    # the solver's cuts overflowed the device (llama3-8b:num_layers=4096 on 1024 A100s crashed
    # with 117 GiB of 80); the finer scale keeps every partition within its margin
    profile = gpt_profile(num_layers=2048, h=256, s=1024, a=8, vocab=4096)
    cluster = round_cluster(num_nodes=2, memory_bytes=3 * 2**30)
    space = SearchSpace.from_constraints(
        pp=(16,), tp=(1,), micro_batch=(1,), schedules=("1f1b",), zero=(0,)
    ).for_cluster(cluster)
    strategy = next(iter(strategies(space, profile, cluster, 64)))
    model = CostModel(profile, cluster, "autoplan")
    candidate = search_module._candidate(
        strategy, recompute_modes(space, strategy.schedule), search_module._BoundTables(model)
    )
    problem = search_module._problem(candidate, model)
    coarse = partition._worst_bytes(problem) / partition._RESOLUTION
    fine, margin = partition._fine_byte_unit(problem, coarse)
    assert fine < coarse and margin == partition._FINE_MEMORY * problem.memory_capacity_bytes
    scaled = partition._scale(problem)
    assert scaled.byte_unit == fine
    assert scaled.memory_capacity * fine <= problem.memory_capacity_bytes - margin
    rng = random.Random(3)
    worst_coarse = 0.0
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, problem.num_units), problem.num_stages - 1))
        starts = (0, *cuts)
        modes = tuple(rng.choice(list(problem.modes)) for _ in starts)
        true = partition.rank_memory(problem, starts, modes)
        rounded = _scaled_rank_memory(scaled, problem, starts, modes)
        # the model's bytes are within the margin it keeps free: what it allows fits
        assert all(abs(r - t) <= margin for r, t in zip(rounded, true, strict=True))
        coarse_scaled = replace(
            scaled,
            byte_unit=coarse,
            static=partition._ints(problem.static_bytes, coarse),
            act={k: partition._ints(c.activation_bytes, coarse) for k, c in problem.modes.items()},
            kept={k: partition._ints(c.retained_bytes, coarse) for k, c in problem.modes.items()},
            send=round(problem.send_bytes / coarse),
        )
        rounded = _scaled_rank_memory(coarse_scaled, problem, starts, modes)
        worst_coarse = max(worst_coarse, *(abs(r - t) for r, t in zip(rounded, true, strict=True)))
    # the former scale was off by far more than the margin
    assert worst_coarse > 10 * margin


# ------------------------------------------------------------------------------ schedules


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_rank_stages_inverts_stage_rank(schedule: str) -> None:
    for p, v in itertools.product((1, 2, 3, 8), (1, 2, 4)):
        try:
            spec = ScheduleSpec(
                schedule=schedule,  # type: ignore[arg-type]
                pp_degree=p,
                virtual_stages=v,
                num_micro_batches=2 * p,
            )
        except ScheduleError:
            continue
        for rank in range(p):
            assert spec.rank_stages(rank) == tuple(
                s for s in range(spec.num_stages) if spec.stage_rank(s) == rank
            )


def test_maximal_points_by_bit_sets_match_pairwise_comparison() -> None:
    rng = random.Random(7)
    for _ in range(200):
        width, count = rng.randint(1, 3), rng.randint(1, 40)
        points = {
            (tuple((rng.randint(0, 3), rng.randint(0, 2)) for _ in range(width)), rng.randint(0, 3))
            for _ in range(count)
        }

        def flat(point: Any) -> tuple[int, ...]:
            return (*(c for pair in point[0] for c in pair), point[1])

        expected = sorted(
            a
            for a in points
            if not any(
                b != a and all(x >= y for x, y in zip(flat(b), flat(a), strict=True))
                for b in points
            )
        )
        assert list(schedule_memory._maximal(points)) == expected


def test_a_schedule_past_the_action_cap_is_one_line() -> None:
    # 1,024 stages x 1,032 micro-batches x 2 actions: just past the cap (and a valid count
    # for torch's interleaved rounds)
    stages, micro_batches = 1024, 1032
    assert stages * micro_batches * 2 > MAX_SCHEDULE_ACTIONS
    with pytest.raises(ScheduleError) as info:
        ScheduleSpec(
            schedule="interleaved-1f1b",
            pp_degree=128,
            virtual_stages=8,
            num_micro_batches=micro_batches,
        )
    message = str(info.value)
    assert "\n" not in message and f"at most {MAX_SCHEDULE_ACTIONS:,}" in message, message
    assert f"{stages:,} stages" in message and "fewer pipeline stages" in message
    # one below the cap is a schedule
    ok = ScheduleSpec(schedule="1f1b", pp_degree=16, num_micro_batches=MAX_SCHEDULE_ACTIONS // 32)
    assert ok.num_actions == MAX_SCHEDULE_ACTIONS


def test_schedule_tables_are_memoised_within_an_action_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    small = ScheduleSpec(schedule="1f1b", pp_degree=2, num_micro_batches=3)
    large = ScheduleSpec(schedule="1f1b", pp_degree=4, num_micro_batches=100)
    first = pipeline_order(small)
    assert pipeline_order(small) is first  # memoised
    # a budget the large schedule fills alone: the small one goes first (the latest stays)
    monkeypatch.setattr(schedules, "_CACHED_ACTIONS", large.num_actions)
    held = held_microbatches(large)
    pipeline_order(large)
    assert pipeline_order(large) is pipeline_order(large)
    again = pipeline_order(small)
    assert again is not first and again == first
    assert held_microbatches(large) == held


# ------------------------------------------------------------------------------ progress


def test_the_search_reports_every_phase() -> None:
    seen: list[SearchProgress] = []
    search_plans(
        gpt_profile(num_layers=8),
        round_cluster(num_nodes=2),
        global_batch=32,
        budget_s=None,
        progress=seen.append,
    )
    phases = [step.phase for step in seen]
    assert {"enumerate", "seed", "visit"} <= set(phases)
    # in order: enumeration, first guesses, the visit
    assert phases == sorted(phases, key=["enumerate", "seed", "visit"].index)
    enumerated = [s.visited for s in seen if s.phase == "enumerate"]
    assert enumerated == sorted(enumerated) and all(s.total == 0 for s in seen[: len(enumerated)])
    visits = [s for s in seen if s.phase == "visit"]
    assert visits[-1].best_step_time_s is not None and visits[-1].visited <= visits[-1].total


def test_plan_and_explain_print_a_line_a_phase_when_piped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # (no delay before the first line: this small search takes well under its 2 CPU seconds)
    monkeypatch.setattr(progress_module, "FIRST_LINE_S", 0.0)
    args = ["plan", "--model", MODEL, "--cluster", "dgx-a100-80g:nodes=2", "--global-batch", "64"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    status = result.stderr.splitlines()
    assert all(re.fullmatch(r"plan: .+ \(\d+ s\)", line) for line in status), status
    assert all(len(line) <= WIDTH for line in status), status
    # one line a phase, in the search's order: tracing, enumerating, first guesses, the visit
    phases = ["tracing", "candidates enumerated", "first guesses", "candidates visited"]
    firsts = [next(i for i, line in enumerate(status) if p in line) for p in phases]
    assert firsts == sorted(firsts), status
    assert "plan: " not in result.stdout  # the result alone on stdout
    # --json: stdout is the JSON alone and stderr stays quiet, unless --progress
    quiet = CliRunner().invoke(cli, [*args, "--top", "1", "--json"])
    assert quiet.exit_code == 0 and quiet.stderr == "", quiet.stderr
    assert json.loads(quiet.stdout)["plans"]
    shown = CliRunner().invoke(cli, [*args, "--top", "1", "--json", "--progress"])
    assert shown.exit_code == 0 and "plan: tracing" in shown.stderr, shown.stderr
    assert json.loads(shown.stdout)["plans"] == json.loads(quiet.stdout)["plans"]
    # --no-progress: quiet without --json too
    path = tmp_path / "plan.yaml"
    off = CliRunner().invoke(cli, [*args, "--top", "1", "--no-progress", "-o", str(path)])
    assert off.exit_code == 0 and off.stderr == "" and "best plans" in off.stdout, off.stderr
    # explain: its phases, its comparison search's among them
    explained = CliRunner().invoke(cli, ["explain", str(path), "--budget", "1"])
    assert explained.exit_code == 0, explained.output
    status = explained.stderr.splitlines()
    assert all(re.fullmatch(r"explain: .+ \(\d+ s\)", line) for line in status), status
    phases = ["tracing", "pricing the plan", "comparison: enumerating", "pure data parallelism"]
    firsts = [next(i for i, line in enumerate(status) if p in line) for p in phases]
    assert firsts == sorted(firsts), status


def test_piped_progress_waits_for_work_then_reports_phases_and_percentages(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Piped: nothing before the delay's CPU seconds of work, then the phase in hand, each new
    phase and each further `PERCENT_STEP` percent, cut to `WIDTH` columns (``COLUMNS`` when
    set); nothing on stdout."""
    monkeypatch.delenv("COLUMNS", raising=False)
    progress_module.Status(prefix="idle", piped=True, delay_s=0.0).tick()  # nothing to say yet
    status = progress_module.Status(prefix="demo", piped=True, delay_s=float("inf"))
    status.update("tracing")
    status.update("pricing")
    assert capsys.readouterr().err == ""  # a quick command says nothing
    status.delay_s = 0.0  # (as if the work had taken its CPU seconds)
    status.update("counting", 0, 8, phase="count")
    for done in range(1, 9):
        status.update(f"counting {done}", done, 8, phase="count")
    status.update("x" * 200)
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert [line.rsplit(" (", 1)[0] for line in lines[:5]] == [
        "demo: counting",
        "demo: counting 2",  # 25%
        "demo: counting 4",  # 50%
        "demo: counting 6",  # 75%
        "demo: counting 8",  # 100%
    ], lines
    assert len(lines) == 6 and len(lines[5]) == WIDTH, lines
    assert re.fullmatch(r"demo: x+\.\.\. \(\d+ s\)", lines[5]), lines
    monkeypatch.setenv("COLUMNS", "80")
    status.update("y" * 200)
    assert len(capsys.readouterr().err.rstrip("\n")) == 80


# ------------------------------------------------------------------------------ what-if


def _slow_first_search(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """The what-if's first search takes at least ``seconds`` (the rest as they are)."""
    original = whatif_module._best_plan
    calls = [0]

    def slow(*args: Any, **kwargs: Any) -> Any:
        found = original(*args, **kwargs)
        calls[0] += 1
        if calls[0] == 1:
            time.sleep(seconds)
        return found

    monkeypatch.setattr(whatif_module, "_best_plan", slow)


def test_whatif_total_budget_reports_unrun_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    profile = gpt_profile(num_layers=4)
    # the first search outlasts the total budget: the other three do not start
    _slow_first_search(monkeypatch, 1.05)
    result = whatif(
        profile,
        ["dgx-a100-80g", "dgx-h100-80g"],
        num_devices=[8, 16],
        global_batch=64,
        total_budget_s=1.0,
        workers=1,
    )
    assert len(result.rows) == 4  # every size is a row, run or not
    assert [row.searched for row in result.rows] == [True, False, False, False]
    assert result.not_run == 3 and result.rows[0].plan is not None
    unrun = result.rows[1:]
    assert all(
        row.plan is None and "total budget (1 s) ran out" in (row.reason or "") for row in unrun
    )
    data = result.to_data()
    assert data["not_run"] == 3 and data["total_budget_s"] == 1.0
    assert [row["searched"] for row in data["rows"]] == [True, False, False, False]
    with pytest.raises(WhatIfInputError, match="total_budget_s = -1 must be"):
        whatif(profile, "dgx-a100-80g", num_devices=[8], global_batch=64, total_budget_s=-1)


def test_whatif_cli_says_how_many_did_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    _slow_first_search(monkeypatch, 1.05)
    args = ["whatif", "--model", MODEL, "--cluster", "dgx-a100-80g,dgx-h100-80g"]
    args += ["--num-devices", "8,16", "--global-batch", "64", "--total-budget", "1"]
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if "searches not run" in line]
    assert len(lines) == 1, result.stdout
    assert lines[0].startswith("3 of 4 searches not run: the --total-budget of 1 s ran out")
    assert "raise it (e.g. --total-budget 60" in lines[0]
    assert result.stdout.count("not run (the total budget ran out)") == 3
    # nothing run at all: one line that says so, exit 2
    nothing = run_cli(*args[:-1], "0.000001")
    assert nothing.returncode == 2
    assert nothing.stderr.strip().splitlines()[-1].startswith("autoplan: error: no plan for ")
    assert "4 of 4 searches not run" in nothing.stderr


def test_whatif_refuses_too_many_searches_in_one_line() -> None:
    sizes = ",".join(str(8 * k) for k in range(1, MAX_SEARCHES // 2 + 2))
    result = run_cli(
        "whatif",
        "--model",
        MODEL,
        "--cluster",
        "dgx-a100-80g,dgx-h100-80g",
        "--num-devices",
        sizes,
        "--global-batch",
        "64",
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "searches: a what-if runs at most 1,024" in lines[0], lines
    with pytest.raises(WhatIfInputError, match="a what-if runs at most 1,024"):
        whatif(
            gpt_profile(num_layers=4),
            ["dgx-a100-80g", "dgx-h100-80g"],
            num_devices=[8 * k for k in range(1, 514)],
            global_batch=64,
        )


def test_search_problem_rows_are_shared() -> None:
    # 512 stages of 514 units: the boundary rows are priced per stage and distinct output
    # size, and equal rows are one object (not stages x units floats), equal to pricing
    # every unit
    profile = gpt_profile(num_layers=512, h=512, s=256, a=8)
    cluster = round_cluster(num_nodes=16)
    space = SearchSpace.from_constraints(
        pp=(64,), tp=(1,), micro_batch=(1,), schedules=("interleaved-1f1b",), virtual_stages=(8,)
    ).for_cluster(cluster)
    strategy = next(iter(strategies(space, profile, cluster, 128)))
    model = CostModel(profile, cluster, "autoplan")
    tables = search_module._BoundTables(model)
    candidate = search_module._candidate(
        strategy, recompute_modes(space, strategy.schedule), tables
    )
    problem = search_module._problem(candidate, model)
    assert problem.num_stages == 512 and problem.num_units == 514
    assert len({id(row) for row in problem.transfer_s}) <= 4
    first = next(iter(candidate.by_mode.values()))
    for s in (0, 1, 63, 64, 510, 511):
        assert problem.transfer_s[s] == tuple(
            model.boundary(c, strategy, s).transfer_s for c in first
        )
        assert problem.message_s[s] == model.boundary(first[0], strategy, s).message_s
