"""Plans whose schedule cannot express their cuts fail validation with a one-line PlanError."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from autoplan import Plan, PlanError
from autoplan.contract.plan import even_stages


def _plan_data(**edit: Any) -> dict[str, Any]:
    """A valid 1F1B plan's file data with ``edit`` applied (stages re-cut for pp x v)."""
    base = Plan(
        dp_degree=1,
        tp_degree=1,
        pp_degree=2,
        stages=even_stages(8, 2),
        micro_batch_size=1,
        num_micro_batches=4,
        global_batch_size=4,
    )
    data = base.to_data()
    data.update(edit)
    data["global_batch_size"] = data["num_micro_batches"]
    stages = even_stages(8, data["pp_degree"] * data["virtual_stages"])
    data["stages"] = [
        {"first_unit": s.first_unit, "last_unit": s.last_unit, "recompute": s.recompute}
        for s in stages
    ]
    return data


CASES = [
    (
        "zbv needs two stages per rank",
        dict(schedule="zbv", pp_degree=2, virtual_stages=3),
        "zbv",
    ),
    (
        "dualpipev needs 2 pp micro-batches",
        dict(schedule="dualpipev", pp_degree=2, virtual_stages=2, num_micro_batches=3),
        "dualpipev",
    ),
    (
        "zero-bubble on one rank",
        dict(schedule="interleaved-zb", pp_degree=1, virtual_stages=2),
        "interleaved-zb",
    ),
    (
        "interleaved micro-batches torch cannot round",
        dict(schedule="interleaved-1f1b", pp_degree=2, virtual_stages=2, num_micro_batches=5),
        "num_micro_batches",
    ),
    (
        "one-stage schedule with virtual stages",
        dict(schedule="gpipe", pp_degree=2, virtual_stages=2),
        "gpipe",
    ),
]


@pytest.mark.parametrize(("label", "edit", "fragment"), CASES, ids=[c[0] for c in CASES])
def test_schedule_that_cannot_express_the_cuts(
    tmp_path: Path, label: str, edit: dict[str, Any], fragment: str
) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(_plan_data(**edit)))
    with pytest.raises(PlanError) as info:
        Plan.from_yaml(path)
    message = str(info.value)
    assert fragment in message, message
    assert "\n" not in message
    # the error names the fix
    assert "use" in message or "set" in message or "raise" in message, message
