"""HSDP exported (`Plan.dp_shard_degree`): Megatron-LM's ``--num-distributed-optimizer-instances``
and torchtitan's ``data_parallel_replicate_degree`` / ``data_parallel_shard_degree``, each
loaded by the stack's own code, whose groups are checked against the plan's on a fake process
group of 16 ranks (megatron-core 0.16.1's ``initialize_model_parallel``, torchtitan 0.3.0's
``ParallelDims``); DeepSpeed's refusal in one line."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

import autoplan
from autoplan.contract.plan import Plan
from autoplan.export import ExportError, export_plan, model_dims
from autoplan.export.megatron import megatron_args
from tests.dist_utils import fake_process_group
from tests.test_export import MEGATRON_FLAGS, _flags

CLUSTER = "dgx-h100-80g:nodes=2"  # 16 devices
HSDP_FLAG = "--num-distributed-optimizer-instances"


@pytest.fixture(scope="module")
def llama8b() -> Any:
    return autoplan.trace(autoplan.models.preset("llama3-8b"))


def _plan(graph: Any, **options: Any) -> Plan:
    options.setdefault("global_batch", 64)
    return autoplan.manual_plan(graph, CLUSTER, **options)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_megatron_runs_hsdp_as_distributed_optimizer_instances(llama8b: Any, zero: int) -> None:
    """dp 8 sharded in 4s: 2 instances of the distributed optimizer (ZeRO-1) or of
    Megatron-FSDP (ZeRO-2/3); without HSDP no flag."""
    plan = _plan(llama8b, tp=2, zero=zero, dp_shard=4)
    flags = _flags(megatron_args(plan, model_dims("llama3-8b")))
    assert flags[HSDP_FLAG] == "2"
    assert HSDP_FLAG in MEGATRON_FLAGS  # a flag of Megatron-LM's arguments.py
    assert ("--use-distributed-optimizer" in flags) == (zero == 1)
    assert ("--use-megatron-fsdp" in flags) == (zero >= 2)
    plain = _flags(megatron_args(_plan(llama8b, tp=2, zero=zero), model_dims("llama3-8b")))
    assert HSDP_FLAG not in plain


@pytest.mark.parametrize(
    "options",
    [
        {"tp": 2, "dp_shard": 4},
        {"tp": 2, "pp": 2, "dp_shard": 2, "rank_layout": ("dp", "pp", "tp")},
    ],
    ids=["tp2-dp8", "tp2-pp2-dp4-tp-pp-dp-mapping"],
)
def test_megatron_core_builds_the_plans_shard_and_replica_groups(
    llama8b: Any, options: dict[str, Any]
) -> None:
    """megatron-core's own rank generator, given the exported degrees and order: its
    intra-instance data-parallel group is the plan's shard group on every rank, its
    inter-instance group the plan's replicas."""
    pytest.importorskip("megatron.core.parallel_state")
    import torch.distributed as dist
    from megatron.core import parallel_state

    plan = _plan(llama8b, zero=1, **options)
    flags = _flags(megatron_args(plan, model_dims("llama3-8b")))
    order = "tp-cp-ep-pp-dp" if "--use-tp-pp-dp-mapping" in flags else "tp-cp-ep-dp-pp"
    for rank in range(0, 16, 3):
        with fake_process_group(16, rank=rank):
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=int(flags["--tensor-model-parallel-size"]),  # type: ignore[arg-type]
                pipeline_model_parallel_size=int(flags["--pipeline-model-parallel-size"]),  # type: ignore[arg-type]
                num_distributed_optimizer_instances=int(flags[HSDP_FLAG]),  # type: ignore[arg-type]
                order=order,
                create_gloo_process_groups=False,  # the fake backend has no gloo groups
            )
            try:
                intra = parallel_state.get_data_parallel_group(
                    with_context_parallel=True, partial_data_parallel=True
                )
                inter = parallel_state.get_inter_distributed_optimizer_instance_group()
                assert tuple(dist.get_process_group_ranks(intra)) == plan.shard_group_ranks(rank)
                replicas = tuple(dist.get_process_group_ranks(inter))
                assert replicas == plan.replicate_group_ranks(rank)
            finally:
                parallel_state.destroy_model_parallel()


def test_torchtitan_loads_hsdp_and_builds_the_plans_groups(
    llama8b: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The exported module through torchtitan's ConfigManager: replicate 2 x shard 4, which its
    ParallelDims validates and meshes (on 16 fake ranks) into the plan's shard and replica
    groups."""
    pytest.importorskip("torchtitan.trainer", exc_type=ImportError)  # imports triton
    from torchtitan.config import ConfigManager
    from torchtitan.distributed.parallel_dims import ParallelDims

    plan = _plan(llama8b, tp=2, zero=3, dp_shard=4)
    exported = export_plan(plan, "torchtitan")
    for name, text in exported.files.items():
        (tmp_path / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(exported.command[-3], None)
    config = ConfigManager().parse_args(
        ["--module", exported.command[-3], "--config", exported.command[-1]]
    )
    parallelism = config.parallelism
    assert (parallelism.data_parallel_replicate_degree, parallelism.data_parallel_shard_degree) == (
        2,
        4,
    )
    assert parallelism.fsdp_reshard_after_forward == "always"
    for rank in range(0, 16, 3):
        with fake_process_group(16, rank=rank):
            dims = ParallelDims.from_config(parallelism, world_size=16)
            dims.build_mesh()
            assert tuple(dims.get_mesh("dp_shard").mesh.tolist()) == plan.shard_group_ranks(rank)
            replicas = tuple(dims.get_mesh("dp_replicate").mesh.tolist())
            assert replicas == plan.replicate_group_ranks(rank)


def test_deepspeed_refuses_hsdp_in_one_line(llama8b: Any) -> None:
    plan = _plan(llama8b, tp=2, zero=3, dp_shard=4)
    with pytest.raises(ExportError) as caught:
        export_plan(plan, "deepspeed")
    message = str(caught.value)
    assert "dp_shard_degree = 4" in message and "MiCS" in message
    assert "leave dp_shard_degree out" in message and "\n" not in message.strip()
