"""`autoplan.whatif`: the best plan, speed and cost of one model across cluster sizes and types.

Expects a model (an ``nn.Module``, a ``ModelGraph`` or a ``ModelProfile``), one or more cluster
types (a preset or spec ``NAME[:key=value,...]``, a cluster YAML path, or a `Cluster` used as a
template for its node), device counts, a global batch and optionally a token count and a price
per device-hour. For every cluster type and device count it builds the cluster, runs the planner
(`autoplan.planner.search.search_plans`) and reports the best plan's step time, tokens/s, MFU
and peak memory; the scaling efficiency, i.e. throughput per device relative to that of the
smallest size of the same type that has a plan; and the days, device-hours and cost to train on
the given tokens.

Device counts map to nodes: a multiple of the type's ``devices_per_node`` is that many whole
nodes; a count below one node is one node with that many devices. ``cluster_overrides`` (the
flat keys of `cost_model.hardware.OVERRIDE_KEYS`, e.g. ``inter_node_bandwidth="100GB/s"``)
change every cluster type; to compare a changed cluster with the original, list both types, e.g.
``["dgx-a100-80g", "dgx-a100-80g:inter_node_bandwidth=100GB/s"]``.

Guarantees: every input mistake (a device count that is not whole nodes, an unknown cluster type
or override, a token count or price that is not a positive number, an unknown search constraint)
raises a `WhatIfInputError` (or the `ClusterError`/`ConstraintError` of the part that checks
it, all `InputError`s) before any search runs; a size the planner
finds no plan for becomes a row that says why (the planner's reason, shortened), never an
exception. Rows come per cluster type, in the given order, then by ascending device count
(the records: `autoplan.analysis.whatif_results`, importable from here too).
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from autoplan import api
from autoplan.analysis.whatif_results import (
    TrainingCost,
    WhatIfProgress,
    WhatIfResult,
    WhatIfRow,
)
from autoplan.contract.errors import InputError, NoFeasiblePlanError
from autoplan.contract.plan import Plan
from autoplan.planner.search import search_plans
from autoplan.planner.space import ConstraintError, SearchSpace
from cost_model.degrees import is_whole
from cost_model.frameworks import DEFAULT_FRAMEWORK, framework_profile
from cost_model.hardware import MAX_DEVICES, Cluster, load_cluster
from cost_model.headroom import DEFAULT_MEMORY_HEADROOM, plan_memory_headroom
from cost_model.messages import shown
from cost_model.uncertainty import DEFAULT_OBJECTIVE, OBJECTIVES
from cost_model.workload import ModelProfile

__all__ = [
    "DEFAULT_TOTAL_BUDGET_S",
    "MAX_SEARCHES",
    "ClusterType",
    "TrainingCost",
    "WhatIfInputError",
    "WhatIfProgress",
    "WhatIfResult",
    "WhatIfRow",
    "cluster_type",
    "infeasible_reason",
    "parse_positive",
    "split_cluster_specs",
    "whatif",
]

SECONDS_PER_DAY = 86400.0
SECONDS_PER_HOUR = 3600.0
# Seconds a what-if may spend on its searches in all (`whatif`'s ``total_budget_s``): no search
# starts after it (each started search keeps its own deterministic budget, so a row's plan does
# not depend on the machine's pace). 50 cluster types took ~10 minutes without one.
DEFAULT_TOTAL_BUDGET_S = 300.0
# The most searches (cluster types x device counts) one what-if takes.
MAX_SEARCHES = 1024
# What a search process costs before its first search: spawn, then import torch, OR-tools and
# torch's pipeline schedules (about 3 s of one core, measured on this project's 2-core machine).
_POOL_START_S = 3.0
_NODE_KEYS = ("nodes", "num_nodes")


class WhatIfInputError(InputError):
    """A what-if request that cannot be answered as given (the message names the value)."""


# ------------------------------------------------------------------------------ cluster types


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterType:
    """A kind of node (device, links, devices per node) that clusters of any size are made of."""

    label: str
    template: Cluster  # one node; overrides applied
    local: bool = False  # `Cluster.local`: this machine, as many worker processes as asked
    overrides: tuple[tuple[str, object], ...] = ()  # re-applied to `Cluster.local(n)`
    # the one dtype its searches try, when the what-if compares several (its label ends in it)
    dtype: str | None = None
    # its price per device-hour (the what-if's, else its cluster file's; None: not stated)
    price: float | None = None

    def with_dtype(self, dtype: str) -> ClusterType:
        """This type's rows for one of the dtypes a what-if compares side by side."""
        return dataclasses.replace(self, label=f"{self.label} {dtype}", dtype=dtype)

    def search_constraints(self, constraints: dict[str, Any]) -> dict[str, Any]:
        """``constraints`` for this type's searches: its own dtype when it has one."""
        return constraints if self.dtype is None else {**constraints, "dtype": (self.dtype,)}

    @property
    def devices_per_node(self) -> int:
        return self.template.devices_per_node

    def check_devices(self, num_devices: Sequence[int]) -> None:
        """Raise `WhatIfInputError` naming every count that is not whole nodes of this type."""
        if self.local:
            return
        per_node = self.devices_per_node
        bad = [n for n in num_devices if n > per_node and n % per_node]
        if bad:
            examples = ", ".join(str(per_node * k) for k in (1, 2, 4))
            raise WhatIfInputError(
                f"num_devices {', '.join(map(str, bad))} {'is' if len(bad) == 1 else 'are'} not "
                f"whole nodes of {self.label!r} ({per_node} devices per node): use multiples of "
                f"{per_node} (e.g. {examples}) or fewer than {per_node} devices for one partial "
                "node"
            )

    def cluster(self, num_devices: int) -> Cluster:
        """The cluster of ``num_devices`` devices of this type (see the module docstring)."""
        if self.local:
            return Cluster.local(num_devices).with_overrides(None, **dict(self.overrides))
        per_node = self.devices_per_node
        if num_devices < per_node:
            return self.template.with_overrides(nodes=1, devices_per_node=num_devices)
        assert num_devices % per_node == 0, (num_devices, per_node)  # check_devices ran
        return self.template.with_overrides(nodes=num_devices // per_node)


def cluster_type(spec: str | Cluster, overrides: Mapping[str, object] | None = None) -> ClusterType:
    """A cluster type from a spec (``NAME[:key=value,...]`` or a YAML path) or a `Cluster`.

    A spec may not set the node count (the what-if sets it); ``overrides`` apply on top.
    """
    extra = dict(overrides or {})
    for key in _NODE_KEYS:
        if key in extra:
            raise WhatIfInputError(
                f"cluster override {key}={extra[key]!r}: the node count comes from num_devices; "
                "drop it"
            )
    if isinstance(spec, Cluster):
        return ClusterType(label=spec.name, template=spec.with_overrides(nodes=1, **extra))
    name, _, rest = spec.partition(":")
    keys = {item.partition("=")[0].strip() for item in rest.split(",") if item.strip()}
    if not spec.endswith((".yaml", ".yml")) and keys & set(_NODE_KEYS):
        raise WhatIfInputError(
            f"cluster {spec!r} sets the node count; a what-if takes it from num_devices: "
            f"write {name!r} and list the device counts instead"
        )
    base = load_cluster(spec)
    template = base.with_overrides(nodes=1, **extra)
    if name.strip() == "local" and not spec.endswith((".yaml", ".yml")):
        spec_overrides = dict(_spec_overrides(rest))
        spec_overrides.pop("devices_per_node", None)
        return ClusterType(
            label=spec,
            template=template,
            local=True,
            overrides=tuple({**spec_overrides, **extra}.items()),
        )
    return ClusterType(label=spec, template=template)


def _spec_overrides(rest: str) -> list[tuple[str, object]]:
    pairs: list[tuple[str, object]] = []
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, _, value = item.partition("=")
        pairs.append((key.strip(), value.strip()))
    return pairs


def split_cluster_specs(text: str) -> list[str]:
    """Split ``"a,b:k=v,k2=v2,c"`` into cluster specs: a comma starts a new spec unless the part
    is ``key=value`` without a ``:`` (it then continues the previous spec's overrides)."""
    specs: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if "=" in part and ":" not in part and specs:
            specs[-1] += "," + part
        else:
            specs.append(part)
    return specs


# ------------------------------------------------------------------------------ inputs


_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_cost_inputs(
    tokens: str | float | None,
    price_per_device_hour: str | float | None,
    *,
    names: tuple[str, str],
) -> tuple[float | None, float | None]:
    """Tokens to train on and the price of a device-hour, each positive when given; a price
    needs tokens (the cost is for training on them). ``names`` say how the caller spells the
    two inputs in errors (an argument or a CLI flag)."""
    token_name, price_name = names
    count = None if tokens is None else parse_positive(tokens, token_name, example="300e9")
    price = (
        None
        if price_per_device_hour is None
        else parse_positive(price_per_device_hour, price_name, example="2.5")
    )
    if price is not None and count is None:
        raise WhatIfInputError(
            f"{price_name} needs {token_name}: the cost is for training on a number of tokens"
        )
    return count, price


def parse_positive(text: str | float | int, what: str, *, example: str) -> float:
    """A positive finite number from ``text`` (``300e9``, ``300B``, ``1.4T``, ``$2.5``).

    Raises `WhatIfInputError` naming ``what``, the value and an ``example``.
    """
    if isinstance(text, bool):
        raise WhatIfInputError(f"{what} = {text!r} is not a positive number; e.g. {example}")
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        raw = text.strip().replace("_", "").lstrip("$")
        scale = 1.0
        if raw and raw[-1].lower() in _SUFFIXES:
            scale = _SUFFIXES[raw[-1].lower()]
            raw = raw[:-1]
        try:
            value = float(raw) * scale
        except ValueError:
            raise WhatIfInputError(
                f"{what} = {text!r} is not a number; write e.g. {example}"
            ) from None
    if not math.isfinite(value) or value <= 0:
        raise WhatIfInputError(
            f"{what} = {text!r} must be a finite positive number, e.g. {example}"
        )
    return value


def _check_device_counts(num_devices: Sequence[int]) -> tuple[int, ...]:
    if isinstance(num_devices, (str, bytes)) or not isinstance(num_devices, Sequence):
        raise WhatIfInputError(
            f"num_devices = {num_devices!r} must be a list of device counts, e.g. [64, 128, 256]"
        )
    if not num_devices:
        raise WhatIfInputError("num_devices is empty; give at least one device count")
    bad = [n for n in num_devices if not is_whole(n)]
    if bad:
        raise WhatIfInputError(
            f"num_devices {', '.join(map(repr, bad))}: device counts must be whole numbers >= 1"
        )
    huge = [n for n in num_devices if n > MAX_DEVICES]
    if huge:
        raise WhatIfInputError(
            f"num_devices {', '.join(f'{n:,}' for n in huge)}: more than the {MAX_DEVICES:,} "
            "devices autoplan plans for; give real device counts"
        )
    return tuple(sorted(set(num_devices)))


def infeasible_reason(error: InputError) -> str:
    """A short reason for a planner error: ``needs 97.3 GiB per device of 80.0 GiB``, or when
    the least need is within the device but not its headroom, ``needs 71.0 GiB per device, over
    the 63.5 GiB its headroom leaves of 80.0 GiB``."""
    message = str(error)
    least = getattr(error, "least_memory_bytes", None)
    capacity = getattr(error, "capacity_bytes", None)
    usable = getattr(error, "usable_bytes", None)
    if least is not None and capacity is not None:
        gib = 2.0**30
        if usable is not None and least <= capacity:
            return (
                f"does not fit: needs {least / gib:.1f} GiB per device, over the "
                f"{usable / gib:.1f} GiB its headroom leaves of {capacity / gib:.1f} GiB"
            )
        return f"does not fit: needs {least / gib:.1f} GiB per device of {capacity / gib:.1f} GiB"
    if "no degrees/batching combination" in message:
        return "no degrees/batching combination satisfies the constraints"
    return message.split(";")[0]


# ------------------------------------------------------------------------------ the what-if


def whatif(
    model_or_graph: Any,
    cluster_name_or_template: str | Cluster | Sequence[str | Cluster],
    *,
    num_devices: Sequence[int],
    global_batch: int,
    tokens: float | None = None,
    price_per_device_hour: float | None = None,
    prices: Mapping[str, float | str] | None = None,
    cluster_overrides: Mapping[str, object] | None = None,
    time_limit_s: float = 10.0,
    budget_s: float | None = 10.0,
    total_budget_s: float | None = DEFAULT_TOTAL_BUDGET_S,
    progress: Callable[[WhatIfProgress], None] | None = None,
    workers: int | None = None,
    framework: str = DEFAULT_FRAMEWORK,
    objective: str = DEFAULT_OBJECTIVE,
    memory_headroom: float | None = DEFAULT_MEMORY_HEADROOM,
    **constraints: Any,
) -> WhatIfResult:
    """The best plan and its speed and cost for every cluster type and device count.

    ``cluster_name_or_template``: one cluster type or a list of them (module docstring).
    ``tokens``: train this many tokens (days, device-hours); ``price_per_device_hour``: with
    ``tokens``, the cost in the price's currency, for every type; ``prices``: a price per
    cluster type (keys: the types as given), over the one for all; a type priced by neither
    takes its cluster file's ``price_per_device_hour`` if it states one. Each priced row gives
    its cost and cost per million tokens. ``constraints`` are `autoplan.search`'s.
    ``workers``: searches run in this many processes at once (1: here, one after another).
    By default they run here while the rest would end before a process could start, then in one
    process per CPU core. ``time_limit_s`` and
    ``budget_s``: each search's per-solve limit and visit budget (`autoplan.search`).
    ``total_budget_s``: seconds for all the searches together (None: no cap): no search starts
    once it is spent; a started search keeps its own budget (its plan is the same on every
    machine), or with ``budget_s=None`` gets what is left of the total as its budget; the sizes
    not reached are rows with ``searched=False`` (`WhatIfResult.not_run` counts them), never
    dropped. A search that is running when it runs out ends within its own budget.
    ``framework``: price every plan for that training stack, ``objective``: what each search
    minimises and ``memory_headroom`` the share of each device its plans leave free
    (`autoplan.search`). At most `MAX_SEARCHES` cluster types x device counts.
    """
    start = time.perf_counter()
    if not is_whole(global_batch):
        raise WhatIfInputError(f"global_batch = {global_batch!r} must be a whole number >= 1")
    _check_total_budget(total_budget_s)
    sizes = _check_device_counts(num_devices)
    token_count, price = parse_cost_inputs(
        tokens, price_per_device_hour, names=("tokens", "price_per_device_hour")
    )
    types = _cluster_types(cluster_name_or_template, cluster_overrides, sizes)
    types = _priced(types, price, prices, token_count)
    # several dtypes (bf16,fp8): each type's rows once per dtype, side by side
    dtypes = SearchSpace.from_constraints(**constraints).dtype or ()
    constraints = _search_constraints(constraints, framework, objective, memory_headroom)
    if len(dtypes) > 1:
        check_search_count(len(types) * len(dtypes), len(sizes))
        types = [kind.with_dtype(dtype) for kind in types for dtype in dtypes]
    profile = api.profile_of(model_or_graph)

    searches = _Searches(
        [(kind, n, kind.cluster(n)) for kind in types for n in sizes],
        profile=profile,
        global_batch=global_batch,
        constraints=constraints,
        limits=(time_limit_s, budget_s),
        cap_end=math.inf if total_budget_s is None else start + total_budget_s,
        progress=progress,
    )
    searches.run(workers)
    searches.mark_not_run(total_budget_s)
    rows: list[WhatIfRow] = []
    for kind in types:
        rows += _rows(
            kind.label, [searches.found[kind.label, n] for n in sizes], token_count, kind.price
        )
    if types:
        searches.report_end(types[-1].label, sizes[-1])
    return WhatIfResult(
        model=profile.name,
        global_batch=global_batch,
        tokens=token_count,
        price_per_device_hour=price,
        clusters=tuple(t.label for t in types),
        cluster_overrides=tuple((k, str(v)) for k, v in (cluster_overrides or {}).items()),
        constraints=tuple((k, str(v)) for k, v in constraints.items()),
        rows=tuple(rows),
        total_time_s=time.perf_counter() - start,
        total_budget_s=total_budget_s,
        prices=tuple((t.label, t.price) for t in types if t.price is not None),
    )


def _priced(
    types: list[ClusterType],
    price: float | None,
    prices: Mapping[str, float | str] | None,
    tokens: float | None,
) -> list[ClusterType]:
    """``types`` with their prices: ``prices[label]``, else ``price``, else the cluster file's
    (`Cluster.price_per_device_hour`); a key naming no type, a price that is not a positive
    number, or a price without tokens to train on is a `WhatIfInputError`."""
    labels = [kind.label for kind in types]
    given: dict[str, float] = {}
    for key, value in (prices or {}).items():
        if key not in labels:
            raise WhatIfInputError(
                f"price for {key!r}, which is not a cluster type of this what-if; price the "
                f"types given: {', '.join(labels)}"
            )
        given[key] = parse_positive(value, f"price of {key}", example=f"{key}=2.5")
    if given and tokens is None:
        raise WhatIfInputError(
            "prices need tokens: the cost is for training on a number of tokens; give --tokens"
        )
    priced = []
    for kind in types:
        own = given.get(kind.label, price)
        if own is None and tokens is not None:
            own = kind.template.price_per_device_hour
        priced.append(dataclasses.replace(kind, price=own))
    return priced


def _check_total_budget(total_budget_s: float | None) -> None:
    """Raise `WhatIfInputError` unless ``total_budget_s`` is a number of seconds > 0 or None."""
    if total_budget_s is not None and (
        isinstance(total_budget_s, bool)
        or not isinstance(total_budget_s, (int, float))
        or not 0 < total_budget_s < math.inf
    ):
        raise WhatIfInputError(
            f"total_budget_s = {shown(total_budget_s)} must be a number of seconds > 0, or None "
            "(no cap)"
        )


def _cluster_types(
    cluster_name_or_template: str | Cluster | Sequence[str | Cluster],
    cluster_overrides: Mapping[str, object] | None,
    sizes: tuple[int, ...],
) -> list[ClusterType]:
    """The cluster types asked for, each given once and each made of whole nodes at every size
    in ``sizes``, with at most `MAX_SEARCHES` searches in all."""
    specs: Sequence[str | Cluster] = (
        [cluster_name_or_template]
        if isinstance(cluster_name_or_template, (str, Cluster))
        else list(cluster_name_or_template)
    )
    if not specs:
        raise WhatIfInputError("no cluster type given; name at least one, e.g. dgx-a100-80g")
    check_search_count(len(specs), len(sizes))
    types = [cluster_type(spec, cluster_overrides) for spec in specs]
    labels = [t.label for t in types]
    for label in labels:
        if labels.count(label) > 1:
            raise WhatIfInputError(f"cluster type {label!r} is given twice")
    for kind in types:
        kind.check_devices(sizes)
    return types


def _search_constraints(
    constraints: Mapping[str, Any],
    framework: str,
    objective: str,
    memory_headroom: float | None,
) -> dict[str, Any]:
    """Every search's keyword arguments beyond the cluster and batch, once they are known."""
    # Unknown or contradictory constraints, or an unknown framework, fail before any search.
    SearchSpace.from_constraints(**constraints)
    framework_profile(framework)
    if objective not in OBJECTIVES:
        raise WhatIfInputError(
            f"objective = {shown(objective)} is not one autoplan knows; use one of "
            f"{', '.join(OBJECTIVES)}"
        )
    memory_headroom = plan_memory_headroom(None, memory_headroom)  # (None: the default)
    return {
        **constraints,
        "framework": framework,
        "objective": objective,
        "memory_headroom": memory_headroom,
    }


class _Searches:
    """The what-if's searches, one per (cluster type, device count) job, run here or in worker
    processes within the total budget (``cap_end``, a `time.perf_counter` time), with progress
    reports; ``found`` holds each one's outcome, ``pending`` the jobs not started."""

    def __init__(
        self,
        jobs: list[tuple[ClusterType, int, Cluster]],
        *,
        profile: ModelProfile,
        global_batch: int,
        constraints: dict[str, Any],
        limits: tuple[float, float | None],
        cap_end: float,
        progress: Callable[[WhatIfProgress], None] | None,
    ) -> None:
        self.pending = list(jobs)
        self.total = len(jobs)
        self.found: dict[tuple[str, int], _Found] = {}
        self.reported = -1  # the last completed count reported
        self._profile = profile
        self._global_batch = global_batch
        self._constraints = constraints
        self._time_limit_s, self._budget_s = limits
        self._cap_end = cap_end
        self._progress = progress

    def limits(self) -> tuple[float, float | None] | None:
        """A search's per-solve limit and budget within what is left of the total budget;
        None when it is spent (the search does not start)."""
        left = self._cap_end - time.perf_counter()
        if left <= 0:
            return None
        if math.isinf(left) or self._budget_s is not None:
            # (a budget is deterministic work: cutting it to the wall time left would make
            # a row's plan depend on the machine's pace)
            return self._time_limit_s, self._budget_s
        return min(self._time_limit_s, left), left

    def report(self, kind: ClusterType, n: int) -> None:
        self.reported = len(self.found)
        if self._progress is not None:
            self._progress(
                WhatIfProgress(
                    completed=len(self.found), total=self.total, cluster=kind.label, num_devices=n
                )
            )

    def report_end(self, label: str, n: int) -> None:
        """The last report: the pool reports each search as it ends, the last one included;
        the others as they start."""
        ran = self.total - len(self.pending)
        if self._progress is not None and self.reported != ran:
            self._progress(
                WhatIfProgress(completed=ran, total=self.total, cluster=label, num_devices=n)
            )

    def run(self, workers: int | None) -> None:
        """Run the searches in ``workers`` processes (None: by default, see `whatif`)."""
        count = min(workers or os.cpu_count() or 1, self.total)
        if count > 1 and workers is None:
            self._run_here_while_cheaper()
        if count <= 1:
            while self.pending and self._run_here(*self.pending[0]):
                self.pending.pop(0)
        elif self.pending and self.limits() is not None:
            self._run_in_pool(count)

    def mark_not_run(self, total_budget_s: float | None) -> None:
        """The searches the total budget left unstarted: outcomes that say so."""
        for kind, n, cluster in self.pending:
            self.found[kind.label, n] = _Found(
                num_devices=n,
                cluster=cluster,
                plan=None,
                reason=f"not run: the what-if's total budget ({total_budget_s:g} s) ran out",
                search_time_s=0.0,
                optimality_gap=0.0,
                searched=False,
            )

    def _run_here(self, kind: ClusterType, n: int, cluster: Cluster) -> bool:
        """Run one search here; False when the total budget is spent (it does not start)."""
        within = self.limits()
        if within is None:
            return False
        self.report(kind, n)
        self.found[kind.label, n] = _best_plan(
            n,
            self._profile,
            cluster,
            self._global_batch,
            within,
            kind.search_constraints(self._constraints),
        )
        return True

    def _run_here_while_cheaper(self) -> None:
        # By default the searches run here while the rest, at the pace so far, would end before
        # a worker process could start and take its first (`_POOL_START_S`): a small model's
        # sweep never pays for processes. The results are the same either way. The schedules'
        # one-off import comes first, so that it does not count as the first search's pace.
        _warm_worker()
        spent = 0.0
        while self.pending:
            done = self.total - len(self.pending)
            if done and spent / done * len(self.pending) > _POOL_START_S:
                break
            t0 = time.perf_counter()
            if not self._run_here(*self.pending[0]):
                break
            self.pending.pop(0)
            spent += time.perf_counter() - t0

    def _run_in_pool(self, count: int) -> None:
        # Each search is independent and CPU-bound (OR-tools releases nothing to share), so
        # separate processes, started fresh ("spawn": OR-tools threads and fork do not mix).
        # Submitted one per free worker, each with what is left of the total budget.
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(
            max_workers=min(count, len(self.pending)), mp_context=context, initializer=_warm_worker
        ) as pool:
            running: dict[Future[_Found], tuple[ClusterType, int]] = {}
            self._submit(pool, running, count)
            if running:
                self.report(*next(iter(running.values())))
            while running:
                ended, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in ended:
                    kind, n = running.pop(future)
                    self.found[kind.label, n] = future.result()
                    self.report(kind, n)
                self._submit(pool, running, count)

    def _submit(
        self,
        pool: ProcessPoolExecutor,
        running: dict[Future[_Found], tuple[ClusterType, int]],
        count: int,
    ) -> None:
        """Start pending searches on the free workers while the total budget lasts."""
        while self.pending and len(running) < min(count, self.total):
            within = self.limits()
            if within is None:
                return
            kind, n, cluster = self.pending.pop(0)
            future = pool.submit(
                _best_plan,
                n,
                self._profile,
                cluster,
                self._global_batch,
                within,
                dict(kind.search_constraints(self._constraints)),
            )
            running[future] = (kind, n)


def check_search_count(num_types: int, num_sizes: int) -> None:
    """Raise `WhatIfInputError` when cluster types x device counts passes `MAX_SEARCHES`."""
    if num_types * num_sizes > MAX_SEARCHES:
        raise WhatIfInputError(
            f"{num_types:,} cluster types x {num_sizes:,} device counts = "
            f"{num_types * num_sizes:,} searches: a what-if runs at most {MAX_SEARCHES:,}; "
            "split it into several"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class _Found:
    """One search's outcome."""

    num_devices: int
    cluster: Cluster
    plan: Plan | None
    reason: str | None
    search_time_s: float
    optimality_gap: float
    searched: bool = True


def _warm_worker() -> None:
    """Load what every search needs once per worker process (torch's pipeline schedules, which
    the schedule simulator imports on first use, about 2 s), so that each size's search time is
    its own."""
    import torch.distributed.pipelining.schedules  # noqa: F401


def _best_plan(
    num_devices: int,
    profile: ModelProfile,
    cluster: Cluster,
    global_batch: int,
    limits: tuple[float, float | None],
    constraints: Mapping[str, Any],
) -> _Found:
    t0 = time.perf_counter()
    try:
        result = search_plans(
            profile,
            cluster,
            global_batch=global_batch,
            time_limit_s=limits[0],
            budget_s=limits[1],
            **constraints,
        )
    except (NoFeasiblePlanError, ConstraintError) as error:
        return _Found(
            num_devices=num_devices,
            cluster=cluster,
            plan=None,
            reason=infeasible_reason(error),
            search_time_s=time.perf_counter() - t0,
            optimality_gap=0.0,
        )
    return _Found(
        num_devices=num_devices,
        cluster=cluster,
        plan=result.plans[0],
        reason=None,
        search_time_s=time.perf_counter() - t0,
        optimality_gap=result.stats.optimality_gap,
    )


def _rows(
    label: str,
    found: Sequence[_Found],
    tokens: float | None,
    price: float | None,
) -> list[WhatIfRow]:
    # Scaling efficiency: (tokens/s per device at n) / (tokens/s per device at the smallest size
    # with a plan); 1 is linear scaling.
    baseline: tuple[int, float] | None = None
    for f in found:
        if f.plan is not None and f.plan.estimate is not None:
            baseline = (f.num_devices, f.plan.estimate.tokens_per_s / f.num_devices)
            break
    rows = []
    for f in found:
        n, cluster, plan = f.num_devices, f.cluster, f.plan
        e = plan.estimate if plan is not None else None
        training = None
        if e is not None and tokens is not None:
            seconds = tokens / e.tokens_per_s
            device_hours = n * seconds / SECONDS_PER_HOUR
            training = TrainingCost(
                tokens=tokens,
                days=seconds / SECONDS_PER_DAY,
                device_hours=device_hours,
                cost=None if price is None else device_hours * price,
                price_per_device_hour=price,
            )
        rows.append(
            WhatIfRow(
                cluster=label,
                num_devices=n,
                num_nodes=cluster.num_nodes,
                devices_per_node=cluster.devices_per_node,
                memory_capacity_bytes=float(cluster.device.memory_bytes),
                plan=plan,
                reason=f.reason,
                step_time_s=e.step_time_s if e else None,
                tokens_per_s=e.tokens_per_s if e else None,
                mfu=e.mfu if e else None,
                peak_memory_bytes=float(e.peak_memory_bytes) if e else None,
                step_time_range_s=e.step_time_range_s if e else None,
                scaling_efficiency=(
                    e.tokens_per_s / n / baseline[1] if e is not None and baseline else None
                ),
                scaling_baseline_devices=baseline[0] if baseline else None,
                training=training,
                search_time_s=f.search_time_s,
                optimality_gap=f.optimality_gap,
                searched=f.searched,
            )
        )
    return rows
