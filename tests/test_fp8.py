"""fp8 training through `autoplan.parallelize` (passes/fp8.py, torchao's float8 linears), on CPU.

A CPU has no fp8 tensor cores, but torch computes ``torch._scaled_mm`` on float8 tensors in
software, so the runtime path runs here; the tests state an fp8 rate in their cluster
(`fp8_cluster`), which `Plan.validate` asks of an fp8 plan. Speed is not measured here.

Numerics. Each case trains the tiny GPT of tests/numerics.py (every linear's dims are multiples
of 16; the head stays bf16, the default ``fp8_exclude``) for 3 SGD steps and compares the loss
on every rank and every gradient with `fp8_reference`: one process, the same torchao conversion
of the same linears, run as FSDP2's mixed-precision policy runs it (a bf16 working copy of fp32
master weights, each micro-batch's gradients accumulated in fp32, the update in fp32), on the
same micro-batches (a tensor-wise scale is the amax of one micro-batch's tensor, so the
micro-batches must hold the same rows). With ``fp8_all_gather`` the converted weights are cast
to fp8 from their fp32 master values, as torchao's FSDP2 extension casts the fp32 shards before
the all-gather (torchao/float8/fsdp_utils.py ``fsdp_pre_all_gather``): the reference keeps
those weights fp32.

SGD, not AdamW: where the runs differ by rounding (tensor parallelism, below), Adam's first
update (about +-lr whatever the gradient's size) turns a rounding difference in a near-zero
gradient into a full step of the weight, and later gradients then differ by far more than the
rounding that started it.

- Exact where the scaling is per tensor (or per row) and each GEMM reduces the same terms:
  data parallelism (FSDP2, fp8 all-gather on and off), pipelining (also with fp8 all-gather on
  4 processes), recompute. The only
  difference left is the fp32 summation order of gradients over micro-batches and ranks:
  tests/numerics.py's tolerances.
- Tensor parallelism reduces a row-parallel GEMM's K-shards as bf16 partial outputs summed by an
  all-reduce (and the vocabulary-parallel head's input gradient the same way): bf16 roundings
  (2^-9 relative) the reference does not make. A rounded value that moves across an fp8
  rounding boundary lands on the neighbouring fp8 value: one step away, 2^-3 of its magnitude
  in e4m3 (3 mantissa bits: activations and weights, and row-wise gradients) and 2^-2 in e5m2
  (2 mantissa bits: gradients under the tensor-wise recipe, torchao's default
  ``cast_config_grad_output``). Every fp8 operand of the two runs thus lies within one step of
  the other's, and a weight gradient (e5m2 gradients times e4m3 inputs) within about one e5m2
  step of the reference's in relative norm: `TP_GRAD_RTOL` is 2^-2 for the tensor-wise recipe
  and 2^-3 for the row-wise one (measured: at most 0.11 and 0.065). Near-zero gradients (the
  key bias: softmax ignores it, so its gradient is rounding noise in both runs) are measured
  against 2^-7 of the step's largest gradient norm instead of their own. The loss, a mean over
  all tokens of a forward whose e4m3 operands are within one step, stays within one bf16 ulp
  (2^-8 relative; measured 6e-5). A missing or doubled reduction moves a gradient by 50-100%;
  and every case also checks which layers were converted and how they are sharded.

The loss of a 30-step run of the character corpus falls as the bf16 run's does
(`test_fp8_loss_falls_like_bf16`); an fp8 run with fp8 all-gather saves a checkpoint and
resumes bit for bit (`test_fp8_checkpoint_resumes`). Bad input: a layer whose shape
``torch._scaled_mm`` cannot take, an exclusion naming nothing, and torchao missing are refused
in one line before anything is allocated.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from autoplan.contract.errors import PlanError
from autoplan.contract.plan import Plan
from autoplan.tracing import trace
from cost_model.hardware import Cluster
from cost_model.local_rates import _one_thread
from cost_model.parts.fp8 import is_converted
from passes import init_full_model_, original_fqn, select_fp8_linears, torchao_float8
from tests.dist_utils import run_distributed
from tests.numerics import (
    GRAD_ATOL,
    GRAD_RTOL,
    LOSS_ATOL,
    LOSS_RTOL,
    batch,
    build_model,
    full_grads,
    logits,
    loss_fn,
    make_plan,
    row_paths,
)

STEPS = 3
SGD_LR = 0.5  # gradients here are 1e-3..1e-1: the weights (std 0.02) move visibly each step
TP_GRAD_RTOL = {"fp8": 2.0**-2, "fp8-rowwise": 2.0**-3}  # one fp8 step of the gradients
TP_LOSS_RTOL = 2.0**-8
NEAR_ZERO = 2.0**-7  # of the step's largest gradient norm

Records = list[tuple[float, dict[str, torch.Tensor]]]


def fp8_cluster(num_devices: int) -> Cluster:
    """This machine with an fp8 rate stated (twice its bf16 rate: any rate lets the plan run)."""
    cluster = Cluster.local(num_devices=num_devices)
    device = cluster.device
    rates = {**device.peak_flops, "fp8": 2 * device.peak_flops_for("bf16")}
    return dataclasses.replace(cluster, device=dataclasses.replace(device, peak_flops=rates))


def fp8_plan(dtype: str = "fp8", *, fp8_all_gather: bool = False, **plan_args: Any) -> Plan:
    return dataclasses.replace(make_plan(**plan_args), dtype=dtype, fp8_all_gather=fp8_all_gather)


def sgd() -> Callable[..., torch.optim.Optimizer]:
    return functools.partial(torch.optim.SGD, lr=SGD_LR)


def _layer(module: nn.Module) -> str:
    """How a converted linear's weight is held: its local tensor's type and its placements."""
    weight = module.weight
    if isinstance(weight, DTensor):
        return f"{type(weight.to_local()).__name__} {'/'.join(map(str, weight.placements))}"
    return type(weight).__name__


def fp8_worker(
    rank: int, world_size: int, model_name: str, plan_data: dict[str, Any]
) -> dict[str, Any]:
    """Train with autoplan for `STEPS` SGD steps: per step the loss and this rank's gradients;
    each converted linear this rank holds (model name -> how its weight is held) and the type
    of the input it is called with (fp8 already when a float8 TP style cast it)."""
    from autoplan.runtime.parallelizer import parallelize

    plan = Plan.from_data(plan_data)
    job = parallelize(
        build_model(model_name),
        fp8_cluster(world_size),
        plan=plan,
        loss_fn=loss_fn,
        optimizer=sgd(),
    )
    float8_linear = torchao_float8().float8_linear.Float8Linear
    layers = {
        original_fqn(path): _layer(module)
        for stage in job.modules
        for path, module in stage.named_modules()
        if isinstance(module, float8_linear)
    }
    inputs: dict[str, str] = {}
    for stage in job.modules:
        for path, module in stage.named_modules():
            if isinstance(module, float8_linear):
                module.register_forward_pre_hook(functools.partial(_note_input, inputs, path))
    records = []
    for step in range(STEPS):
        loss = job.train_step(*batch(plan.global_batch_size, step))
        records.append((float(loss), full_grads(job.named_parameters())))
    return {"records": records, "layers": layers, "inputs": inputs}


def _note_input(inputs: dict[str, str], path: str, module: nn.Module, args: Any) -> None:
    """A forward pre-hook registered after the TP styles' own: it sees what they made."""
    value = args[0]
    local = value._local_tensor if isinstance(value, DTensor) else value
    inputs.setdefault(original_fqn(path), type(local).__name__)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Fp8Reference:
    records: Records  # per step: the loss, and every gradient under each of its names
    aliases: list[set[str]]  # the names of each parameter (several if tied)
    converted: frozenset[str]  # the linears converted to fp8


def fp8_reference(model_name: str, plan: Plan) -> Fp8Reference:
    """The plan's training in one process (module doc)."""
    float8 = torchao_float8()
    with _one_thread():
        master = build_model(model_name)
        selection = select_fp8_linears(master, trace(master), plan)
        assert selection is not None
        config = float8.Float8LinearConfig.from_recipe_name(selection.recipe.torchao_recipe)
        float8.convert_to_float8_training(
            master, config=config, module_filter_fn=lambda _, fqn: fqn in selection.converted
        )
        optimizer = sgd()(master.parameters())
        records = []
        for step in range(STEPS):
            inputs, targets = batch(plan.global_batch_size, step)
            work = _working_copy(master, fp8_weights_fp32=plan.fp8_all_gather)
            sums: dict[str, torch.Tensor] = {}
            losses = []
            for x, y in zip(
                inputs.split(plan.micro_batch_size),
                targets.split(plan.micro_batch_size),
                strict=True,
            ):
                work.zero_grad(set_to_none=True)
                loss = loss_fn(logits(work, x), y)
                loss.backward()  # type: ignore[no-untyped-call]
                losses.append(loss.item())
                for name, param in work.named_parameters(remove_duplicate=False):
                    assert param.grad is not None
                    sums[name] = sums.get(name, torch.zeros(())) + param.grad.float()
            grads = {name: total / len(losses) for name, total in sums.items()}
            records.append((sum(losses) / len(losses), grads))
            for name, param in master.named_parameters():
                param.grad = grads[name].clone()
            optimizer.step()
    names_of: dict[int, set[str]] = {}
    for name, param in master.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), set()).add(name)
    return Fp8Reference(
        records=records, aliases=list(names_of.values()), converted=selection.converted
    )


def _working_copy(master: nn.Module, *, fp8_weights_fp32: bool) -> nn.Module:
    """``master`` in bf16 (FSDP2's ``param_dtype``), with the converted linears' weights left
    fp32 when the run all-gathers them in fp8 (cast from the fp32 shards)."""
    work = copy.deepcopy(master).to(torch.bfloat16)
    if fp8_weights_fp32:
        float8_linear = torchao_float8().float8_linear.Float8Linear
        for name, module in work.named_modules():
            if isinstance(module, float8_linear):
                module.weight.data = master.get_submodule(name).weight.detach().clone()
    return work


def _relative(grad: torch.Tensor, ref: torch.Tensor, floor: float) -> float:
    return float((grad - ref).norm()) / max(float(ref.norm()), floor)


def assert_fp8_matches(
    results: list[dict[str, Any]], expected: Fp8Reference, *, exact: bool, dtype: str
) -> None:
    """Every rank's loss and every gradient against the reference's, each step (module doc for
    the two kinds of comparison); every parameter is reported by some rank."""
    for step, (ref_loss, ref_grads) in enumerate(expected.records):
        seen: set[str] = set()
        floor = NEAR_ZERO * max(float(g.norm()) for g in ref_grads.values())
        for rank, result in enumerate(results):
            loss, grads = result["records"][step]
            where = f"step {step}, rank {rank}"
            if exact:
                torch.testing.assert_close(
                    torch.tensor(loss), torch.tensor(ref_loss), rtol=LOSS_RTOL, atol=LOSS_ATOL
                )
            else:
                assert abs(loss - ref_loss) <= TP_LOSS_RTOL * abs(ref_loss), (where, loss, ref_loss)
            for name, grad in grads.items():
                if exact:
                    torch.testing.assert_close(
                        grad,
                        ref_grads[name],
                        rtol=GRAD_RTOL,
                        atol=GRAD_ATOL,
                        msg=f"{name}, {where}",
                    )
                else:
                    off = _relative(grad, ref_grads[name], floor)
                    assert off <= TP_GRAD_RTOL[dtype], f"{name}, {where}: {off:.3f} off"
                seen.add(name)
        missing = [names for names in expected.aliases if not names & seen]
        assert not missing, f"step {step}: no rank reported the gradients of {missing}"


def _check(tmp_path: Path, model: str, plan: Plan, *, exact: bool) -> list[dict[str, Any]]:
    results = run_distributed(
        fp8_worker, model, plan.to_data(), world_size=plan.num_devices, tmp_path=tmp_path
    )
    expected = fp8_reference(model, plan)
    assert_fp8_matches(results, expected, exact=exact, dtype=plan.dtype)
    held = {name for result in results for name in result["layers"]}
    assert held == expected.converted, f"converted {sorted(held)}, not {expected.converted}"
    return results


# ----------------------------------------------------------------------------- numerics


def test_fsdp2_with_recompute_matches_one_process(tmp_path: Path) -> None:
    """dp2, ZeRO-3, full recompute; the weights gathered in bf16 and cast to fp8 after."""
    plan = fp8_plan(dp=2, zero=3, recompute="full")
    results = _check(tmp_path, "gpt", plan, exact=True)
    for result in results:  # FSDP2 shards torchao's linears like any other
        assert set(result["layers"].values()) == {"Tensor S(0)"}, result["layers"]


def test_fp8_all_gather_matches_one_process(tmp_path: Path) -> None:
    """dp2, ZeRO-2 with fp8 all-gather and selective recompute: torchao's weight wrapper under
    FSDP2, scales precomputed after each step."""
    plan = fp8_plan(dp=2, zero=2, recompute="selective", fp8_all_gather=True)
    results = _check(tmp_path, "gpt", plan, exact=True)
    for result in results:
        assert set(result["layers"].values()) == {"WeightWithDynamicFloat8CastTensor S(0)"}, result[
            "layers"
        ]


def test_rowwise_pipeline_matches_one_process(tmp_path: Path) -> None:
    """pp2 (1F1B, 4 micro-batches), row-wise scaling. Untied head: a tied one is summed in bf16
    by the reference's autograd but in fp32 across stages (`TiedGradientSync`)."""
    plan = fp8_plan("fp8-rowwise", pp=2, num_micro_batches=4)
    _check(tmp_path, "gpt-untied", plan, exact=True)


def test_rowwise_tensor_parallel_within_one_fp8_step(tmp_path: Path) -> None:
    """tp2 with DTensor's own styles on row-wise fp8 linears (torchtitan's choice)."""
    plan = fp8_plan("fp8-rowwise", tp=2)
    results = _check(tmp_path, "gpt", plan, exact=False)
    for result in results:
        layers = set(result["layers"].values())
        assert layers == {"Tensor R/S(0)", "Tensor R/S(1)"}, layers
        assert set(result["inputs"].values()) == {"Tensor"}  # cast by the linear itself


@pytest.mark.slow
def test_pipeline_fsdp2_fp8_all_gather_four_processes(tmp_path: Path) -> None:
    """pp2 x dp2, ZeRO-3 with fp8 all-gather: the schedule gathers each stage's fp8 weights
    per micro-batch; exact (untied head: see the row-wise pipeline case)."""
    plan = fp8_plan(pp=2, dp=2, zero=3, fp8_all_gather=True)
    results = _check(tmp_path, "gpt-untied", plan, exact=True)
    for result in results:
        assert set(result["layers"].values()) == {"WeightWithDynamicFloat8CastTensor S(0)"}


@pytest.mark.slow
def test_tensor_parallel_fsdp2_fp8_all_gather_four_processes(tmp_path: Path) -> None:
    """dp2 x tp2, ZeRO-3, fp8 all-gather, torchao's float8 TP styles, sequence parallelism."""
    plan = fp8_plan(dp=2, tp=2, zero=3, sequence_parallel=True, fp8_all_gather=True)
    results = _check(tmp_path, "gpt", plan, exact=False)
    for result in results:
        assert set(result["layers"].values()) == {
            "WeightWithDynamicFloat8CastTensor _S(0, 2)/S(0)",
            "WeightWithDynamicFloat8CastTensor S(0)/S(1)",
        }, result["layers"]
        # Float8ColwiseParallel casts a column-parallel input before the linear; under
        # sequence parallelism on gloo a row-parallel linear keeps DTensor's style and casts
        # its input itself (passes/tensor_parallel.py `_float8_collectives_ok`)
        for name, kind in result["inputs"].items():
            column = name.split(".")[-1] in ("q_proj", "k_proj", "v_proj", "up_proj")
            assert kind == ("Float8TrainingTensor" if column else "Tensor"), (name, kind)


# ----------------------------------------------------------------------------- training

LOSS_STEPS = 30
# fp8's mean loss over the last 10 steps within 2^-4 of bf16's: e4m3's largest relative rounding
# error (half its 2^-3 step), which every converted GEMM operand is within of its bf16 value.
# A stated bar for training quality (fp8 trains the model bf16 trains), not a bound that follows
# from it. Measured: 0.3% (tensor-wise), 1.9% (row-wise; AdamW at lr 1e-2 makes a 30-step run
# of a tiny model chaotic: one step's loss differs from bf16's by up to 0.29 nats).
LOSS_CURVE_RTOL = 2.0**-4
LOSS_FALL = 1.0  # nats below the first step's loss (ln 97 = 4.57): bf16 falls 1.27


def curve_worker(rank: int, world_size: int, dtypes: list[str]) -> dict[str, list[float]]:
    """`LOSS_STEPS` AdamW steps on the character corpus per dtype, the same batches each."""
    from autoplan.data import load_corpus
    from autoplan.models import gpt
    from autoplan.runtime.parallelizer import parallelize

    corpus = load_corpus()
    curves = {}
    for dtype in dtypes:
        plan = fp8_plan(dtype, micro_batch=8, num_micro_batches=1)
        torch.manual_seed(0)
        model = gpt(2, 32, 4, 32, corpus.vocab_size, device="cpu")
        job = parallelize(
            model,
            fp8_cluster(world_size),
            plan=plan,
            loss_fn=loss_fn,
            optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
        )
        draws = torch.Generator().manual_seed(0)
        curves[dtype] = [
            float(job.train_step(*corpus.batch(8, 32, draws))) for _ in range(LOSS_STEPS)
        ]
    return curves


def test_fp8_loss_falls_like_bf16(tmp_path: Path) -> None:
    (curves,) = run_distributed(
        curve_worker, ["bf16", "fp8", "fp8-rowwise"], world_size=1, tmp_path=tmp_path
    )
    tail = {dtype: sum(curve[-10:]) / 10 for dtype, curve in curves.items()}
    for dtype, curve in curves.items():
        assert curve[0] - tail[dtype] >= LOSS_FALL, (dtype, curve)
        assert abs(tail[dtype] - tail["bf16"]) <= LOSS_CURVE_RTOL * tail["bf16"], tail


def checkpoint_worker(
    rank: int, world_size: int, plan_data: dict[str, Any], folder: str
) -> dict[str, Any]:
    """Train 4 steps saving every 2, then 2 more; load step 4 into the same job (as a torchft
    group heals: its fp8 scales come from step 6's weights) and train steps 5 and 6 again; a
    second job built on meta (other initial weights) restores step 4 and trains them too.
    Returns the three runs' losses of steps 5 and 6, and the meta job's initial weights."""
    from autoplan import Checkpointer
    from autoplan.runtime.parallelizer import parallelize

    plan = Plan.from_data(plan_data)

    def build(device: str) -> Any:
        model = build_model("gpt", device=device)
        return parallelize(
            model, fp8_cluster(world_size), plan=plan, loss_fn=loss_fn, optimizer=sgd()
        )

    def train(job: Any, upto: int, checkpointer: Any = None) -> list[float]:
        losses = []
        while job.step < upto:
            losses.append(float(job.train_step(*batch(plan.global_batch_size, job.step))))
            if checkpointer is not None:
                checkpointer.after_step()
        return losses

    job = build("cpu")
    checkpointer = Checkpointer(folder, job, every=2)
    assert checkpointer.restore() == 0
    train(job, 4, checkpointer)
    checkpointer.close()
    continued = train(job, 6)
    reloaded_at = Checkpointer(folder, job, every=2).restore()
    reloaded = train(job, 6)
    resumed_job = build("meta")
    initial = {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in resumed_job.named_parameters()
    }
    resumed_at = Checkpointer(folder, resumed_job, every=2).restore()
    return {
        "initial": initial,
        "restored_at": [reloaded_at, resumed_at],
        "continued": continued,
        "reloaded": reloaded,
        "resumed": train(resumed_job, 6),
    }


def test_fp8_checkpoint_resumes(tmp_path: Path) -> None:
    """dp2 ZeRO-3 with fp8 all-gather: a meta model's weights are materialised through torchao's
    weight wrapper as any plan's are; the wrapper saves and loads through DCP (as the plain
    tensor it wraps), and the scales are recomputed from the loaded weights: a job that loads
    trains on bit for bit."""
    plan = fp8_plan(dp=2, zero=3, fp8_all_gather=True)
    results = run_distributed(
        checkpoint_worker,
        plan.to_data(),
        str(tmp_path / "ckpt"),
        world_size=2,
        tmp_path=tmp_path,
    )
    model = build_model("gpt")
    rows, num_blocks = row_paths(model)
    init_full_model_(model, seed=0, row_paths=rows, num_blocks=num_blocks)  # parallelize's seed
    expected = dict(model.named_parameters())
    for result in results:
        # materialised shard by shard through torchao's weight wrapper, as any plan's are
        for name, value in result["initial"].items():
            torch.testing.assert_close(value, expected[name].detach(), rtol=0, atol=0, msg=name)
        assert result["restored_at"] == [4, 4]
        assert result["reloaded"] == result["continued"]
        assert result["resumed"] == result["continued"]


# ----------------------------------------------------------------------------- bad input


def _moe_plan(*exclude: str) -> Plan:
    return fp8_plan(num_units=5, fp8_exclude=exclude)


def test_exclusions_resolve_roles_and_prefixes() -> None:
    """ "head" is the head unit's linear, "router" the MoE routers, other names a module or a
    prefix; what is left is converted."""
    model = build_model("moe", device="meta")
    graph = trace(model)
    plan = _moe_plan("head", "router", "blocks.1.mlp.shared_expert", "blocks.2.mlp.shared_expert")
    selection = select_fp8_linears(model, graph, plan)
    assert selection is not None
    linears = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    kept = {"lm_head", "blocks.1.mlp.router", "blocks.2.mlp.router"} | {
        f"blocks.{b}.mlp.shared_expert.{p}_proj" for b in (1, 2) for p in ("gate", "up", "down")
    }
    assert set(selection.excluded) == kept
    assert selection.converted == linears - kept
    assert select_fp8_linears(model, graph, dataclasses.replace(plan, dtype="bf16")) is None


@pytest.mark.parametrize(
    ("model_name", "plan", "words"),
    [
        # the routers (4 experts) and the shared experts (24 features) cannot be fp8 GEMMs
        (
            "moe",
            _moe_plan("head"),
            "dtype fp8 converts blocks.1.mlp.router (in_features 32, out_features 4), "
            "blocks.1.mlp.shared_expert.down_proj (in_features 24, out_features 32), "
            "blocks.1.mlp.shared_expert.gate_proj (in_features 32, out_features 24) and 5 more "
            "to fp8, but torchao's fp8 GEMM (torch._scaled_mm) needs in and out features "
            "divisible by 16; keep them in bf16 (add 'blocks.1.mlp.router', "
            "'blocks.1.mlp.shared_expert.down_proj', 'blocks.1.mlp.shared_expert.gate_proj' "
            "... to fp8_exclude) or use dtype bf16",
        ),
        # 2 key/value heads of 8: a column-parallel k_proj has 8 outputs on each of 2 TP ranks
        (
            "llama",
            fp8_plan(tp=2),
            "blocks.0.attn.k_proj (in_features 32, out_features 16; 32 x 8 on each of 2 TP ranks)",
        ),
        (
            "moe",
            _moe_plan("head", "router", "blocks.9.mlp"),
            "fp8_exclude names 'blocks.9.mlp', which is no linear layer of the model",
        ),
    ],
    ids=["shapes", "tp-shard-shape", "unknown-name"],
)
def test_bad_exclusions_and_shapes_are_refused(model_name: str, plan: Plan, words: str) -> None:
    model = build_model(model_name, device="meta")
    with pytest.raises(PlanError) as info:
        select_fp8_linears(model, trace(model), plan)
    assert words in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_fp8_all_gather_of_a_tied_head_is_refused() -> None:
    model = build_model("gpt", device="meta")
    plan = fp8_plan(dp=2, zero=2, fp8_all_gather=True, fp8_exclude=())
    with pytest.raises(PlanError, match=r"would untie lm_head.weight from tok_emb.weight"):
        select_fp8_linears(model, trace(model), plan)


def refused_worker(rank: int, world_size: int) -> dict[str, Any]:
    """parallelize an fp8 plan on this CPU as it is (no fp8 rate), an mxfp8 plan, a layer the
    fp8 GEMM cannot take (on a meta model), then with torchao made unimportable: the messages,
    and whether anything of the meta model was allocated."""
    from autoplan.runtime.parallelizer import parallelize

    messages = []
    mx_cluster = fp8_cluster(1)
    mx_cluster = dataclasses.replace(
        mx_cluster,
        device=dataclasses.replace(
            mx_cluster.device, peak_flops={**mx_cluster.device.peak_flops, "mxfp8": 1e12}
        ),
    )
    for cluster, plan in ((None, fp8_plan()), (mx_cluster, fp8_plan("mxfp8"))):
        with pytest.raises(PlanError) as refused:
            parallelize(build_model("gpt"), cluster, plan=plan, loss_fn=loss_fn)
        messages.append(str(refused.value))
    model = build_model("moe", device="meta")
    with pytest.raises(PlanError) as shapes:
        parallelize(model, fp8_cluster(1), plan=_moe_plan("head"), loss_fn=loss_fn)
    messages.append(str(shapes.value))
    sys.modules["torchao"] = None  # type: ignore[assignment]  # what an uninstalled one raises
    with pytest.raises(PlanError) as missing:
        parallelize(build_model("gpt"), fp8_cluster(1), plan=fp8_plan(), loss_fn=loss_fn)
    messages.append(str(missing.value))
    return {"messages": messages, "meta": all(p.is_meta for p in model.parameters())}


def test_parallelize_refuses_before_allocating(tmp_path: Path) -> None:
    """No fp8 rate, mxfp8, bad shapes and a missing torchao: one line each, before any
    allocation."""
    (result,) = run_distributed(refused_worker, world_size=1, tmp_path=tmp_path)
    cpu, mxfp8, shapes, missing = result["messages"]
    assert "dtype fp8 needs fp8 tensor cores: a CPU has no fp8 tensor cores" in cpu, cpu
    assert "dtype mxfp8" in mxfp8 and "fp8 or fp8-rowwise" in mxfp8, mxfp8
    # Plan.validate refuses it first, from the trace (cost_model/parts/fp8.py)
    assert "'blocks.1.mlp.router'" in shapes and "fp8_exclude" in shapes, shapes
    assert "pip install 'torch-autoplan[fp8]'" in missing, missing
    assert all("\n" not in message for message in result["messages"])
    assert result["meta"]  # the refused model was never materialised


@pytest.mark.parametrize(
    ("model_name", "exclude"),
    [
        ("gpt", ("head",)),
        ("gpt", ()),
        ("llama", ("head", "blocks.0")),
        ("moe", ("head", "router", "blocks.1.mlp.shared_expert", "blocks.2.mlp.shared_expert")),
    ],
)
def test_the_cost_model_prices_the_linears_the_pass_converts(
    model_name: str, exclude: tuple[str, ...]
) -> None:
    """`cost_model.parts.fp8.is_converted` (on the trace's ops, named like fx nodes) and the
    pass's selection (on the modules) agree."""
    model = build_model(model_name, device="meta")
    graph = trace(model)
    plan = fp8_plan(num_units=len(graph.profile.units), fp8_exclude=exclude)
    selection = select_fp8_linears(model, graph, plan)
    assert selection is not None
    priced = {
        op.name
        for unit in graph.profile.units
        for op in unit.ops
        if is_converted(op, unit, exclude)
    }
    assert {name.replace(".", "_") for name in selection.converted} == priced
