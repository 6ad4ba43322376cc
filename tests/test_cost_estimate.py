"""`estimate` end to end: a hand-worked plan, its structure (what the planner reproduces), and
the properties the issue asks for (hypothesis)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autoplan import Plan, PlanError, StagePlan
from autoplan._format import fmt_memory
from autoplan.api import estimate as api_estimate
from autoplan.api import manual_plan
from autoplan.contract.plan import Recompute, even_stages
from cost_model.compute import op_time
from cost_model.estimate import (
    CostModel,
    MemoryCapacityError,
    boundary_costs,
    boundary_send_bytes,
    estimate,
    loss_cost,
    memory_constants,
    peak_activations,
    rank_memory,
    rank_tail_s,
    runs_ddp,
    step_overhead_s,
    unit_costs,
)
from cost_model.frameworks import FRAMEWORKS
from cost_model.hardware import Cluster, LinkSpec
from cost_model.schedule_memory import held_microbatches
from cost_model.schedules import (
    SCHEDULES,
    ScheduleError,
    ScheduleSpec,
    StageTimes,
    pipeline_order,
)
from cost_model.strategy import Strategy
from cost_model.workload import ModelProfile, OpProfile, UnitProfile
from tests.cost_profiles import gpt_profile, round_cluster

REL = 1e-9


def _two_unit_profile() -> ModelProfile:
    """Two blocks, one GEMM each: 5e10 FLOPs forward, 1e11 backward per sample, no bytes moved;
    1e6 replicated parameters; 1e6 B saved, in and out per sample at 2 bytes (traced bf16)."""

    def unit(i: int) -> UnitProfile:
        return UnitProfile(
            name=f"blocks.{i}",
            kind="block",
            ops=(
                OpProfile(
                    name="mm",
                    kind="matmul",
                    tp="replicated",
                    forward_flops=5e10,
                    backward_flops=1e11,
                    activation_bytes=0.0,
                ),
            ),
            num_params=1_000_000,
            num_params_tp_sharded=0,
            param_bytes=2_000_000,
            saved_bytes_sharded=1e6,
            saved_bytes_replicated=0.0,
            input_bytes=1e6,
            output_bytes=1e6,
        )

    return ModelProfile(
        name="two", units=(unit(0), unit(1)), seq_len=100, hidden_size=8, traced_dtype_bytes=2
    )


def _two_unit_plan() -> Plan:
    return Plan(
        dp_degree=2,
        tp_degree=1,
        pp_degree=2,
        stages=(StagePlan(first_unit=0, last_unit=0), StagePlan(first_unit=1, last_unit=1)),
        micro_batch_size=1,
        num_micro_batches=4,
        global_batch_size=8,
        schedule="1f1b",
    )


def test_hand_worked_step_time_and_memory() -> None:
    # 1 node x 4 devices, layout (pp, dp, tp): pp rank 0 = devices {0, 1}, rank 1 = {2, 3}.
    # Each unit: forward f = 5e10 / (0.5 * 100e12) = 1e-3 s, backward b = 2e-3 s. Stage 0's
    # output (1e6 B) and its gradient each take L = 10 us + 1e6 / 50e9 = 3e-5 s on the link.
    # Torch's 1F1B, m = 4: rank 0 runs F0 F1 B0 F2 B1 F3 B2 B3, rank 1 F B F B F B F B.
    # Rank 0's backward of micro-batch j waits for rank 1's (+ L): in the steady state each
    # costs f + L on rank 0's side plus rank 1's f + b, so rank 0 ends at
    #   B0 4.06e-3 -> 6.06, F2 -> 7.06, B1 7.06 -> 9.06, F3 -> 10.06, B2 10.12 -> 12.12,
    #   B3 13.12 -> 15.12e-3 (rank 1's last backward ends at 13.09e-3, + L).
    # DP all-reduce of 1e6 grads, reduced in fp32 (4e6 B), over 2 ranks of one node:
    #   2 * 1/2 * 4e6 / 50e9 + 2 * 10 us = 1e-4 s, hidden behind the 2e-3 s last backward.
    # Adam: 1e6 params * 30 B / (0.5 * 1 TB/s) = 6e-5 s. Step = 1.512e-2 + 6e-5 = 1.518e-2 s.
    cluster = dataclasses.replace(round_cluster(), devices_per_node=4)
    result = estimate(_two_unit_profile(), cluster, _two_unit_plan())
    assert result.pipeline_time_s == pytest.approx(1.512e-2, rel=REL)
    assert result.tail_s == pytest.approx(6e-5, rel=REL)
    assert result.step_time_s == pytest.approx(1.518e-2, rel=REL)
    # 8 sequences x 100 tokens per step.
    assert result.tokens_per_s == pytest.approx(800 / 1.518e-2, rel=REL)
    # Model FLOPs 3 * (2 * 5e10) * 8 = 2.4e12 per step over 4 devices.
    assert result.model_tflops_per_device == pytest.approx(2.4e12 / 1.518e-2 / 4 / 1e12, rel=REL)
    assert result.mfu == pytest.approx(2.4e12 / 1.518e-2 / 4 / 100e12, rel=REL)
    # Memory, rank 0 (bf16 ZeRO-0 with PP runs under FSDP2's replicate): 1e6 params x (fp32
    # weights 4 + bf16 gathered weights 2 + fp32 grads 4 + Adam moments 8) = 1.8e7;
    # activations 1e6 B x min(m, p - 0) = 2 in flight = 2e6, and their 2 outputs (1e6 B each)
    # sent to rank 1 and kept until their backward = 2e6; buffers: one block's backward
    # working set 1e6 + p2p 2 x 1e6 (the pipeline defers the gradient reduction, so no FSDP2
    # reduce buffers at the peak) = 3e6. Total 2.5e7. Rank 1 holds 1 micro-batch and sends no
    # output: 2.2e7.
    assert [r.memory.total_bytes for r in result.ranks] == pytest.approx([2.5e7, 2.2e7])
    assert result.peak_memory_bytes == pytest.approx(2.5e7)
    assert result.fits
    stage0 = result.stages[0]
    assert stage0.compute_s == pytest.approx(4 * 3e-3, rel=REL)
    # the link time delays the peer (idle), it is not this rank's busy time
    assert stage0.pp_comm_s == 0.0
    assert stage0.bubble_s == pytest.approx(1.512e-2 - 4 * 3e-3, rel=REL)


def test_dp_sync_exposed_without_overlap() -> None:
    # dp_overlap_fraction = 0 (sync after backward, Megatron-LM 2021): the 1e-4 s all-reduce
    # is added to the tail: 1e-4 + 6e-5.
    base = dataclasses.replace(round_cluster(), devices_per_node=4)
    cluster = dataclasses.replace(
        base, calibration=dataclasses.replace(base.calibration, dp_overlap_fraction=0.0)
    )
    result = estimate(_two_unit_profile(), cluster, _two_unit_plan())
    assert result.tail_s == pytest.approx(1.6e-4, rel=REL)


def test_memory_overflow_is_reported_with_numbers() -> None:
    # rank 0 needs 2.5e7 B (test_hand_worked_step_time_and_memory)
    cluster = dataclasses.replace(round_cluster(memory_bytes=20 * 2**20), devices_per_node=4)
    result = estimate(_two_unit_profile(), cluster, _two_unit_plan())
    assert not result.fits
    assert not result.ranks[0].fits
    with pytest.raises(MemoryCapacityError) as raised:
        result.require_fits()
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(
        "plan does not fit: pipeline rank 0 needs 23.8 MiB per device, the device has 20 MiB"
    )
    assert "(largest: " in message and "; fix: " in message
    assert message.endswith("(check_memory=False, --allow-over-memory) to run it anyway")


def test_a_plan_over_only_by_the_allocator_margin_says_so() -> None:
    base = dataclasses.replace(round_cluster(), devices_per_node=4)
    cal = dataclasses.replace(
        base.calibration, allocator_overhead_fraction=0.05, reserved_memory_bytes=2**20
    )
    roomy = estimate(
        _two_unit_profile(), dataclasses.replace(base, calibration=cal), _two_unit_plan()
    )
    m = roomy.peak_rank.memory
    # margin: 5% of what the devices hold before the reserve
    assert m.margin_bytes == pytest.approx(0.05 * (m.total_bytes - 2**20) / 1.05, rel=REL)
    assert m.margin_bytes < m.reserve_bytes
    for capacity, edge in ((m.total_bytes - m.margin_bytes / 2, True), (m.total_bytes / 2, False)):
        device = dataclasses.replace(base.device, memory_bytes=int(capacity))
        tight = estimate(
            _two_unit_profile(),
            dataclasses.replace(base, device=device, calibration=cal),
            _two_unit_plan(),
        )
        assert not tight.fits
        assert tight.fits_without_margin is edge
        assert ("over only by the allocator margin" in tight.memory_problem()) is edge


# ------------------------------------------------------------------------------- structure


@st.composite
def _plans(draw: st.DrawFn) -> tuple[ModelProfile, Cluster, Plan]:
    """Random valid plans: every schedule, uneven cuts, up to 8 chunks per rank, per-stage
    recompute (none under a split backward, as the runtime requires), some on CPU workers that
    share cores."""
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.sampled_from([1, 2, 3, 4]))
    dp = draw(st.sampled_from([1, 2]))
    schedule = draw(st.sampled_from(SCHEDULES if pp > 1 else ("gpipe", "1f1b")))
    if schedule in ("gpipe", "1f1b"):
        v = 1
    elif schedule in ("zbv", "dualpipev"):
        v = 2
    else:
        v = draw(st.integers(2, 8))
    m = draw(st.integers(1, 4 * pp))
    try:
        ScheduleSpec(schedule=schedule, pp_degree=pp, virtual_stages=v, num_micro_batches=m)
    except ScheduleError:
        m = 2 * pp * draw(st.integers(1, 2))  # valid for every schedule
    num_stages = pp * v
    num_layers = draw(st.integers(max(2, num_stages), num_stages + 6))
    profile = gpt_profile(num_layers=num_layers, s=64, h=64, a=4, vocab=256)
    n = profile.num_units
    cuts = sorted(
        draw(st.sets(st.integers(1, n - 1), min_size=num_stages - 1, max_size=num_stages - 1))
    )
    bounds = [0, *cuts, n]
    modes = ("none",) if schedule in ("interleaved-zb", "zbv", "dualpipev") else RECOMPUTE
    stages = tuple(
        StagePlan(
            first_unit=bounds[i],
            last_unit=bounds[i + 1] - 1,
            recompute=draw(st.sampled_from(modes)),
        )
        for i in range(num_stages)
    )
    mb = draw(st.integers(1, 2))
    plan = Plan(
        dp_degree=dp,
        tp_degree=tp,
        pp_degree=pp,
        virtual_stages=v,
        stages=stages,
        micro_batch_size=mb,
        num_micro_batches=m,
        global_batch_size=mb * m * dp,
        schedule=schedule,
        zero_stage=draw(st.integers(0, 3)),
        sequence_parallel=tp > 1 and draw(st.booleans()),
        rank_layout=draw(
            st.sampled_from([("pp", "dp", "tp"), ("dp", "pp", "tp"), ("tp", "dp", "pp")])
        ),
    )
    devices = tp * pp * dp
    per_node = draw(st.sampled_from([d for d in (1, 2, 4, 8) if devices % d == 0]))
    cluster = round_cluster(num_nodes=devices // per_node, devices_per_node=per_node)
    if draw(st.booleans()):  # CPU workers sharing the node's cores (the test rig)
        cluster = dataclasses.replace(cluster, shared_cores_per_node=draw(st.integers(1, 4)))
    return profile, cluster, plan


RECOMPUTE: tuple[Recompute, ...] = ("none", "selective", "full")


def _event_driven_step(spec: ScheduleSpec, times: list[StageTimes], tails: list[float]) -> float:
    """An independent simulator: each rank runs its torch order one action at a time, starting
    an action once the rank is free and its input has arrived (the previous stage's forward, the
    next stage's backward-input, each plus its link time; a weight gradient after its own
    backward-input). Written for the test, sharing nothing with `cost_model.schedules` but
    the orders."""
    orders = pipeline_order(spec)
    S = spec.num_stages
    done: dict[tuple[int, str, int], float] = {}
    position = [0] * spec.pp_degree
    free = [0.0] * spec.pp_degree
    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for rank, order in enumerate(orders):
            while position[rank] < len(order):
                a = order[position[rank]]
                t = times[a.stage_idx]
                if a.kind == "F":
                    ready = (a.stage_idx - 1, "F", a.microbatch_idx)
                    link = times[a.stage_idx - 1].transfer_s if a.stage_idx > 0 else 0.0
                    duration = t.forward_s
                elif a.kind == "W":
                    ready, link, duration = (a.stage_idx, "I", a.microbatch_idx), 0.0, t.weight_s
                else:
                    nxt = a.stage_idx + 1
                    if nxt < S:
                        # the gradient leaves with the next stage's backward-input (or its whole
                        # backward, which a split schedule may also run)
                        kind = "B" if (nxt, "B", a.microbatch_idx) in done else "I"
                        ready, link = (nxt, kind, a.microbatch_idx), t.transfer_s
                    else:
                        ready, link = (a.stage_idx, "F", a.microbatch_idx), 0.0
                    duration = t.backward_s - (t.weight_s if a.kind == "I" else 0.0)
                if ready[0] >= 0 and ready not in done:
                    break  # waits for another rank
                arrival = done[ready] + link if ready[0] >= 0 else 0.0
                free[rank] = max(free[rank], arrival) + duration
                done[(a.stage_idx, a.kind, a.microbatch_idx)] = free[rank]
                position[rank] += 1
                remaining -= 1
                progressed = True
        assert progressed, "the orders deadlock"
    return max(f + tail for f, tail in zip(free, tails, strict=True))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_plans())
def test_estimate_is_the_simulation_of_torchs_orders(
    case: tuple[ModelProfile, Cluster, Plan],
) -> None:
    """The step time is the schedule run on the stages' times (an independent event-driven
    run of torch's orders here), and the memory the peak of what those orders hold."""
    profile, cluster, plan = case
    result = estimate(profile, cluster, plan)
    strategy = Strategy.of(plan)
    spec = strategy.schedule_spec
    p = plan.pp_degree
    stage_units = [
        unit_costs(profile, cluster, strategy, stage.recompute)[
            stage.first_unit : stage.last_unit + 1
        ]
        for stage in plan.stages
    ]
    boundaries = [
        boundary_costs(units[-1], cluster, strategy, idx) for idx, units in enumerate(stage_units)
    ]
    times = []
    for idx, units in enumerate(stage_units):
        previous = boundaries[idx - 1].message_s if idx > 0 else 0.0
        backward = sum(u.backward_s for u in units) + previous
        times.append(
            StageTimes(
                forward_s=sum(u.forward_s for u in units) + boundaries[idx].message_s,
                backward_s=backward,
                weight_s=sum(u.weight_s for u in units) if spec.splits_backward else 0.0,
                transfer_s=boundaries[idx].transfer_s,
            )
        )
    rank_units = [[u for s in spec.rank_stages(r) for u in stage_units[s]] for r in range(p)]
    fixed = step_overhead_s(strategy, cluster)
    tails = [
        rank_tail_s(units, cluster.calibration.dp_overlap_fraction) + fixed for units in rank_units
    ]
    independent = _event_driven_step(spec, times, tails)
    assert result.step_time_s == pytest.approx(independent, rel=5e-3)  # the 0.5%
    assert result.step_time_s == pytest.approx(independent, rel=1e-9)  # in fact exact
    costs = unit_costs(profile, cluster, strategy, "none")
    constants = memory_constants(costs, cluster, strategy)
    send_bytes = boundary_send_bytes(costs, cluster.calibration)
    held = held_microbatches(spec)
    memory = [
        rank_memory(
            rank_units[r], peak_activations(stage_units, held[r], send_bytes).bytes, constants
        ).total_bytes
        for r in range(p)
    ]
    assert result.peak_memory_bytes == pytest.approx(max(memory), rel=1e-12)
    cal = cluster.calibration
    for rank in result.ranks:
        m = rank.memory
        parts = (
            m.param_bytes + m.grad_bytes + m.optimizer_bytes + m.activation_bytes,
            m.working_bytes,
            m.loss_bytes,
            m.reserve_bytes,
        )
        assert sum(parts) == pytest.approx(m.total_bytes, rel=1e-12)
        # the reserve is the framework's plus the allocator's margin on everything else
        expected = cal.reserved_memory_bytes + cal.allocator_overhead_fraction * (
            m.total_bytes - m.reserve_bytes
        )
        assert m.reserve_bytes == pytest.approx(expected, rel=1e-9)
    # the loss's part: on the head's rank, its log-probabilities for every micro-batch the
    # head's stage holds at the peak, and once more as the backward's working set
    last = len(plan.stages) - 1
    saved = loss_cost(
        profile.units[plan.stages[last].first_unit :][-1],
        strategy,
        cluster,
        profile.traced_dtype_bytes,
    ).saved_bytes
    for rank in result.ranks:
        if last not in rank.stages:
            assert rank.memory.loss_bytes == 0.0
            continue
        peak = peak_activations(stage_units, held[rank.pp_rank], send_bytes)
        count = peak.microbatches[held[rank.pp_rank].stages.index(last)]
        assert rank.memory.loss_bytes == pytest.approx(saved * (count + 1), rel=1e-9)


def test_memory_headroom_is_explicit() -> None:
    gib = 2.0**30
    assert fmt_memory(79.9 * gib, 7.5 * gib, 80 * gib) == (
        "predicted 72.4 GiB + 7.5 GiB reserve/margin of 80 GiB"
    )
    assert fmt_memory(10 * gib, 0, 80 * gib) == "10 GiB of 80 GiB"  # a file without the reserve


# ------------------------------------------------------------------------------- properties


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_plans(), st.floats(1.0, 100.0), st.floats(1.0, 100.0), st.floats(1.0, 10.0))
def test_more_bandwidth_is_never_slower(
    case: tuple[ModelProfile, Cluster, Plan], intra: float, inter: float, memory: float
) -> None:
    profile, cluster, plan = case
    faster = dataclasses.replace(
        cluster,
        intra_node=LinkSpec(
            bandwidth_bytes_per_s=cluster.intra_node.bandwidth_bytes_per_s * intra,
            latency_s=cluster.intra_node.latency_s,
        ),
        inter_node=LinkSpec(
            bandwidth_bytes_per_s=cluster.inter_node.bandwidth_bytes_per_s * inter,
            latency_s=cluster.inter_node.latency_s,
        ),
        device=dataclasses.replace(
            cluster.device,
            memory_bandwidth_bytes_per_s=cluster.device.memory_bandwidth_bytes_per_s * memory,
        ),
    )
    slow = estimate(profile, cluster, plan)
    fast = estimate(profile, faster, plan).step_time_s
    # The schedule itself is monotone (a longest path). One effect is not: the gradient sync
    # overlaps the rank's last backward, so when that backward shrinks but the rank's end does
    # not (it waits for another rank), less of the sync hides. At most the overlap fraction of
    # one rank's backward per micro-batch.
    overlap = cluster.calibration.dp_overlap_fraction
    hidden = max(sum(slow.stages[s].backward_s for s in rank.stages) for rank in slow.ranks)
    assert fast <= slow.step_time_s * (1 + 1e-12) + overlap * hidden
    if plan.dp_degree == 1:  # no gradient sync: strictly monotone
        assert fast <= slow.step_time_s * (1 + 1e-12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_plans())
def test_more_recompute_never_holds_more_activations(
    case: tuple[ModelProfile, Cluster, Plan],
) -> None:
    profile, cluster, plan = case
    held = []
    for mode in ("none", "selective", "full"):
        stages = tuple(dataclasses.replace(s, recompute=mode) for s in plan.stages)
        result = estimate(profile, cluster, dataclasses.replace(plan, stages=stages))
        # per rank: its peak point may move between modes, its total at the peak cannot grow
        # (the loss's log-probabilities in flight are part of it; its working set is fixed)
        held.append([r.memory.activation_bytes + r.memory.loss_bytes for r in result.ranks])
        strategy = Strategy.of(plan)
        assert all(
            a >= b
            for a, b in zip(
                (u.activation_bytes for u in unit_costs(profile, cluster, strategy, "none")),
                (u.activation_bytes for u in unit_costs(profile, cluster, strategy, mode)),
                strict=True,
            )
        )
    for none, selective, full in zip(*held, strict=True):
        assert none >= selective >= full


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_plans())
def test_higher_zero_level_never_holds_more(case: tuple[ModelProfile, Cluster, Plan]) -> None:
    """Weights + gradients + optimizer state + activations per device (the state a ZeRO level
    shards; ZeRO-3's transient gather buffers are the documented exception for tiny models)."""
    profile, cluster, plan = case
    held = []
    for zero in range(4):
        result = estimate(profile, cluster, dataclasses.replace(plan, zero_stage=zero))
        held.append(
            [
                r.memory.param_bytes
                + r.memory.grad_bytes
                + r.memory.optimizer_bytes
                + r.memory.activation_bytes
                for r in result.ranks
            ]
        )
    for lower, higher in itertools.pairwise(held):
        assert all(h <= lo * (1 + 1e-12) for lo, h in zip(lower, higher, strict=True))


# ------------------------------------------------------------------------------- API


def test_manual_plan_even_split_and_estimate() -> None:
    profile = gpt_profile(num_layers=6)
    cluster = Cluster.preset("dgx-a100-80g", nodes=2)
    plan = manual_plan(
        profile, cluster, tp=4, pp=2, micro_batch=2, global_batch=64, recompute="selective", zero=1
    )
    assert (plan.dp_degree, plan.num_micro_batches) == (2, 16)
    assert plan.stages == even_stages(profile.num_units, 2, "selective")
    assert plan.estimate is not None
    result = api_estimate(profile, cluster, plan)
    assert plan.estimate.step_time_s == pytest.approx(result.step_time_s)
    assert result.num_devices == 16


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(tp=3, pp=1, global_batch=8), r"tp x pp = 3 x 1 = 3 does not divide the 8 devices"),
        (
            dict(tp=2, pp=1, cp=3, global_batch=8),
            r"tp x pp x cp = 2 x 1 x 3 = 6 does not divide the 8 devices .*choose tp, pp and cp",
        ),
        (dict(tp=2, pp=1, dp=2, global_batch=8), r"= 4, but cluster .* has 8 devices.*use dp = 4"),
        (
            dict(tp=2, pp=2, global_batch=5),
            r"global_batch = 5 is not a multiple of micro_batch x dp = 1 x 2 = 2",
        ),
        (
            dict(tp=8, pp=1, global_batch=8, num_heads=12),
            r"tp_degree = 8 does not divide num_heads = 12",
        ),
    ],
)
def test_impossible_plans_raise_plan_error(kwargs: dict, message: str) -> None:  # type: ignore[type-arg]
    heads = kwargs.pop("num_heads", 8)
    profile = gpt_profile(num_layers=4, h=96 if heads == 12 else 64, a=heads)
    cluster = Cluster.preset("dgx-a100-80g")
    with pytest.raises(PlanError, match=message):
        manual_plan(profile, cluster, **kwargs)


def _with_calibration(cluster: Cluster, **values: float) -> Cluster:
    return dataclasses.replace(
        cluster, calibration=dataclasses.replace(cluster.calibration, **values)
    )


def _on_cpu(cluster: Cluster) -> Cluster:
    """``cluster`` with CPU workers: one core dispatches and computes, so host time adds."""
    return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, kind="cpu"))


def test_host_overheads_hand_worked() -> None:
    # CPU workers. bf16 with dp 2: every unit is its own FSDP2 group (passes/data_parallel.py),
    # so each unit adds dp_unit_overhead_s = 1e-4 s per micro-batch, half to its forward and
    # half to its backward: f = 1.05e-3, b = 2.05e-3, link L = 3e-5 (as in the hand-worked
    # step). 1F1B:
    #   rank 1: F 1.08-2.13, B -4.18, F 4.18-5.23, B -7.28, F 7.34-8.39, B -10.44,
    #           F 10.44-11.49, B -13.54
    #   rank 0: F 0-1.05, F -2.10, B 4.21-6.26, F -7.31, B 7.31-9.36, F -10.41,
    #           B 10.47-12.52, B 13.57-15.62e-3
    # Each rank's optimizer steps one unit of distributed tensors: tail = 6e-5 (Adam) + 2e-5.
    base = _on_cpu(dataclasses.replace(round_cluster(), devices_per_node=4))
    cluster = _with_calibration(
        base, dp_unit_overhead_s=1e-4, sharded_optimizer_unit_overhead_s=2e-5
    )
    result = estimate(_two_unit_profile(), cluster, _two_unit_plan())
    assert result.pipeline_time_s == pytest.approx(1.562e-2, rel=REL)
    assert result.tail_s == pytest.approx(8e-5, rel=REL)
    assert result.step_time_s == pytest.approx(1.570e-2, rel=REL)


def test_host_overheads_are_a_floor_on_a_gpu() -> None:
    """A GPU's host runs ahead of its asynchronous kernels: the wrappers' time per unit and
    micro-batch is a floor under the unit's time, not an addition, and their time per step a
    floor under the optimizer step (with the stack's own floor per TP block). Hand-worked on the
    two-unit pipeline (f = 1e-3, b = 2e-3 per unit, Adam 6e-5 per rank):
    - 1e-4 per micro-batch and 2e-5 per step hide behind them: the step of the plain estimate;
    - 6e-3 per micro-batch is longer than f + b = 3e-3: each unit takes 6e-3, split 1:2 like
      its own time (f 2e-3, b 4e-3), and 1e-3 per step is longer than Adam's 6e-5."""
    strategy = Strategy(dp_degree=2, micro_batch_size=1, num_micro_batches=4, dtype="bf16")
    base = dataclasses.replace(round_cluster(), devices_per_node=4)
    plain = estimate(_two_unit_profile(), base, _two_unit_plan())
    hidden = _with_calibration(
        base, dp_unit_overhead_s=1e-4, sharded_optimizer_unit_overhead_s=2e-5
    )
    assert estimate(_two_unit_profile(), hidden, _two_unit_plan()).step_time_s == pytest.approx(
        plain.step_time_s, rel=REL
    )
    slow = _with_calibration(base, dp_unit_overhead_s=6e-3, sharded_optimizer_unit_overhead_s=1e-3)
    for unit in unit_costs(_two_unit_profile(), slow, strategy, "none"):
        assert (unit.forward_s, unit.backward_s) == pytest.approx((2e-3, 4e-3), rel=REL)
        assert unit.host_s == pytest.approx(3e-3, rel=REL)  # the device's wait
        assert unit.optimizer_s == pytest.approx(1e-3, rel=REL)
    # the same constants on CPU workers add: f + 3e-3, b + 3e-3, Adam + 1e-3
    for unit in unit_costs(_two_unit_profile(), _on_cpu(slow), strategy, "none"):
        assert (unit.forward_s, unit.backward_s) == pytest.approx((4e-3, 5e-3), rel=REL)
        assert unit.optimizer_s == pytest.approx(1e-3 + 6e-5, rel=REL)


def test_tp_module_overhead_counts_sharded_modules_and_skips_ddp_plans() -> None:
    # CPU workers (host time adds). Two units with a column and a row linear each; tp 2, dp 1, fp32, m = 4: 4 micro-batches x
    # 2 units x 2 modules x 1e-4 s = 1.6e-3 s more, plus 2 units x 2e-5 s of optimizer over
    # distributed tensors. dp_unit_overhead_s does not apply: one fp32 data-parallel rank has
    # no wrapper.
    def linear(name: str, role: str) -> OpProfile:
        return OpProfile(
            name=name,
            kind="matmul",
            tp=role,  # type: ignore[arg-type]
            forward_flops=1e9,
            backward_flops=2e9,
            activation_bytes=0.0,
            param_bytes_read=4e6,
        )

    profile = _two_unit_profile()
    units = tuple(
        dataclasses.replace(u, ops=(linear("up", "column"), linear("down", "row")))
        for u in profile.units
    )
    profile = dataclasses.replace(profile, units=units)
    plan = Plan(
        dp_degree=1,
        tp_degree=2,
        pp_degree=1,
        stages=(StagePlan(first_unit=0, last_unit=1),),
        micro_batch_size=1,
        num_micro_batches=4,
        global_batch_size=4,
        schedule="1f1b",
        dtype="fp32",
    )
    cluster = _on_cpu(dataclasses.replace(round_cluster(), devices_per_node=2))
    plain = estimate(profile, cluster, plan).step_time_s
    loaded = _with_calibration(
        cluster,
        tp_module_overhead_s=1e-4,
        dp_unit_overhead_s=1.0,
        sharded_optimizer_unit_overhead_s=2e-5,
    )
    assert estimate(profile, loaded, plan).step_time_s - plain == pytest.approx(
        1.6e-3 + 4e-5, rel=1e-6
    )
    # With sequence parallelism the norm (a reduction with weights) is wrapped too: 3 modules
    # per unit, 4 x 2 x 3 x 1e-4 = 2.4e-3 s, plus the same optimizer term.
    norm = OpProfile(
        name="ln",
        kind="reduction",
        tp="replicated",
        forward_flops=1e6,
        backward_flops=2e6,
        activation_bytes=1e3,
        param_bytes_read=1e3,
    )
    profile = dataclasses.replace(
        profile, units=tuple(dataclasses.replace(u, ops=(norm, *u.ops)) for u in profile.units)
    )
    sp = dataclasses.replace(plan, sequence_parallel=True)
    assert estimate(profile, loaded, sp).step_time_s - estimate(
        profile, cluster, sp
    ).step_time_s == pytest.approx(2.4e-3 + 4e-5, rel=1e-6)


def test_pipeline_message_overhead_hand_worked() -> None:
    # pp_message_overhead_s = 1e-5 per message posted: stage 0's forward posts its output
    # (f0 = 1.01e-3), stage 1's backward its gradient (b1 = 2.01e-3); the link L = 3e-5 delays
    # the peer. 1F1B, m = 4:
    #   rank 1: F 1.04-2.04, B -4.05, F 4.05-5.05, B -7.06, F 7.12-8.12, B -10.13,
    #           F 10.13-11.13, B -13.14
    #   rank 0: F 0-1.01, F -2.02, B 4.08-6.08, F -7.09, B 7.09-9.09, F -10.10,
    #           B 10.16-12.16, B 13.17-15.17e-3
    base = dataclasses.replace(round_cluster(), devices_per_node=4)
    cluster = _with_calibration(base, pp_message_overhead_s=1e-5)
    result = estimate(_two_unit_profile(), cluster, _two_unit_plan())
    assert result.pipeline_time_s == pytest.approx(1.517e-2, rel=REL)
    # busy time posting messages: stage 0 one per micro-batch (stage 1 posts the gradients)
    assert result.stages[0].pp_comm_s == pytest.approx(4 * 1e-5, rel=REL)
    assert result.stages[1].pp_comm_s == pytest.approx(4 * 1e-5, rel=REL)


def test_zero3_gathers_hide_behind_compute_only_as_far_as_the_overlap_fraction_says() -> None:
    profile = gpt_profile()
    strategy = Strategy(dp_degree=8, zero_stage=3, micro_batch_size=1, dtype="bf16")
    cluster = round_cluster()
    for overlap in (0.0, 0.5, 1.0):
        costs = unit_costs(
            profile, _with_calibration(cluster, dp_overlap_fraction=overlap), strategy, "none"
        )
        for u in costs:
            expected = max(0.0, u.zero3_forward_s - overlap * u.forward_compute_s) + max(
                0.0, u.zero3_backward_s - overlap * (u.backward_compute_s + u.recompute_s)
            )
            assert u.zero3_exposed_s == pytest.approx(expected, rel=REL)
            assert u.forward_s == pytest.approx(
                u.forward_compute_s
                + u.tp_forward_s
                + max(0.0, u.zero3_forward_s - overlap * u.forward_compute_s),
                rel=REL,
            )
        if overlap == 0.0:
            assert all(
                u.zero3_exposed_s == pytest.approx(u.zero3_forward_s + u.zero3_backward_s)
                for u in costs
            )


def test_hidden_zero3_collectives_still_slow_the_compute_they_overlap() -> None:
    # overlapped_comm_slowdown = 0.5: each unit pays max(0, c - w) + 0.5 min(c, w) per phase,
    # with c its gather (forward) or gather + scatter (backward) and w the compute window. A
    # unit whose collective fits its window (c < w) pays half of c; one that outlasts it pays
    # (c - w) + w / 2. With the slowdown off, only the exposed part counts (as before).
    profile = gpt_profile()
    strategy = Strategy(dp_degree=8, zero_stage=3, micro_batch_size=1, dtype="bf16")
    cluster = _with_calibration(round_cluster(), overlapped_comm_slowdown=0.5)
    plain = unit_costs(profile, round_cluster(), strategy, "none")
    slowed = unit_costs(profile, cluster, strategy, "none")
    assert any(u.zero3_forward_s > 0 for u in slowed)
    for u, base in zip(slowed, plain, strict=True):
        fwd, bwd = u.zero3_forward_s, u.zero3_backward_s
        w_f, w_b = u.forward_compute_s, u.backward_compute_s + u.recompute_s
        expected = (
            max(0.0, fwd - w_f) + 0.5 * min(fwd, w_f) + max(0.0, bwd - w_b) + 0.5 * min(bwd, w_b)
        )
        assert u.zero3_exposed_s == pytest.approx(expected, rel=REL)
        assert u.forward_s - base.forward_s == pytest.approx(0.5 * min(fwd, w_f), rel=REL)


def test_full_recompute_stops_before_the_tail_that_saves_nothing() -> None:
    # Each block's last two ops (the row-parallel down projection and the residual add) save
    # nothing for the backward: with early stop (torch's non-reentrant checkpoint) full
    # recompute re-runs the forward without them, and without the down projection's TP
    # all-reduce (1 of the block's 2); with early stop off it re-runs all of it.
    base = gpt_profile()
    units = tuple(
        dataclasses.replace(u, recompute_skip_ops=2) if u.kind == "block" else u for u in base.units
    )
    profile = dataclasses.replace(base, units=units)
    strategy = Strategy(tp_degree=2, micro_batch_size=1, dtype="bf16")
    cluster = round_cluster()
    early = unit_costs(profile, cluster, strategy, "full")
    whole = unit_costs(
        profile, _with_calibration(cluster, full_recompute_early_stop=0.0), strategy, "full"
    )
    none = unit_costs(profile, cluster, strategy, "none")
    for index, unit in enumerate(profile.units):
        if unit.kind != "block":
            continue
        tail = sum(
            op_time(
                op,
                device=cluster.device,
                calibration=cluster.calibration,
                dtype="bf16",
                micro_batch_size=1,
                tp_degree=2,
                traced_dtype_bytes=profile.traced_dtype_bytes,
            ).forward_s
            for op in unit.ops[-2:]
        )
        assert tail > 0
        assert whole[index].recompute_s == pytest.approx(whole[index].forward_compute_s, rel=REL)
        assert early[index].recompute_s == pytest.approx(
            early[index].forward_compute_s - tail, rel=REL
        )
        tp_fwd = none[index].tp_forward_s
        assert tp_fwd > 0
        assert whole[index].tp_backward_s == pytest.approx(none[index].tp_backward_s + tp_fwd)
        assert early[index].tp_backward_s == pytest.approx(none[index].tp_backward_s + tp_fwd / 2)


def _many_small_units(n: int, params: int) -> ModelProfile:
    block = _two_unit_profile().units[0]
    units = tuple(
        dataclasses.replace(block, name=f"blocks.{i}", num_params=params, param_bytes=2 * params)
        for i in range(n)
    )
    return dataclasses.replace(_two_unit_profile(), units=units)


def test_ddp_all_reduces_buckets_not_units() -> None:
    # fp32 DDP (dp 2, no TP/PP): 20 units x 1000 params x 4 B = 8e4 B of gradients fit in
    # DDP's first 1 MiB bucket: one all-reduce, 2 x 1/2 x 8e4 / 50e9 + 2 x 10 us = 2.16e-5 s,
    # split over the units by bytes (1.08e-6 s each), where 20 per-unit all-reduces would
    # cost 20 x (8e-8 + 2e-5).
    profile = _many_small_units(20, 1000)
    strategy = Strategy(dp_degree=2, dtype="fp32")
    costs = unit_costs(profile, round_cluster(devices_per_node=2), strategy, "none")
    assert [u.dp_sync_s for u in costs] == pytest.approx([2.16e-5 / 20] * 20, rel=REL)


def test_ddp_bucket_count_follows_the_bucket_caps() -> None:
    # 2 units x 10M params x 4 B = 8e7 B: buckets of 1 MiB, then 25 MiB, 25 MiB, 25 MiB and
    # the remaining 8e7 - 76 MiB = 307,264 B: five all-reduces, so 8e7 / 50e9 + 5 x 2e-5 s.
    profile = _many_small_units(2, 10_000_000)
    strategy = Strategy(dp_degree=2, dtype="fp32")
    costs = unit_costs(profile, round_cluster(devices_per_node=2), strategy, "none")
    assert sum(u.dp_sync_s for u in costs) == pytest.approx(8e7 / 50e9 + 5 * 2e-5, rel=REL)


def test_fsdp_puts_embedding_and_head_in_one_stage_group() -> None:
    # bf16 replicate (FSDP2 per-unit groups) with one stage: each block all-reduces alone;
    # the untied embedding and head share the stage's group: one all-reduce of their bytes.
    profile = gpt_profile(num_layers=2, tied=False)
    strategy = Strategy(dp_degree=2, dtype="bf16")
    cluster = round_cluster(devices_per_node=2)
    costs = unit_costs(profile, cluster, strategy, "none")
    ends = [i for i, u in enumerate(profile.units) if u.kind != "block"]
    grads = sum(profile.units[i].num_params * 4 for i in ends)  # reduced in fp32
    merged = grads / 50e9 + 2 * 10e-6
    assert sum(costs[i].dp_sync_s for i in ends) == pytest.approx(merged, rel=REL)
    block = next(i for i, u in enumerate(profile.units) if u.kind == "block")
    assert costs[block].dp_sync_s == pytest.approx(
        profile.units[block].num_params * 4 / 50e9 + 2 * 10e-6, rel=REL
    )


def test_gradients_reduce_in_fp32_except_fp16() -> None:
    from cost_model.estimate import grad_reduce_bytes

    widths = [grad_reduce_bytes(Strategy(dtype=d)) for d in ("fp32", "bf16", "fp16", "fp8")]
    assert widths == [4, 4, 2, 4]
    # unless the plan states its reduction dtype (`Plan.grad_reduce_dtype`)
    assert grad_reduce_bytes(Strategy(dtype="bf16", grad_reduce_dtype="bf16")) == 2
    assert grad_reduce_bytes(Strategy(dtype="fp16", grad_reduce_dtype="fp32")) == 4


def test_oversubscription_factors_hand_worked() -> None:
    from cost_model.estimate import oversubscription_factors

    gpus = round_cluster(devices_per_node=4)
    cpus = dataclasses.replace(gpus, shared_cores_per_node=2)
    # Devices of their own (GPUs): nothing stretches.
    assert oversubscription_factors(Strategy(dp_degree=4), gpus) == (1.0, 1.0)
    # Pure DP on 4 workers over 2 cores: everything runs at half speed.
    assert oversubscription_factors(Strategy(dp_degree=4), cpus) == (2.0, 2.0)
    # pp 4, m 4: 7 waves keep 1, 2, 3, 4, 3, 2, 1 workers busy: factors 1, 1, 1.5, 2, 1.5, 1,
    # 1 -> 9 / 7 for the pipeline; the tail runs on all 4 workers: 2.
    pp4 = Strategy(pp_degree=4, num_micro_batches=4)
    assert oversubscription_factors(pp4, cpus) == pytest.approx((9 / 7, 2.0))
    # One micro-batch through 4 stages: one worker busy at a time, full speed.
    pp4_m1 = Strategy(pp_degree=4, num_micro_batches=1)
    assert oversubscription_factors(pp4_m1, cpus)[0] == pytest.approx(1.0)
    # pp 2 x dp 2, m 2: 3 waves of 1, 2, 1 pipeline ranks x 2 replicas -> 1, 2, 1: 4 / 3.
    hybrid = Strategy(pp_degree=2, dp_degree=2, num_micro_batches=2)
    assert oversubscription_factors(hybrid, cpus) == pytest.approx((4 / 3, 2.0))


def test_shared_cores_stretch_unit_times_by_the_factors() -> None:
    profile = gpt_profile(num_layers=2)
    strategy = Strategy(pp_degree=2, dp_degree=2, num_micro_batches=2, dtype="fp32")
    gpus = round_cluster(devices_per_node=4)
    cpus = dataclasses.replace(gpus, shared_cores_per_node=2)
    own = unit_costs(profile, gpus, strategy, "none")
    shared = unit_costs(profile, cpus, strategy, "none")
    for a, b in zip(own, shared, strict=True):
        assert b.time_s == pytest.approx(a.time_s * 4 / 3, rel=REL)
        assert b.optimizer_s == pytest.approx(a.optimizer_s * 2, rel=REL)
        assert b.dp_sync_s == pytest.approx(a.dp_sync_s * 2, rel=REL)
        assert b.activation_bytes == a.activation_bytes


def test_step_overhead_is_added_once_per_step() -> None:
    # 1e-3 s of the training loop's own time per step, after each rank's 6e-5 s tail (Adam) in the
    # hand-worked example: step 1.518e-2 + 1e-3.
    base = dataclasses.replace(round_cluster(), devices_per_node=4)
    cluster = _with_calibration(base, step_overhead_s=1e-3)
    result = estimate(_two_unit_profile(), cluster, _two_unit_plan())
    assert result.step_time_s == pytest.approx(1.518e-2 + 1e-3, rel=REL)
    assert [r.tail_s for r in result.ranks] == pytest.approx([6e-5 + 1e-3] * 2, rel=REL)


def test_ddp_keeps_a_second_copy_of_the_gradients() -> None:
    # torch's DDP (gradient_as_bucket_view off) copies every gradient into its buckets: 1e6
    # parameters per unit x 2 units x 4 B (fp32). bench/memory.py measures the buckets.
    cluster = dataclasses.replace(round_cluster(), devices_per_node=4)
    strategy = Strategy(dp_degree=2, dtype="fp32", micro_batch_size=1, num_micro_batches=2)
    assert runs_ddp(strategy)
    costs = unit_costs(_two_unit_profile(), cluster, strategy, "none")
    alone = dataclasses.replace(strategy, dp_degree=1)
    extra = (
        memory_constants(costs, cluster, strategy).buffer_bytes
        - memory_constants(costs, cluster, alone).buffer_bytes
    )
    assert extra == sum(c.grad_bytes for c in costs) == 2 * 1e6 * 4


def test_a_stacks_host_floor_bounds_each_tensor_parallel_block_on_a_gpu() -> None:
    """nanotron's profile sets a floor per tensor-parallel block and micro-batch on GPUs
    (`Calibration.tp_block_host_floor_s`): a block whose device time is shorter takes the
    floor, split like its forward and backward; blocks without TP, other units, large blocks
    and CPU workers keep their own time."""
    profile = gpt_profile()  # small: its blocks take microseconds on an H100
    gpu = Cluster.preset("dgx-h100-80g")
    floor = FRAMEWORKS["nanotron"].tp_block_host_floor_s
    assert floor == pytest.approx(4.4e-3)
    tp2 = Strategy(tp_degree=2, micro_batch_size=1, dtype="bf16")
    plain = CostModel(profile, gpu).unit_costs(tp2, "none")
    floored = CostModel(profile, gpu, "nanotron").unit_costs(tp2, "none")
    for before, after in zip(plain, floored, strict=True):
        if before.kind != "block":
            assert after.time_s == pytest.approx(before.time_s, rel=0.05)
            continue
        assert before.time_s < floor / 10
        assert after.time_s == pytest.approx(floor, rel=1e-9)
        assert after.forward_s / after.backward_s == pytest.approx(
            before.forward_s / before.backward_s, rel=1e-9
        )
    # without TP: no floor
    tp1 = Strategy(micro_batch_size=1, dtype="bf16")
    for unit in CostModel(profile, gpu, "nanotron").unit_costs(tp1, "none"):
        assert unit.time_s < floor / 10
    # a block that needs longer than the floor keeps its time
    big = gpt_profile(s=4096, h=4096, a=32, vocab=1024)
    own = CostModel(big, gpu).unit_costs(tp2, "none")
    with_floor = CostModel(big, gpu, "nanotron").unit_costs(tp2, "none")
    blocks = [(a, b) for a, b in zip(own, with_floor, strict=True) if a.kind == "block"]
    assert blocks and all(a.time_s > floor for a, _ in blocks)
    assert all(b.time_s == pytest.approx(a.time_s, rel=0.05) for a, b in blocks)
    # a CPU worker's host time adds to its compute (`autoplan calibrate`): the profile's GPU
    # floor is not written there
    cpu = Cluster.preset("local")
    assert FRAMEWORKS["nanotron"].cluster_for(profile, cpu).calibration.tp_block_host_floor_s == 0
    # and a step of many micro-batches pays the floor for each
    plan = manual_plan(
        profile, gpu, tp=2, micro_batch=1, global_batch=32, framework="nanotron", dtype="bf16"
    )
    blocks_per_step = 8 * sum(u.kind == "block" for u in profile.units)
    assert estimate(profile, gpu, plan).step_time_s > blocks_per_step * floor
