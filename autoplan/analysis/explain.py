"""`autoplan.explain`: why a plan is as fast as it is, and what the alternatives would cost.

(The module is `autoplan.analysis.explain`: a submodule named ``explain`` would replace the public
function on the package once imported; see docs/design.md.)

Expects a `Plan`, the model it was made for (an ``nn.Module``, ``ModelGraph`` or
``ModelProfile``) and a `Cluster` with the plan's device count. Produces an `Explanation`:

- the cost model's per-stage breakdown (compute, TP/PP/DP communication, bubble, memory) and
  each pipeline rank's memory against the device capacity;
- the critical path: the step is the simulated schedule (``cost_model.schedules``); it splits
  into the busiest pipeline rank's busy time (compute, TP, PP and exposed ZeRO-3
  communication), that rank's idle time until the pipeline's last action (the bubble) and what
  the tails add after it (exposed DP gradient sync, post-sync gathers, the optimizer step);
- "why not" lines: the search's top alternatives for the same model, cluster, batch and dtype,
  and the nearest hand-made plans: pure data parallelism (tp = pp = 1, the planner picks the
  ZeRO level, micro-batch and recompute that fit), pure tensor parallelism within a node
  (tp = devices per node, pp = 1, DP across nodes) and the Megatron-style choice (tp = 8 or
  the node size, the smallest pipeline degree that fits, 1F1B or interleaved, ZeRO 0 or 1;
  Narayanan et al. 2021, section 3, takeaway #1: tensor parallelism up to the GPUs of a server,
  then pipeline parallelism across servers; takeaway #2: the smallest model-parallel size that
  fits in memory, data parallelism for the rest).
  Each says what it would cost: step time and how much slower (or faster), or why it is
  impossible ("does not fit: needs X GiB per device of Y").

The planner (OR-tools) is imported on first use, so importing this module stays fast.

Guarantees: the numbers are the cost model's (`cost_model.estimate`), the alternatives the
planner's (`search_plans`, with constraints for the hand-made families); an invalid plan raises
`PlanError`; `plan_model_spec` and `plan_cluster` resolve the model and cluster a plan file
records, or raise `ExplainInputError` saying what to pass instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from autoplan import api
from autoplan._format import fmt_time
from autoplan.analysis.coverage import Coverage, coverage
from autoplan.analysis.whatif import cluster_type, infeasible_reason
from autoplan.contract.errors import InputError, ModelSpecError, NoFeasiblePlanError
from autoplan.contract.plan import MESH_AXES, Plan
from autoplan.planner.search import SearchProgress, search_plans
from autoplan.planner.space import ConstraintError
from cost_model.errors import ClusterError
from cost_model.estimate import Estimate
from cost_model.frameworks import DEFAULT_FRAMEWORK, framework_profile
from cost_model.hardware import Cluster
from cost_model.messages import shown
from cost_model.workload import ModelProfile

__all__ = [
    "Alternative",
    "CriticalPath",
    "ExplainInputError",
    "Explanation",
    "RankMemory",
    "critical_path",
    "describe_plan",
    "explain",
    "plan_cluster",
    "plan_model_spec",
]

# Megatron-LM's tensor-parallel degree for large models: one DGX node (Narayanan et al. 2021,
# section 5.1: "For large enough models, we use a tensor-model-parallel size of 8").
MEGATRON_TP_DEGREE = 8
# Megatron-LM replicates the weights over data parallelism and at most shards the optimizer
# state (its "distributed optimizer", ZeRO-1); it never shards weights or gradients.
MEGATRON_ZERO_LEVELS = (0, 1)


class ExplainInputError(InputError):
    """The model or cluster of a plan file cannot be resolved (the message says what to pass)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CriticalPath:
    """What bounds the step: ``step = busy + bubble + tail`` of the bottleneck rank."""

    bottleneck_rank: int  # the pipeline rank with the longest time per micro-batch
    step_time_s: float
    busy_s: float  # m x T_max: the bottleneck's work in the pipeline
    compute_s: float  # of which compute (forward, backward, recompute)
    recompute_s: float  # of which re-run forward
    tp_comm_s: float  # of which tensor-parallel collectives
    pp_comm_s: float  # of which pipeline sends
    zero3_exposed_s: float  # of which ZeRO-3 gathers not hidden behind compute
    bubble_s: float  # pipeline time - busy: the bottleneck's idle time
    tail_s: float  # what the ranks' tails add after the pipeline ends (DP sync, optimizer)
    tail_rank: int  # the rank with that tail
    dominant: str  # the largest share: compute, communication, bubble, tail or the host
    cp_comm_s: float = 0.0  # of busy: context parallel's ring exchanges not hidden
    ep_comm_s: float = 0.0  # of busy: expert parallel's all-to-alls
    host_s: float = 0.0  # of busy: the host's wrappers and the device's waits for the host
    offload_s: float = 0.0  # of busy: activation offload's host-link copies not hidden

    @property
    def communication_s(self) -> float:
        return (
            self.tp_comm_s
            + self.pp_comm_s
            + self.zero3_exposed_s
            + self.cp_comm_s
            + self.ep_comm_s
            + self.offload_s
        )

    def summary(self) -> str:
        step = self.step_time_s

        def share(seconds: float) -> str:
            return f"{fmt_time(seconds)} ({seconds / step:.0%})"

        compute = f"compute {fmt_time(self.compute_s)}"
        if self.recompute_s > 0:
            compute += f" (of which recompute {fmt_time(self.recompute_s)})"
        parts = [compute] + [
            f"{name} {fmt_time(seconds)}"
            for name, seconds in (
                ("TP comm", self.tp_comm_s),
                ("PP comm", self.pp_comm_s),
                ("CP ring", self.cp_comm_s),
                ("EP all-to-all", self.ep_comm_s),
                ("exposed ZeRO-3 gathers", self.zero3_exposed_s),
                ("activation offload copies", self.offload_s),
                ("host", self.host_s),
            )
            if seconds > 0
        ]
        return (
            f"pipeline rank {self.bottleneck_rank} bounds the step ({fmt_time(step)}): busy "
            f"{share(self.busy_s)} = {' + '.join(parts)}; bubble {share(self.bubble_s)}; tail "
            f"{share(self.tail_s)} on rank {self.tail_rank} (exposed DP sync + optimizer). "
            f"Dominated by {self.dominant}."
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class RankMemory:
    """One pipeline rank's peak bytes per device against the capacity."""

    pp_rank: int
    total_bytes: float
    capacity_bytes: float
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes: float  # in flight at the peak
    working_bytes: float  # one backward's working set, p2p and pipeline, DP buffers
    loss_bytes: float  # the loss's log-probabilities, in flight and as working set
    reserve_bytes: float  # framework reserve and allocator margin
    fits: bool

    @property
    def fraction(self) -> float:
        return self.total_bytes / self.capacity_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class Alternative:
    """One plan the explained plan is compared with."""

    name: str  # "search rank 2", "pure DP", "pure TP within a node", "Megatron-style t=8"
    description: str  # its layout, or the family's shape when there is no plan
    plan: Plan | None
    step_time_s: float | None
    relative: float | None  # step time / the explained plan's - 1 (> 0: slower)
    reason: str | None  # why there is no plan: impossible, or does not fit
    same_as_plan: bool = False
    plan_fits: bool = True  # whether the explained plan fits (the alternatives always do)

    @property
    def line(self) -> str:
        """The "why not" sentence."""
        head = f"why not {self.name} ({self.description})?"
        if self.same_as_plan:
            return f"{self.name} ({self.description}): this is the explained plan"
        if self.reason is not None or self.step_time_s is None or self.relative is None:
            return f"{head} {self.reason}"
        if abs(self.relative) < 5e-4:
            verdict = "as fast as this plan"
        elif self.relative > 0:
            slower = 1.0 + self.relative
            verdict = f"{slower:.2f}x slower" if slower >= 1.5 else f"{self.relative:.1%} slower"
        else:
            speedup = 1.0 / (1.0 + self.relative)  # this plan's step time / the alternative's
            faster = f"{speedup:.2f}x" if speedup >= 1.5 else f"{speedup - 1:.1%}"
            verdict = f"{faster} faster: the cost model prefers it"
        if not self.plan_fits:
            verdict += ", but it fits in memory and this plan does not"
        return f"{head} {fmt_time(self.step_time_s)} per step, {verdict}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Explanation:
    """A plan's estimate, critical path, memory and alternatives on one cluster."""

    plan: Plan
    model: str
    cluster: str
    num_devices: int
    estimate: Estimate
    critical_path: CriticalPath
    memory: tuple[RankMemory, ...]
    alternatives: tuple[Alternative, ...]
    notes: tuple[str, ...]
    # where the plan leaves the published runs the cost model was checked on
    coverage: Coverage | None = None

    def to_data(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "cluster": self.cluster,
            "num_devices": self.num_devices,
            "plan": self.plan.to_data(),
            "estimate": self.estimate.to_data(),
            "coverage": None if self.coverage is None else dataclasses.asdict(self.coverage),
            "critical_path": {
                **dataclasses.asdict(self.critical_path),
                "summary": self.critical_path.summary(),
            },
            "memory": [{**dataclasses.asdict(m), "fraction": m.fraction} for m in self.memory],
            "alternatives": [
                {
                    "name": a.name,
                    "description": a.description,
                    "step_time_s": a.step_time_s,
                    "relative": a.relative,
                    "reason": a.reason,
                    "same_as_plan": a.same_as_plan,
                    "plan_fits": a.plan_fits,
                    "line": a.line,
                    "plan": None if a.plan is None else a.plan.to_data(),
                }
                for a in self.alternatives
            ],
            "notes": list(self.notes),
        }


# ------------------------------------------------------------------------------ the explanation


def explain(
    plan: Plan,
    model_or_graph: Any,
    cluster: Cluster,
    *,
    top_k: int = 3,
    alternatives: bool = True,
    time_limit_s: float = 10.0,
    budget_s: float | None = 10.0,
    progress: Callable[[str], None] | None = None,
    framework: str | None = None,
    memory_headroom: float | None = None,
) -> Explanation:
    """Explain ``plan`` on ``cluster`` (module docstring); ``top_k`` search alternatives.

    ``alternatives=False`` skips the searches (breakdown and critical path only); each search
    visits candidates for at most ``budget_s`` seconds (None: until every one is proven), as
    `autoplan.search`. ``framework``: price the plan (and its alternatives) for that training
    stack instead of the one it records. ``memory_headroom``: check the plan's memory, and
    search its alternatives, with it (None: the plan's recorded one, else the default).
    """
    if framework is not None and framework != plan.framework:
        framework_profile(framework)  # an unknown name fails here, naming the known ones
        plan = dataclasses.replace(plan, framework=framework, estimate=None)
    profile = api.profile_of(model_or_graph)
    result = api.estimate(profile, cluster, plan, memory_headroom=memory_headroom)
    notes: list[str] = []
    if not result.fits:
        notes.append(f"this plan does not fit: {result.memory_report()}")
        notes.append(result.memory_problem())
    found: list[Alternative] = []
    if alternatives:
        limits = _Limits(time_limit_s, budget_s, result.memory_headroom)
        found += _search_alternatives(
            plan, profile, cluster, result, top_k, limits, notes, progress
        )
        found += _hand_made(plan, profile, cluster, result, limits, progress)
    return Explanation(
        plan=plan,
        model=profile.name,
        cluster=cluster.name,
        num_devices=cluster.num_devices,
        estimate=result,
        critical_path=critical_path(result),
        memory=tuple(
            RankMemory(
                pp_rank=r.pp_rank,
                total_bytes=r.memory.total_bytes,
                capacity_bytes=result.memory_capacity_bytes,
                param_bytes=r.memory.param_bytes,
                grad_bytes=r.memory.grad_bytes,
                optimizer_bytes=r.memory.optimizer_bytes,
                activation_bytes=r.memory.activation_bytes,
                working_bytes=r.memory.working_bytes,
                loss_bytes=r.memory.loss_bytes,
                reserve_bytes=r.memory.reserve_bytes,
                fits=r.fits,
            )
            for r in result.ranks
        ),
        alternatives=tuple(found),
        notes=tuple(notes),
        coverage=coverage(plan, profile, cluster, result),
    )


def critical_path(result: Estimate) -> CriticalPath:
    """The bottleneck rank and how the step splits into busy, bubble and tail time."""
    bottleneck = max(result.ranks, key=lambda r: (r.busy_s, -r.pp_rank))
    stages = [s for s in result.stages if s.pp_rank == bottleneck.pp_rank]
    compute = sum(s.compute_s for s in stages)
    tp = sum(s.tp_comm_s for s in stages)
    pp = sum(s.pp_comm_s for s in stages)
    cp = sum(s.cp_comm_s for s in stages)
    ep = sum(s.ep_comm_s for s in stages)
    host = sum(s.host_s for s in stages)
    offload = sum(s.offload_s for s in stages)
    # forward_s/backward_s = compute + TP + CP ring + EP all-to-all + exposed ZeRO-3 + host
    # + activation offload's copies (cost_model.estimate.unit_costs)
    zero3 = bottleneck.busy_s - compute - tp - pp - cp - ep - host - offload
    bubble = result.pipeline_time_s - bottleneck.busy_s
    # What the ranks' tails add after the pipeline's last action (each tail starts when its
    # own rank is done, so a rank that finishes early hides some of its tail).
    tail = result.step_time_s - result.pipeline_time_s
    # Differences of sums: round-off below a billionth of the step is no time at all.
    noise = 1e-9 * result.step_time_s
    zero3 = zero3 if zero3 > noise else 0.0
    bubble = bubble if bubble > noise else 0.0
    tail = tail if tail > noise else 0.0
    tail_rank = max(result.ranks, key=lambda r: (r.tail_s, -r.pp_rank))
    shares = {
        "compute": compute,
        "communication": tp + pp + cp + ep + zero3 + offload,
        "the pipeline bubble": bubble,
        "the tail after the flush": tail,
        "the host": host,
    }
    return CriticalPath(
        bottleneck_rank=bottleneck.pp_rank,
        step_time_s=result.step_time_s,
        busy_s=bottleneck.busy_s,
        compute_s=compute,
        recompute_s=sum(s.recompute_s for s in stages),
        tp_comm_s=tp,
        pp_comm_s=pp,
        zero3_exposed_s=zero3,
        cp_comm_s=cp,
        ep_comm_s=ep,
        host_s=host,
        offload_s=offload,
        bubble_s=bubble,
        tail_s=tail,
        tail_rank=tail_rank.pp_rank,
        dominant=max(shares, key=lambda k: shares[k]),
    )


def describe_plan(plan: Plan) -> str:
    """``tp=8 pp=2 dp=64, micro-batch 1 x 12, 1f1b, ZeRO-1, recompute selective, SP, units per
    stage 49+49`` (and the rank layout when it is not the default)."""
    schedule = plan.schedule + (f" v={plan.virtual_stages}" if plan.virtual_stages > 1 else "")
    modes = "+".join(sorted({s.recompute for s in plan.stages}))
    text = (
        f"tp={plan.tp_degree} pp={plan.pp_degree} dp={plan.dp_degree}{_cp_ep(plan)}, micro-batch "
        f"{plan.micro_batch_size} x {plan.num_micro_batches}, {schedule}, {plan.zero_text}, "
        f"recompute {modes}" + (", SP" if plan.sequence_parallel else "")
    )
    if plan.framework != DEFAULT_FRAMEWORK:
        text += f", for {plan.framework}"
    if plan.pp_degree > 1:
        sizes = [s.num_units for s in plan.stages]
        text += (
            f", units per stage {'+'.join(map(str, sizes))}"
            if len(sizes) <= 8
            else (f", {min(sizes)}-{max(sizes)} units per stage")
        )
        if plan.rank_layout != MESH_AXES:
            text += f", layout {','.join(plan.rank_layout)}"
    return text


def _cp_ep(plan: Plan) -> str:
    """`` cp=16``, `` ep=8``: the context- and expert-parallel degrees when above 1."""
    return (f" cp={plan.cp_degree}" if plan.cp_degree > 1 else "") + (
        f" ep={plan.ep_degree}" if plan.ep_degree > 1 else ""
    )


def _same_plan(a: Plan, b: Plan) -> bool:
    """Same layout (the model reference and estimate aside)."""
    return dataclasses.replace(a, model=None, estimate=None) == dataclasses.replace(
        b, model=None, estimate=None
    )


def _compare(name: str, plan: Plan, candidate: Plan, result: Estimate) -> Alternative:
    assert candidate.estimate is not None  # the planner's plans carry their estimate
    step = candidate.estimate.step_time_s
    return Alternative(
        name=name,
        description=describe_plan(candidate),
        plan=candidate,
        step_time_s=step,
        relative=step / result.step_time_s - 1.0,
        reason=None,
        same_as_plan=_same_plan(plan, candidate),
        plan_fits=result.fits,
    )


class _Limits(NamedTuple):
    """The limits every comparison search runs under (as `autoplan.search`'s)."""

    time_limit_s: float
    budget_s: float | None
    memory_headroom: float  # the explained plan's: its alternatives keep as much free


def _search_alternatives(
    plan: Plan,
    profile: ModelProfile,
    cluster: Cluster,
    result: Estimate,
    top_k: int,
    limits: _Limits,
    notes: list[str],
    progress: Callable[[str], None] | None,
) -> list[Alternative]:
    what = f"searching the top {top_k} plans for comparison"
    if progress is not None:
        progress(what)
    try:
        ranked = search_plans(
            profile,
            cluster,
            global_batch=plan.global_batch_size,
            top_k=top_k + 1,
            dtype=plan.dtype,
            framework=plan.framework,
            time_limit_s=limits.time_limit_s,
            budget_s=limits.budget_s,
            memory_headroom=limits.memory_headroom,
            progress=None if progress is None else _search_phases(progress, what),
        ).plans
    except (NoFeasiblePlanError, ConstraintError) as error:
        notes.append(f"the search finds no plan to compare with: {infeasible_reason(error)}")
        return []
    # the search ranks one plan more than it compares, so that the plan itself (when among
    # them) leaves ``top_k`` to compare with
    out: list[Alternative] = []
    own: int | None = None
    compared: list[int] = []
    for rank, candidate in enumerate(ranked, start=1):
        if _same_plan(plan, candidate):
            own = rank
        elif len(out) < top_k:
            out.append(_compare(f"search rank {rank}", plan, candidate, result))
            compared.append(rank)
    listed = _ranks_text(compared)
    if own is not None:
        notes.append(f"this plan is the search's rank {own}; 'why not' compares it with {listed}")
    else:
        notes.append(
            f"this plan is not among the search's best {len(ranked)}; 'why not' compares it "
            f"with {listed}"
        )
    return out


def _ranks_text(ranks: list[int]) -> str:
    """How the compared ranks read: "search rank 2", "search ranks 2, 3 and 4"."""
    if not ranks:
        return "no other plan"
    if len(ranks) == 1:
        return f"search rank {ranks[0]}"
    return f"search ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"


def _constrained(
    name: str,
    shape: str,
    plan: Plan,
    profile: ModelProfile,
    cluster: Cluster,
    result: Estimate,
    limits: _Limits,
    **constraints: Any,
) -> Alternative:
    """The planner's best plan of a family (fixed degrees), or why there is none."""
    try:
        best = search_plans(
            profile,
            cluster,
            global_batch=plan.global_batch_size,
            dtype=plan.dtype,
            framework=plan.framework,
            time_limit_s=limits.time_limit_s,
            budget_s=limits.budget_s,
            memory_headroom=limits.memory_headroom,
            **constraints,
        ).plans[0]
    except NoFeasiblePlanError as error:
        return _missing(name, shape, infeasible_reason(error))
    except ConstraintError as error:
        return _missing(name, shape, f"not possible: {error}")
    return _compare(name, plan, best, result)


def _missing(name: str, shape: str, reason: str) -> Alternative:
    return Alternative(
        name=name, description=shape, plan=None, step_time_s=None, relative=None, reason=reason
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# What each phase of a search (`SearchProgress.phase`) does, for the progress text.
_SEARCH_PHASES = {
    "enumerate": "enumerating candidates",
    "seed": "first guesses",
    "visit": "visiting candidates",
}


def _search_phases(progress: Callable[[str], None], what: str) -> Callable[[SearchProgress], None]:
    """A search's progress as ``progress(text)`` once a phase: ``WHAT: visiting candidates``."""
    phases: list[str] = []

    def report(step: SearchProgress) -> None:
        if not phases or phases[-1] != step.phase:
            phases.append(step.phase)
            progress(f"{what}: {_SEARCH_PHASES[step.phase]}")

    return report


def _hand_made(
    plan: Plan,
    profile: ModelProfile,
    cluster: Cluster,
    result: Estimate,
    limits: _Limits,
    progress: Callable[[str], None] | None,
) -> list[Alternative]:
    n, per_node = cluster.num_devices, cluster.devices_per_node
    b = plan.global_batch_size
    out: list[Alternative] = []

    def step(message: str) -> None:
        if progress is not None:
            progress(message)

    # Pure data parallelism: every device a replica (or a ZeRO shard).
    step("pricing pure data parallelism")
    shape = f"tp=1 pp=1 dp={n}"
    if b % n:
        out.append(
            _missing(
                "pure DP",
                shape,
                f"not possible: global batch {b} does not split over {n} replicas",
            )
        )
    else:
        out.append(
            _constrained("pure DP", shape, plan, profile, cluster, result, limits, tp=1, pp=1)
        )

    # Pure tensor parallelism within a node; data parallelism across nodes.
    tp_node = min(per_node, n)
    if tp_node > 1:
        step(f"pricing tp={tp_node} within a node")
        out.append(
            _constrained(
                "pure TP within a node",
                f"tp={tp_node} pp=1 dp={n // tp_node}",
                plan,
                profile,
                cluster,
                result,
                limits,
                tp=tp_node,
                pp=1,
            )
        )

    # Megatron-style: t = 8 (or the node size), then the smallest pipeline degree that fits.
    t = min(MEGATRON_TP_DEGREE, per_node, n)
    name = f"Megatron-style t={t}"
    last: Alternative | None = None
    for pp in _divisors(n // t):
        if pp > profile.num_units:
            break
        step(f"pricing Megatron-style tp={t} pp={pp}")
        last = _constrained(
            name,
            f"tp={t} pp={pp} dp={n // (t * pp)}",
            plan,
            profile,
            cluster,
            result,
            limits,
            tp=t,
            pp=pp,
            schedules=("1f1b", "interleaved-1f1b"),
            zero=MEGATRON_ZERO_LEVELS,
        )
        if last.plan is not None:
            twin = next(
                (a.name for a in out if a.plan is not None and _same_plan(a.plan, last.plan)),
                None,
            )
            suffix = f"; same plan as {twin}" if twin else ""
            out.append(
                dataclasses.replace(
                    last,
                    name=f"{name}, smallest pp that fits",
                    description=last.description + suffix,
                )
            )
            break
    else:
        if last is not None:
            out.append(
                dataclasses.replace(
                    last,
                    description=f"tp={t}, any pp",
                    reason=f"no pp fits; at the largest, {last.reason}",
                )
            )
    return out


# ------------------------------------------------------------------------------ plan files


def plan_model_spec(plan: Plan, source: str) -> tuple[str, str]:
    """The ``--model`` spec a plan file records (``model.name``) and a note saying so."""
    if plan.model is None:
        raise ExplainInputError(f"{source} has no model section; pass --model NAME[:key=value,...]")
    from autoplan.models.spec import parse_model_spec  # imports torch: only when needed

    name = plan.model.name
    try:
        parse_model_spec(name)
    except ModelSpecError:
        raise ExplainInputError(
            f"{source}: model.name {shown(name)} is not a --model spec (a zoo preset or builder, "
            "e.g. gpt3-175b); pass --model NAME[:key=value,...]"
        ) from None
    return name, f"model {name} from {source} (model.name)"


def plan_cluster(plan: Plan, source: str) -> tuple[Cluster, str]:
    """The cluster a plan file records (``estimate.cluster`` with the plan's device count:
    nodes = devices / devices per node) and a note saying so."""
    recorded = plan.estimate
    if recorded is None:
        raise ExplainInputError(
            f"{source} records no estimate.cluster; pass --cluster NAME[:key=value,...]"
        )
    try:
        kind = cluster_type(recorded.cluster)
        kind.check_devices([plan.num_devices])
    except (ClusterError, InputError) as error:
        raise ExplainInputError(
            f"{source}: cannot rebuild estimate.cluster {shown(recorded.cluster)} with "
            f"{plan.num_devices} devices ({error}); pass --cluster NAME[:key=value,...]"
        ) from None
    cluster = kind.cluster(plan.num_devices)
    note = (
        f"cluster {recorded.cluster} with {cluster.num_devices} devices ({cluster.num_nodes} "
        f"node(s) x {cluster.devices_per_node}) from {source} (estimate.cluster); overrides "
        "used when the plan was made are not recorded: pass --cluster to set them"
    )
    return cluster, note
