"""What the exporters share of an fp8 plan: the model's linears and which of them the plan keeps
in bf16 (`Plan.fp8_exclude` read against the model's sizes).

Names are autoplan's module names (autoplan/models): ``blocks.<i>.attn.{q,k,v,o}_proj``,
``blocks.<i>.mlp.{gate,up,down}_proj`` (GPT: ``up_proj``, ``down_proj``), a MoE layer's
``blocks.<i>.mlp.router``, ``mlp.experts`` and ``mlp.shared_expert.{gate,up,down}_proj``, and
``lm_head``. An entry of ``fp8_exclude`` keeps in bf16 the module it names and every linear
under it (``blocks.3`` is block 3's, not block 30's); the roles ``head`` and ``router`` are
``lm_head`` and every MoE router (`cost_model.precision.FP8_EXCLUDE_ROLES`), as the cost model
reads them (`cost_model.parts.fp8.is_converted`). A MoE layer's routed experts always stay in
bf16 (torchao converts ``nn.Linear`` only; ``is_converted`` prices them so).
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.contract.plan import Plan
from autoplan.export._common import ExportProblem, ModelDims
from cost_model.precision import Fp8Recipe, fp8_recipe

HEAD = "lm_head"
EXPERTS = ".mlp.experts"


@dataclass(frozen=True, kw_only=True, slots=True)
class Fp8Layers:
    """An fp8 plan's linears on its model: which run in fp8 and which stay in bf16."""

    recipe: Fp8Recipe
    num_blocks: int
    linears: tuple[str, ...]  # the model's linears and MoE expert groups, in model order
    kept: frozenset[str]  # those kept in bf16
    unknown: tuple[str, ...]  # fp8_exclude entries that name no module of the model

    @property
    def head_kept(self) -> bool:
        return HEAD in self.kept

    @property
    def converted_routers(self) -> tuple[str, ...]:
        """The MoE routers the plan runs in fp8."""
        return tuple(n for n in self.linears if n.endswith(".router") and n not in self.kept)

    @property
    def converts_experts(self) -> bool:
        """Whether a MoE block with linears in fp8 holds routed experts (kept in bf16)."""
        return any(
            n.endswith(EXPERTS) and not set(self.block_linears(int(n.split(".")[1]))) <= self.kept
            for n in self.linears
        )

    def block_linears(self, block_idx: int) -> tuple[str, ...]:
        prefix = f"blocks.{block_idx}."
        return tuple(name for name in self.linears if name.startswith(prefix))

    @property
    def kept_blocks(self) -> tuple[int, ...]:
        """The blocks kept in bf16 whole."""
        return tuple(
            idx
            for idx in range(self.num_blocks)
            if all(name in self.kept for name in self.block_linears(idx))
        )

    @property
    def kept_parts(self) -> tuple[str, ...]:
        """Linears kept in bf16 that are neither the head, a router, experts (always kept), nor
        in a whole kept block."""
        whole = tuple(f"blocks.{idx}." for idx in self.kept_blocks)
        return tuple(
            name
            for name in self.linears
            if name in self.kept
            and name != HEAD
            and not name.endswith((".router", EXPERTS))
            and not name.startswith(whole)
        )


def model_linears(dims: ModelDims) -> tuple[str, ...]:
    """The linears of autoplan's model with sizes ``dims`` (and its MoE expert groups)."""
    names: list[str] = []
    dense_mlp: tuple[str, ...] = ("up_proj", "down_proj")
    if dims.family == "llama":
        dense_mlp = ("gate_proj", *dense_mlp)
    for idx in range(dims.num_layers):
        block = f"blocks.{idx}"
        names += [f"{block}.attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        moe = dims.moe
        if moe is None or idx < moe.num_dense_layers:
            names += [f"{block}.mlp.{p}" for p in dense_mlp]
            continue
        names += [f"{block}.mlp.router", f"{block}.mlp.experts"]
        if moe.shared_ffn_hidden_size:
            shared = ("gate_proj", "up_proj", "down_proj")
            names += [f"{block}.mlp.shared_expert.{p}" for p in shared]
    return (*names, HEAD)


def fp8_layers(plan: Plan, dims: ModelDims) -> Fp8Layers | None:
    """The plan's fp8 linears on the model; None when the plan's dtype is no fp8 recipe."""
    recipe = fp8_recipe(plan.dtype)
    if recipe is None:
        return None
    linears = model_linears(dims)
    kept = {name for name in linears if name.endswith(EXPERTS)}
    unknown: list[str] = []
    for entry in plan.fp8_exclude:
        if entry == "head":
            kept.add(HEAD)
        elif entry == "router":
            kept.update(name for name in linears if name.endswith(".router"))
        else:
            named = [n for n in linears if n == entry or n.startswith(entry + ".")]
            kept.update(named)
            if not named:
                unknown.append(entry)
    return Fp8Layers(
        recipe=recipe,
        num_blocks=dims.num_layers,
        linears=linears,
        kept=frozenset(kept),
        unknown=tuple(unknown),
    )


def exclude_text(plan: Plan) -> str:
    """``fp8_exclude`` as a plan file writes it: ``[head, blocks.0]``."""
    return f"[{', '.join(plan.fp8_exclude)}]"


def unknown_problem(plan: Plan, layers: Fp8Layers, dims: ModelDims) -> ExportProblem | None:
    """The ``fp8_exclude`` entries that name no module of the model (the launch config cannot
    translate them into the target's module names)."""
    if not layers.unknown:
        return None
    mlp = "{gate,up,down}_proj" if dims.family == "llama" else "{up,down}_proj"
    if dims.moe is not None:
        mlp += " (a MoE layer's router, experts, shared_expert.*)"
    return ExportProblem(
        field="fp8_exclude",
        value=exclude_text(plan),
        option=(
            f"{', '.join(layers.unknown)} names no module of {dims.spec!r}, whose linears are "
            f"blocks.<i>.attn.{{q,k,v,o}}_proj, blocks.<i>.mlp.{mlp} and lm_head "
            f"(blocks 0-{dims.num_layers - 1})"
        ),
        fix="name modules of the model, head or router, in the plan file",
    )
