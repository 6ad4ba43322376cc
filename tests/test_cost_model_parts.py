"""The cost model as a composition of parts: values as keys, tables owned by a `CostModel`.

What these protect: `Cluster` and `ModelProfile` are values (equal ones hash equal, so the
planner can key tables on them); a `CostModel` reused across many plans answers exactly as a
fresh `estimate` does (its tables are functions of what their keys name, whatever was asked
before); the core-sharing part changes nothing on a GPU cluster; `cost_model` keeps no
module-level state that an estimate fills; the layering (`cost_model` imports neither
`autoplan` nor `passes`; `hardware` does not import `local_machine`).
"""

from __future__ import annotations

import ast
import dataclasses
import itertools
import sys
from pathlib import Path

import pytest

from autoplan.api import manual_plan
from cost_model.estimate import CostModel, estimate, unit_costs
from cost_model.hardware import Cluster
from cost_model.parts.core_sharing import NOT_SHARED, oversubscription_factors, stretched
from cost_model.strategy import Strategy
from tests.cost_profiles import gpt_profile, round_cluster

COST_MODEL = Path(__file__).resolve().parent.parent / "cost_model"


def test_equal_clusters_hash_equal_and_key_tables() -> None:
    a = Cluster.preset("dgx-a100-80g", nodes=2)
    b = Cluster.preset("dgx-a100-80g", nodes=2)
    assert a is not b
    assert a == b
    assert hash(a) == hash(b)
    assert {a: "x"}[b] == "x"
    assert hash(Cluster.preset("dgx-a100-80g", nodes=4)) != hash(a)
    # a file round trip is the same value
    again = Cluster.from_data(a.to_data())
    assert again == a and hash(again) == hash(a)


def test_device_hash_ignores_the_order_of_its_dtypes() -> None:
    device = round_cluster().device
    assert device.peak_flops == {"bf16": 100e12, "fp32": 10e12, "fp8": 200e12}
    swapped = dataclasses.replace(device, peak_flops={"fp8": 200e12, "fp32": 10e12, "bf16": 100e12})
    assert swapped == device and hash(swapped) == hash(device)
    faster = dataclasses.replace(device, peak_flops={"fp32": 10e12, "bf16": 200e12, "fp8": 200e12})
    assert faster != device and hash(faster) != hash(device)


def test_model_profiles_are_values() -> None:
    a, b = gpt_profile(num_layers=3), gpt_profile(num_layers=3)
    assert a is not b and a == b and hash(a) == hash(b)


def _plans(profile, cluster):  # type: ignore[no-untyped-def]
    """A spread of valid plans (degrees, ZeRO, recompute, schedules)."""
    options = itertools.product(
        ((1, 1), (2, 1), (1, 2), (2, 2)),
        (0, 1, 3),
        ("none", "selective", "full"),
        ("1f1b", "gpipe", "interleaved-1f1b"),
        ("fp32", "bf16"),
    )
    for (tp, pp), zero, recompute, schedule, dtype in options:
        if schedule == "interleaved-1f1b" and pp == 1:
            continue
        yield manual_plan(
            profile,
            cluster,
            tp=tp,
            pp=pp,
            micro_batch=1,
            global_batch=4 * cluster.num_devices // (tp * pp),
            zero=zero,
            recompute=recompute,
            schedule=schedule,
            virtual_stages=2 if schedule == "interleaved-1f1b" else 1,
            dtype=dtype,
        )


@pytest.mark.parametrize("shared_cores", [None, 3])
def test_a_reused_cost_model_equals_fresh_estimates(shared_cores: int | None) -> None:
    profile = gpt_profile(num_layers=4)
    cluster = dataclasses.replace(round_cluster(), shared_cores_per_node=shared_cores)
    plans = list(_plans(profile, cluster))
    assert len(plans) > 50
    model = CostModel(profile, cluster)
    # asked in one order and then the other: the tables must not depend on the order
    forward = [model.estimate(plan) for plan in plans]
    backward = [model.estimate(plan) for plan in reversed(plans)][::-1]
    fresh = [estimate(profile, cluster, plan) for plan in plans]
    assert forward == fresh
    assert backward == fresh


def test_core_sharing_is_the_identity_on_gpus() -> None:
    profile = gpt_profile(num_layers=2)
    gpus = round_cluster()
    strategy = Strategy(pp_degree=2, dp_degree=2, tp_degree=2, num_micro_batches=4)
    assert oversubscription_factors(strategy, gpus) == NOT_SHARED
    costs = unit_costs(profile, gpus, strategy, "none")
    assert all(a is b for a, b in zip(stretched(costs, NOT_SHARED), costs, strict=True))
    # with shared cores, the same costs stretched (nothing else changes)
    cpus = dataclasses.replace(gpus, shared_cores_per_node=2)
    factors = oversubscription_factors(strategy, cpus)
    assert factors.pipeline > 1.0 and factors.tail > 1.0
    assert unit_costs(profile, cpus, strategy, "none") == stretched(costs, factors)


def _module_state() -> dict[str, object]:
    """Every module-level dict, list or set of the loaded cost_model modules, copied."""
    state: dict[str, object] = {}
    for name, module in list(sys.modules.items()):
        if name == "cost_model" or name.startswith("cost_model."):
            for attr, value in vars(module).items():
                if isinstance(value, (dict, list, set)):
                    state[f"{name}.{attr}"] = repr(value)
    return state


def test_estimates_leave_no_module_state_behind() -> None:
    profile = gpt_profile(num_layers=3)
    cluster = dataclasses.replace(round_cluster(), shared_cores_per_node=3)
    before = _module_state()
    for plan in itertools.islice(_plans(profile, cluster), 20):
        estimate(profile, cluster, plan)
    assert _module_state() == before


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_cost_model_layering() -> None:
    for path in COST_MODEL.rglob("*.py"):
        outside = {n for n in _imports(path) if n.split(".")[0] in ("autoplan", "passes")}
        assert not outside, f"{path} imports {sorted(outside)}: cost_model imports neither"
    hardware = _imports(COST_MODEL / "hardware.py")
    assert not any("local_machine" in name for name in hardware)


def test_deepspeed_zero3_gathers_skip_persistent_params_and_pack_prefetch_buckets() -> None:
    """Modules under 1e5 elements stay whole (never gathered); the rest pack in order into
    buckets of 5e7 elements, one collective each; a larger module is a bucket of its own."""
    from cost_model.parts.data_parallel import deepspeed_zero3_gathers

    assert deepspeed_zero3_gathers([]) == 0
    assert deepspeed_zero3_gathers([4096.0, 8192.0]) == 0  # norms: persistent
    # llama3-8b block: q, k, v, o (16.8M, 4.2M, 4.2M, 16.8M) fill one bucket (42M); gate, up
    # and down (58.7M each) exceed it: 1 + 3 collectives
    q, kv, mlp = 4096.0 * 4096, 4096.0 * 1024, 4096.0 * 14336
    assert deepspeed_zero3_gathers([4096.0, q, kv, kv, q, 4096.0, mlp, mlp, mlp]) == 4
    # two 30M modules do not share a 50M bucket
    assert deepspeed_zero3_gathers([3e7, 3e7]) == 2


def test_per_module_zero3_gathers_add_one_latency_each() -> None:
    """Same bytes, k collectives: the gather time grows by (k - 1) one-byte gathers."""
    from cost_model.communication import collective_time_s
    from cost_model.parts.data_parallel import data_parallel_cost
    from cost_model.strategy import Strategy, group_placements

    cluster = Cluster.preset("dgx-a100-80g", nodes=4)
    strategy = Strategy(dp_degree=32, tp_degree=1, pp_degree=1, micro_batch_size=1,
                        num_micro_batches=1, zero_stage=3)  # fmt: skip
    groups = group_placements(strategy, cluster, "dp")
    kwargs = dict(forward_window_s=0.0, backward_window_s=0.0)
    one = data_parallel_cost(1e9, strategy, cluster, groups, **kwargs)
    five = data_parallel_cost(1e9, strategy, cluster, groups, zero3_gathers=5, **kwargs)
    latency = collective_time_s("all_gather", 1.0, groups, cluster)
    assert latency > 0
    assert five.zero3_forward_s == pytest.approx(one.zero3_forward_s + 4 * latency)
    assert five.zero3_backward_s == pytest.approx(one.zero3_backward_s + 4 * latency)
