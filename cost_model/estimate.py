"""Step time and memory of a plan: per-unit costs composed from one part per technique,
assembled through the schedule simulation.

Expects a `ModelProfile`, a `Cluster` and a plan (`PlanLike`: ``autoplan.Plan`` or anything with
its fields). Guarantees: `estimate` is a pure function built only from the public blocks below,
in this exact structure, so the planner can reproduce it (its CP-SAT model cuts with the
simulation's longest paths, `autoplan.planner.partition`):

- `CostModel.unit_costs(strategy, recompute)` (composed in `cost_model.unit_composition`): for
  fixed outer choices, every unit's `UnitCost`, the sum of its parts (`cost_model.parts`):
  compute and recompute (`parts.compute`), TP collectives (`parts.tensor_parallel`),
  data-parallel sync and ZeRO (`parts.data_parallel`), tied-gradient all-reduces
  (`parts.pipeline`), the optimizer step (`parts.optimizer`), wrapper host time (`parts.host`)
  and bytes (`parts.memory`); then the runtime's grouping of data-parallel collectives
  (`parts.data_parallel.grouped_dp_sync`) and CPU core sharing (`parts.core_sharing`, the
  identity on GPUs).
- per stage (`stage_times`, in `cost_model.stage_terms` with the planner's linear form): the
  sums over its units, the host time of its messages, and the link time of its boundary
  (`boundary_costs`: the last unit's output to the next stage's rank).
- tail after a rank's last action: ``max(0, dp_sync - overlap * backward_window) + post_sync +
  optimizer`` (`rank_tail_s`, ibid.) plus the loop's fixed `step_overhead_s`.
- step time: `cost_model.schedules.simulate` of the schedule's own action orders (torch's) with
  those times: ``max over ranks of (end of the rank's last action + its tail)``.
- memory of rank r = (1 + allocator overhead) * (static bytes + activations held at the rank's
  peak point of the schedule + constant buffers) + reserved bytes (`cost_model.rank_memory`).

A `CostModel` owns the tables one model on one cluster fills (unit classes, compute times,
unit costs per strategy, core-sharing factors); `estimate` builds a fresh one, the planner keeps
one for its whole search.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cost_model.activation_offload import offloaded_mask
from cost_model.degrees import RECOMPUTE_MODES
from cost_model.errors import InputError
from cost_model.frameworks import DEFAULT_FRAMEWORK, FrameworkError, framework_profile
from cost_model.hardware import Cluster
from cost_model.headroom import check_memory_headroom, plan_memory_headroom, usable_capacity_bytes
from cost_model.memory import RECOMPUTABLE_KINDS
from cost_model.partial_recompute import unit_modes
from cost_model.parts.compute import ComputeTimes, LossCost, compute_times, loss_cost, recompute_s
from cost_model.parts.context_parallel import local_unit
from cost_model.parts.core_sharing import (
    SharingFactors,
    loop_overhead_s,
    oversubscription_factors,
    sharing_key,
    stretched_boundary_s,
)
from cost_model.parts.data_parallel import (
    DDP_BUCKET_CAP_BYTES,
    DDP_FIRST_BUCKET_BYTES,
    grad_reduce_bytes,
    runs_ddp,
)
from cost_model.parts.deepspeed_pipeline import deepspeed_pipe_optimizer, deepspeed_pipe_step_s
from cost_model.parts.expert_parallel import ExpertCost, expert_cost
from cost_model.parts.offload import activation_host_link_bytes_per_s, offloaded_unit_cost
from cost_model.parts.optimizer import ADAM_TRAFFIC_BYTES_PER_PARAM
from cost_model.parts.pipeline import Boundary, boundary, tied_pair_placement
from cost_model.precision import compute_dtype
from cost_model.rank_memory import (
    HeldActivations,
    boundary_send_bytes,
    memory_constants,
    peak_activations,
    rank_memory,
)
from cost_model.results import (
    Estimate,
    MemoryBreakdown,
    MemoryCapacityError,
    MemoryConstants,
    RankEstimate,
    StageEstimate,
)
from cost_model.schedule_memory import held_microbatches
from cost_model.schedules import ScheduleName, ScheduleSpec, Simulation, StageTimes, simulate
from cost_model.stage_terms import rank_tail_s, stage_times
from cost_model.strategy import GroupPlacement, PlanLike, StageLike, Strategy
from cost_model.uncertainty import plan_features, with_ranges
from cost_model.unit_composition import compose_unit_costs, unit_classes
from cost_model.unit_cost import UnitCost
from cost_model.workload import ModelProfile, UnitProfile

# Defined here, and the parts and records it composes (importable from here as before the split)
__all__ = [
    "ADAM_TRAFFIC_BYTES_PER_PARAM",
    "DDP_BUCKET_CAP_BYTES",
    "DDP_FIRST_BUCKET_BYTES",
    "Boundary",
    "CostModel",
    "Estimate",
    "HeldActivations",
    "LossCost",
    "MemoryBreakdown",
    "MemoryCapacityError",
    "MemoryConstants",
    "RankEstimate",
    "StageEstimate",
    "UnitCost",
    "boundary_costs",
    "boundary_send_bytes",
    "estimate",
    "grad_reduce_bytes",
    "loss_cost",
    "memory_constants",
    "oversubscription_factors",
    "peak_activations",
    "rank_memory",
    "rank_tail_s",
    "runs_ddp",
    "stage_times",
    "step_overhead_s",
    "tied_pair_placement",
    "unit_classes",
    "unit_compute_s",
    "unit_costs",
]


class CostModel:
    """The cost model of one model (``profile``) on one cluster, and the tables it fills.

    Every table is a function of the pair and of the strategy fields its key names, so a
    `CostModel` answers as `estimate` would, whatever it was asked before. The planner keeps one
    for its search (thousands of strategies share compute times and unit costs); `estimate`
    builds a fresh one per call.
    """

    def __init__(
        self,
        profile: ModelProfile,
        cluster: Cluster,
        framework: str = DEFAULT_FRAMEWORK,
        *,
        memory_headroom: float | None = None,
    ) -> None:
        self.profile = profile
        # the share of device memory plans keep free (`cost_model.headroom`); None: each plan's
        # own (its recorded ``memory_headroom``, else the default)
        self.memory_headroom = (
            None if memory_headroom is None else check_memory_headroom(memory_headroom)
        )
        self.stack = framework_profile(framework)
        self.framework = self.stack.name  # the spec in its normal form
        # the cluster as the framework's stack runs on it (`cost_model.frameworks`)
        self.cluster = self.stack.cluster_for(profile, cluster)
        # for each unit, the first unit with the same content (its own if unique)
        self.classes = unit_classes(profile)
        # (unit, tp, sequence parallel, micro-batch, dtype, cp, [fp8 fields], compile) -> the
        # unit's compute
        self._compute: dict[tuple[object, ...], ComputeTimes] = {}
        # (unit, cp) -> the unit as one context-parallel rank runs it
        self._local: dict[tuple[int, int], UnitProfile] = {}
        # (unit, what expert parallelism reads of the strategy, mode, ep placements) -> cost
        self._experts: dict[tuple[object, ...], ExpertCost] = {}
        # (strategy up to what unit costs read, recompute mode) -> every unit's costs
        self._costs: dict[tuple[Strategy, str], tuple[UnitCost, ...]] = {}
        # (p, v, m, dp x tp) -> core-sharing factors
        self._sharing: dict[tuple[int, int, int, int], SharingFactors] = {}

    # ------------------------------------------------------------------------- tables

    def shared_expert_whole(self, strategy: Strategy) -> bool:
        """Whether a MoE layer's shared expert runs whole on each TP rank's own tokens (with
        sequence parallelism, as autoplan's runtime runs it) rather than tensor-parallel (the
        stack's `FrameworkProfile.moe_shared_expert`, e.g. Megatron-LM's)."""
        return (
            strategy.sequence_parallel
            and strategy.tp_degree > 1
            and self.stack.moe_shared_expert != "tensor-parallel"
        )

    def local_unit(self, unit_idx: int, cp_degree: int) -> UnitProfile:
        """Unit ``unit_idx`` on one context-parallel rank (`parts.context_parallel.local_unit`:
        the unit itself when cp = 1)."""
        key = (unit_idx, cp_degree)
        found = self._local.get(key)
        if found is None:
            found = local_unit(self.profile.units[unit_idx], cp_degree)
            self._local[key] = found
        return found

    def expert_cost(
        self,
        strategy: Strategy,
        unit_idx: int,
        recompute: str,
        ep_groups: tuple[GroupPlacement, ...],
    ) -> ExpertCost:
        """The routed experts of MoE unit ``unit_idx`` on one device
        (`cost_model.parts.expert_parallel.expert_cost`)."""
        key = (
            unit_idx,
            strategy.tp_degree,
            strategy.sequence_parallel,
            strategy.micro_batch_size,
            strategy.dtype,
            strategy.cp_degree,
            strategy.ep_degree,
            strategy.etp_degree,
            recompute,
            ep_groups,
        )
        found = self._experts.get(key)
        if found is None:
            unit = self.local_unit(unit_idx, strategy.cp_degree)
            assert unit.moe is not None, unit.name
            found = expert_cost(
                unit.moe,
                strategy,
                self.cluster,
                ep_groups,
                recompute,
                self.profile.traced_dtype_bytes,
            )
            self._experts[key] = found
        return found

    def compute_times(self, strategy: Strategy, unit_idx: int) -> ComputeTimes:
        """The compute of unit ``unit_idx`` (`cost_model.parts.compute.compute_times`) on one
        context-parallel rank, without the routed experts (`parts.expert_parallel`)."""
        key = (
            unit_idx,
            strategy.tp_degree,
            strategy.sequence_parallel,
            strategy.micro_batch_size,
            strategy.dtype,
            strategy.cp_degree,
            # an fp8 recipe's linears and weight casts (`cost_model.parts.fp8`)
            *((strategy.fp8_exclude, strategy.fp8_all_gather) if strategy.fp8 else ()),
            # torch.compile's fused ops (`cost_model.parts.fusion`)
            strategy.compile,
        )
        found = self._compute.get(key)
        if found is None:
            unit = self.local_unit(unit_idx, strategy.cp_degree)
            found = compute_times(unit, self.cluster, strategy, self.profile.traced_dtype_bytes)
            self._compute[key] = found
        return found

    def sharing(self, strategy: Strategy) -> SharingFactors:
        """Core-sharing factors of ``strategy`` (`cost_model.parts.core_sharing`)."""
        key = sharing_key(strategy)
        found = self._sharing.get(key)
        if found is None:
            found = oversubscription_factors(strategy, self.cluster)
            self._sharing[key] = found
        return found

    def step_overhead_s(self, strategy: Strategy) -> float:
        """The training loop's fixed time per step, stretched by core sharing."""
        return loop_overhead_s(self.cluster, self.sharing(strategy))

    def dp_overlap(self, strategy: Strategy) -> float:
        """The share of the last backward that the gradient sync may hide behind: the
        cluster's `dp_overlap_fraction`, or 0 where the stack syncs after the backward (at
        this ZeRO stage, or under its pipeline engine: `FrameworkProfile.overlaps_dp_sync`)."""
        if not self.stack.overlaps_dp_sync(strategy):
            return 0.0
        return self.cluster.calibration.dp_overlap_fraction

    def unit_costs(self, strategy: Strategy, recompute: str) -> tuple[UnitCost, ...]:
        """Every unit's costs on one device, with ``recompute`` applied to the units it covers;
        units of one class (`unit_classes`) share one object unless data-parallel grouping
        gives each its own share."""
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"unknown recompute mode {recompute!r}; use none, selective or full")
        key = (self._costs_key(strategy), recompute)
        found = self._costs.get(key)
        if found is None:
            if strategy.activation_offload:
                found = self._twin_costs(strategy, recompute)
            else:
                found = compose_unit_costs(self, strategy, recompute)
            self._costs[key] = found
        return found

    def offloaded_costs(self, strategy: Strategy) -> tuple[UnitCost, ...]:
        """Every unit's costs under recompute 'none' with each block's saved activations on
        the host (`parts.offload.offloaded_unit_cost`, as the stack moves them); the other
        units as they are. A stage's offloaded blocks take theirs from here."""
        plain = dataclasses.replace(strategy, activation_offload=False)
        key = (self._costs_key(plain), "offloaded")
        found = self._costs.get(key)
        if found is None:
            overlap = self.stack.activation_offload or "blocking"
            link = activation_host_link_bytes_per_s(self.cluster, 1)
            found = tuple(
                offloaded_unit_cost(cost, link, overlap)
                if cost.kind in RECOMPUTABLE_KINDS
                else cost
                for cost in self.unit_costs(plain, "none")
            )
            self._costs[key] = found
        return found

    def _twin_costs(self, strategy: Strategy, recompute: str) -> tuple[UnitCost, ...]:
        """The search's activation-offload twin (`Strategy.activation_offload`): under 'none',
        every block but the model's last offloaded (its backward starts as its forward ends:
        nothing hides its copies, and Megatron-Core refuses it); other modes as they are."""
        plain = dataclasses.replace(strategy, activation_offload=False)
        costs = self.unit_costs(plain, recompute)
        if recompute != "none":
            return costs
        offloaded = self.offloaded_costs(plain)
        blocks = [u for u, cost in enumerate(costs) if cost.kind in RECOMPUTABLE_KINDS]
        kept = blocks[-1] if blocks else -1
        return tuple(
            offloaded[u] if cost.kind in RECOMPUTABLE_KINDS and u != kept else cost
            for u, cost in enumerate(costs)
        )

    def _costs_key(self, strategy: Strategy) -> Strategy:
        # A unit's costs depend on the schedule only through its placement (which ranks share
        # the tied embedding) and, on shared-core CPUs, through the waves of its pipeline.
        if strategy.schedule_placement != "loop":
            return strategy
        # (GPipe decides the data-parallel wrapper on one pipeline rank: kept apart)
        v = strategy.virtual_stages if self.cluster.shared_cores_per_node is not None else 1
        schedule: ScheduleName = "gpipe" if strategy.schedule == "gpipe" else "1f1b"
        return dataclasses.replace(strategy, schedule=schedule, virtual_stages=v)

    def unit_compute_s(self, strategy: Strategy, recompute: str) -> tuple[float, ...]:
        """Per-unit compute time of one micro-batch (forward, backward and recompute, without
        any communication, and without the routed experts): a lower bound on `UnitCost.time_s`
        that depends only on the strategy's TP degree, sequence parallelism, micro-batch, dtype
        (with an fp8 recipe's fields) and cp degree."""
        cal = self.cluster.calibration
        out: list[float] = []
        for index, unit in enumerate(self.profile.units):
            if self.classes[index] != index:
                out.append(out[self.classes[index]])
                continue
            mode = recompute if unit.kind in RECOMPUTABLE_KINDS else "none"
            times = self.compute_times(strategy, index)
            local = self.local_unit(index, strategy.cp_degree)
            out.append(times.forward_s + times.backward_s + recompute_s(local, mode, cal, times))
        return tuple(out)

    def stage_unit_modes(self, stage: StageLike) -> tuple[str, ...]:
        """The recompute mode each unit of ``stage`` is priced under (`unit_modes`: its
        ``recompute_units`` first blocks under its mode, the rest under none)."""
        kinds = [self.profile.units[u].kind for u in s_range(stage)]
        return unit_modes(stage.recompute, kinds, stage_recompute_units(stage))

    def stage_offloaded(self, stage: StageLike, modes: tuple[str, ...]) -> tuple[bool, ...]:
        """Per unit of ``stage`` (priced under ``modes``): whether its saved activations are
        on the host (`offloaded_mask` of the stage's ``activation_offload``)."""
        kinds = [self.profile.units[u].kind for u in s_range(stage)]
        return offloaded_mask(kinds, modes, stage_activation_offload(stage))

    def boundary(self, last_unit: UnitCost, strategy: Strategy, stage_idx: int) -> Boundary:
        """The boundary after stage ``stage_idx`` (see `boundary_costs`)."""
        return _stretched_boundary(
            boundary(last_unit.output_bytes, self.cluster, strategy, stage_idx),
            self.sharing(strategy),
        )

    def usable_capacity_bytes(self, plan: PlanLike | None = None) -> float:
        """The largest predicted peak a device may hold (`usable_capacity_bytes`) with this
        model's headroom, or ``plan``'s when the model has none."""
        headroom = self.memory_headroom
        if headroom is None:
            headroom = plan_memory_headroom(plan)
        return usable_capacity_bytes(float(self.cluster.device.memory_bytes), headroom)

    # ------------------------------------------------------------------------- estimate

    def estimate(self, plan: PlanLike) -> Estimate:
        """Step time, throughput, MFU and per-device memory of ``plan`` (see `estimate`)."""
        est = self._estimate(plan)
        strategy = Strategy.of(plan)
        # DeepSpeed's pipeline engine with the optimizer wrapper it picks for the precision
        # and ZeRO stage (cost_model.parts.deepspeed_pipeline); other plans part by part.
        optimizer = deepspeed_pipe_optimizer(strategy)
        if self.stack.engine == "deepspeed-pipe" and optimizer is not None:
            costs = self.unit_costs(strategy, plan.stages[0].recompute)
            step = deepspeed_pipe_step_s(
                optimizer, self.profile, self.cluster, strategy, est, costs
            )
            est = est.with_step_time(step)
        return with_ranges(est, plan_features(plan, self.framework))

    def _estimate(self, plan: PlanLike) -> Estimate:
        strategy, stages = self._checked_plan(plan)
        timing = self._timing(strategy, stages)
        first = next(iter(timing.by_mode.values()))
        constants = memory_constants(first, self.cluster, strategy)
        send_bytes = boundary_send_bytes(first, self.cluster.calibration)
        usable = self.usable_capacity_bytes(plan)
        ranks, stage_estimates = self._rank_estimates(
            strategy, stages, timing, constants, send_bytes, usable
        )
        return self._step_estimate(plan, strategy, timing, ranks, stage_estimates, usable)

    def _checked_plan(self, plan: PlanLike) -> tuple[Strategy, tuple[StageLike, ...]]:
        """The plan's outer choices and stages, once its stack runs it and its stages cover
        the model."""
        profile = self.profile
        if plan.framework != self.framework:
            raise InputError(
                f"plan is for framework {plan.framework!r}; this cost model prices "
                f"{self.framework!r}"
            )
        if (why := self.stack.plan_refusal(plan, profile)) is not None:
            raise FrameworkError(
                f"{self.framework} cannot run this plan: {why}, or price it for autoplan's "
                "runtime (framework autoplan)"
            )
        strategy = Strategy.of(plan)
        stages = tuple(plan.stages)
        if len(stages) != strategy.num_stages:
            raise InputError(
                f"plan has {len(stages)} stages; pp_degree x virtual_stages = {strategy.num_stages}"
            )
        if stages[-1].last_unit != profile.num_units - 1:
            raise InputError(
                f"plan stages cover units 0..{stages[-1].last_unit} but model {profile.name!r} has "
                f"{profile.num_units} units"
            )
        return strategy, stages

    def _timing(self, strategy: Strategy, stages: tuple[StageLike, ...]) -> _Timing:
        """The stages' units and times, the ranks' tails and the schedule's simulation."""
        spec = strategy.schedule_spec
        p = strategy.pp_degree
        # every unit's costs per (recompute mode, compile) the stages use: a stage that
        # overrides the plan's compile is priced with its own (`stage_compiled`)
        by_mode: dict[tuple[str, bool], tuple[UnitCost, ...]] = {}
        # each unit under its own mode: a partial stage's first ``recompute_units`` blocks
        # under the stage's mode, its others under none (`cost_model.partial_recompute`)
        stage_modes = [self.stage_unit_modes(stage) for stage in stages]
        for stage, modes in zip(stages, stage_modes, strict=True):
            compiled = stage_compiled(stage, strategy)
            for mode in modes:
                if (mode, compiled) not in by_mode:
                    own = dataclasses.replace(strategy, compile=compiled)
                    by_mode[(mode, compiled)] = self.unit_costs(own, mode)
        # a stage's first ``activation_offload`` blocks under 'none' with their saved
        # activations on the host (`cost_model.parts.offload.offloaded_unit_cost`)
        offloaded: dict[bool, tuple[UnitCost, ...]] = {}
        stage_units: list[tuple[UnitCost, ...]] = []
        for s, modes in zip(stages, stage_modes, strict=True):
            compiled = stage_compiled(s, strategy)
            units: list[UnitCost] = []
            for u, mode, host in zip(
                s_range(s), modes, self.stage_offloaded(s, modes), strict=True
            ):
                if host and compiled not in offloaded:
                    own = dataclasses.replace(strategy, compile=compiled)
                    offloaded[compiled] = self.offloaded_costs(own)
                units.append(offloaded[compiled][u] if host else by_mode[(mode, compiled)][u])
            if any(self.stage_offloaded(s, modes)):
                units = _in_flight_beside_kept(units, by_mode[("none", compiled)], s)
            stage_units.append(tuple(units))
        boundaries = [
            self.boundary(units[-1], strategy, idx) for idx, units in enumerate(stage_units)
        ]
        times = stage_times(stage_units, boundaries, spec)
        rank_stages = [spec.rank_stages(r) for r in range(p)]
        rank_units = [tuple(u for s in rank_stages[r] for u in stage_units[s]) for r in range(p)]
        fixed = self.step_overhead_s(strategy)
        overlap = self.dp_overlap(strategy)
        rank_tail = [rank_tail_s(rank_units[r], overlap) + fixed for r in range(p)]
        return _Timing(
            spec=spec,
            by_mode=by_mode,
            stage_units=stage_units,
            boundaries=boundaries,
            times=times,
            rank_stages=rank_stages,
            rank_units=rank_units,
            rank_tail=rank_tail,
            sim=simulate(spec, times, rank_tail),
        )

    def _rank_estimates(
        self,
        strategy: Strategy,
        stages: tuple[StageLike, ...],
        timing: _Timing,
        constants: MemoryConstants,
        send_bytes: float,
        usable: float,
    ) -> tuple[list[RankEstimate], tuple[StageEstimate, ...]]:
        """Each pipeline rank's time and memory, and each stage's share."""
        m, sim, stage_units = strategy.num_micro_batches, timing.sim, timing.stage_units
        held = held_microbatches(timing.spec)
        ranks = []
        stage_estimates: list[StageEstimate | None] = [None] * len(stages)
        for r in range(strategy.pp_degree):
            peak = peak_activations(stage_units, held[r], send_bytes)
            loss_held = sum(
                count * sum(u.loss_bytes for u in stage_units[s])
                for s, count in zip(held[r].stages, peak.microbatches, strict=True)
            )
            memory = rank_memory(timing.rank_units[r], peak.bytes, constants, loss_held)
            busy = sim.rank_busy_s[r]
            idle = sim.rank_end_s[r] - busy
            ranks.append(
                RankEstimate(
                    pp_rank=r,
                    stages=timing.rank_stages[r],
                    time_per_microbatch_s=busy / m,
                    busy_s=busy,
                    bubble_s=idle,
                    tail_s=timing.rank_tail[r],
                    memory=memory,
                    fits=memory.total_bytes <= usable,
                )
            )
            for k, s in enumerate(timing.rank_stages[r]):
                stage_estimates[s] = _stage_estimate(
                    stages[s],
                    s,
                    r,
                    timing,
                    m,
                    inflight=peak.microbatches[k],
                    bubble_s=idle / len(timing.rank_stages[r]),
                )
        return ranks, tuple(s for s in stage_estimates if s is not None)

    def _step_estimate(
        self,
        plan: PlanLike,
        strategy: Strategy,
        timing: _Timing,
        ranks: list[RankEstimate],
        stage_estimates: tuple[StageEstimate, ...],
        usable: float,
    ) -> Estimate:
        """The step's record: time, throughput, MFU and the peak memory of its ranks."""
        profile, cluster, sim = self.profile, self.cluster, timing.sim
        t_pipe = sim.pipeline_time_s
        step = sim.step_time_s
        tokens = strategy.global_batch_size * profile.seq_len
        # Model FLOPs: 3x the forward (forward + backward, no recompute), Chowdhery et al. 2022
        # (PaLM), appendix B; Korthikanti et al. 2022, section 6.3 (MFU).
        model_flops = 3.0 * profile.forward_flops_per_sample * strategy.global_batch_size
        num_devices = strategy.num_devices
        flops_per_device_per_s = model_flops / step / num_devices
        peak_memory = max(r.memory.total_bytes for r in ranks)
        busiest = max(sim.rank_busy_s)
        return Estimate(
            cluster=cluster.name,
            num_devices=num_devices,
            global_batch_size=strategy.global_batch_size,
            seq_len=profile.seq_len,
            step_time_s=step,
            pipeline_time_s=t_pipe,
            tail_s=max(timing.rank_tail),
            bubble_fraction=(t_pipe - busiest) / t_pipe if t_pipe > 0 else 0.0,
            tokens_per_s=tokens / step,
            model_flops_per_step=model_flops,
            model_tflops_per_device=flops_per_device_per_s / 1e12,
            # against the 16-bit peak under an fp8 recipe too (torchtitan's and NeMo's MFU of
            # fp8 runs): the figure compares with bf16 runs, and only the linears run fp8
            mfu=flops_per_device_per_s
            / cluster.device.peak_flops_for(compute_dtype(strategy.dtype)),
            peak_memory_bytes=peak_memory,
            memory_capacity_bytes=float(cluster.device.memory_bytes),
            fits=peak_memory <= usable,
            memory_headroom=plan_memory_headroom(plan, self.memory_headroom),
            memory_usable_bytes=usable,
            stages=stage_estimates,
            ranks=tuple(ranks),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class _Timing:
    """A plan's units per stage and rank, their times and the schedule's simulation."""

    spec: ScheduleSpec
    # every unit's costs per (recompute mode, compile) used
    by_mode: dict[tuple[str, bool], tuple[UnitCost, ...]]
    stage_units: list[tuple[UnitCost, ...]]
    boundaries: list[Boundary]
    times: list[StageTimes]
    rank_stages: list[tuple[int, ...]]
    rank_units: list[tuple[UnitCost, ...]]
    rank_tail: list[float]  # each rank's tail plus the loop's fixed overhead
    sim: Simulation


def _stage_estimate(
    stage: StageLike,
    s: int,
    r: int,
    timing: _Timing,
    m: int,
    *,
    inflight: int,
    bubble_s: float,
) -> StageEstimate:
    """Stage ``s`` (run by pipeline rank ``r``, with ``inflight`` micro-batches held at the
    rank's peak) over ``m`` micro-batches."""
    units = timing.stage_units[s]
    times, boundaries = timing.times, timing.boundaries
    previous = boundaries[s - 1] if s > 0 else Boundary(0.0, 0.0)
    return StageEstimate(
        stage_idx=s,
        pp_rank=r,
        first_unit=stage.first_unit,
        last_unit=stage.last_unit,
        recompute=stage.recompute,
        forward_s=times[s].forward_s,
        backward_s=times[s].backward_s,
        weight_s=times[s].weight_s,
        transfer_s=times[s].transfer_s,
        compute_s=m * sum(u.compute_s for u in units),
        recompute_s=m * sum(u.recompute_s for u in units),
        tp_comm_s=m * sum(u.tp_comm_s for u in units),
        # busy time of its pipeline messages; their link time is not the rank's (it
        # delays the peer, and shows as that peer's idle time where it matters)
        pp_comm_s=m * (boundaries[s].message_s + previous.message_s),
        dp_comm_s=sum(
            u.dp_sync_s + u.post_sync_s + m * (u.zero3_forward_s + u.zero3_backward_s)
            for u in units
        ),
        bubble_s=bubble_s,
        param_bytes=sum(u.param_bytes for u in units),
        grad_bytes=sum(u.grad_bytes for u in units),
        optimizer_bytes=sum(u.optimizer_bytes for u in units),
        activation_bytes=inflight * sum(u.activation_bytes for u in units),
        inflight_microbatches=float(inflight),
        cp_comm_s=m * sum(u.cp_forward_s + u.cp_backward_s for u in units),
        ep_comm_s=m * sum(u.ep_forward_s + u.ep_backward_s for u in units),
        host_s=m * sum(u.host_s for u in units),
        offload_s=m * sum(u.host_link_s for u in units),
    )


def s_range(stage: StageLike) -> range:
    """The units of ``stage``."""
    return range(stage.first_unit, stage.last_unit + 1)


def stage_recompute_units(stage: StageLike) -> int | None:
    """How many of ``stage``'s blocks its recompute mode covers (`autoplan.Plan`'s
    ``stages[i].recompute_units``; None, or a stage without the field: all)."""
    count = getattr(stage, "recompute_units", None)
    return None if count is None else int(count)


def _in_flight_beside_kept(
    units: list[UnitCost], plain: tuple[UnitCost, ...], stage: StageLike
) -> list[UnitCost]:
    """A stage's units with each offloaded block's in-flight bytes (its working set beyond the
    plain block's, `offloaded_unit_cost`) less the stage's kept activations of one micro-batch
    (those of its blocks and other units left on the device), at most all of them.

    The offloaded blocks are the stage's first: while one is copied back for its backward (or
    out, beside the next block's forward), the micro-batch's later blocks have freed their
    activations (or not made them yet), so the rank holds ``(h - 1) kept + max(kept, in
    flight)`` then, against ``h kept`` at its backward's start (h micro-batches held). The rank's
    peak, ``h kept + max working``, is that maximum with the in-flight bytes beyond ``kept``. The
    search's candidate keeps them whole (a bound: `autoplan.planner.candidates`)."""
    kept = sum(u.activation_bytes for u in units)
    out = []
    for index, unit in zip(s_range(stage), units, strict=True):
        extra = unit.working_bytes - plain[index].working_bytes
        if unit.host_activation_bytes > 0 and extra > 0:
            unit = dataclasses.replace(unit, working_bytes=unit.working_bytes - min(extra, kept))
        out.append(unit)
    return out


def stage_activation_offload(stage: StageLike) -> int:
    """How many of ``stage``'s blocks keep their saved activations on the host
    (`autoplan.Plan`'s ``stages[i].activation_offload``; 0, or a stage without the field:
    none)."""
    return int(getattr(stage, "activation_offload", 0) or 0)


def stage_compiled(stage: StageLike, strategy: Strategy) -> bool:
    """Whether ``stage`` runs torch.compile: its own ``compile`` (`autoplan.Plan`'s
    ``stages[i].compile``), else the plan's (``strategy.compile``)."""
    own = getattr(stage, "compile", None)
    return strategy.compile if own is None else bool(own)


def _stretched_boundary(raw: Boundary, factors: SharingFactors) -> Boundary:
    return Boundary(
        transfer_s=stretched_boundary_s(raw.transfer_s, factors),
        message_s=stretched_boundary_s(raw.message_s, factors),
    )


# ------------------------------------------------------------------------------- functions


def estimate(
    profile: ModelProfile,
    cluster: Cluster,
    plan: PlanLike,
    *,
    memory_headroom: float | None = None,
) -> Estimate:
    """Step time, throughput, MFU and per-device memory of ``plan`` (see the module docstring).

    The step time is the simulation of the schedule's own orders (`cost_model.schedules`) with
    the units' costs, so the planner, ``explain`` and the timeline all see one number.
    ``fits`` keeps ``memory_headroom`` of each device free beyond the upper end of the peak's
    range (None: the plan's recorded headroom, else `DEFAULT_MEMORY_HEADROOM`).
    """
    return CostModel(profile, cluster, plan.framework, memory_headroom=memory_headroom).estimate(
        plan
    )


def unit_costs(
    profile: ModelProfile, cluster: Cluster, strategy: Strategy, recompute: str
) -> tuple[UnitCost, ...]:
    """Every unit's costs on one device, with ``recompute`` applied to the units it covers
    (`CostModel.unit_costs` of a fresh model)."""
    return CostModel(profile, cluster).unit_costs(strategy, recompute)


def unit_compute_s(
    profile: ModelProfile, cluster: Cluster, strategy: Strategy, recompute: str
) -> tuple[float, ...]:
    """Per-unit compute time of one micro-batch (`CostModel.unit_compute_s`)."""
    return CostModel(profile, cluster).unit_compute_s(strategy, recompute)


def step_overhead_s(strategy: Strategy, cluster: Cluster) -> float:
    """The training loop's fixed time per step (``calibration.step_overhead_s``), which every
    worker spends at once after its tail (so CPU workers sharing cores stretch it too)."""
    return loop_overhead_s(cluster, oversubscription_factors(strategy, cluster))


def boundary_costs(
    last_unit: UnitCost, cluster: Cluster, strategy: Strategy, stage_idx: int
) -> Boundary:
    """The boundary after stage ``stage_idx`` (whose last unit is ``last_unit``): the transfer of
    its output to the next stage's pipeline rank, and the schedule's host overhead per message
    (`cost_model.parts.pipeline.boundary`), stretched like the pipeline when CPU workers share
    cores."""
    raw = boundary(last_unit.output_bytes, cluster, strategy, stage_idx)
    return _stretched_boundary(raw, oversubscription_factors(strategy, cluster))
