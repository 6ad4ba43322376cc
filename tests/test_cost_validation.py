"""The published-run benchmark on a few held-out rows: the calibration still predicts them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import validate_published


@pytest.mark.slow
def test_held_out_published_runs_within_15_percent(capsys: pytest.CaptureFixture[str]) -> None:
    """Narayanan et al. 2021 Table 1 (1.7B, data parallel only) and Korthikanti et al. 2022
    Table 5 (22B, TP 8, full recompute) are held out; the fitted 22B selective row must stay
    on its fit. About 10 s: traces a 24-layer and a 48-layer model on meta."""
    validate_published.main(["--only", "megatron-sc21-t1-1.7b,korthikanti-t5-22b", "--json"])
    rows = {row["id"]: row for row in json.loads(capsys.readouterr().out)["rows"]}
    assert set(rows) == {
        "megatron-sc21-t1-1.7b",
        "korthikanti-t5-22b-full-recompute",
        "korthikanti-t5-22b-selective-sp",
    }
    for row in rows.values():
        assert abs(row["error"]) < 0.15, row
        assert row["fits"], row
    assert abs(rows["korthikanti-t5-22b-selective-sp"]["error"]) < 0.02


@pytest.mark.slow
def test_held_out_published_runs_stay_where_they_are(capsys: pytest.CaptureFixture[str]) -> None:
    """The whole benchmark (about 15 s), as a regression guard on what it shows today: the runs
    from papers (Megatron-LM, BLOOM, torchtitan) all within 25% with median within 5%; every
    held-out row's median, MosaicML's FSDP sweep included, within 5% (issue 4's aim; its 25% max
    is not met by that sweep, see docs/cost-model.md). The BLOOM rows carry the inter-node rate
    measured on their cluster (bench/data/validation_assumptions.yaml)."""
    validate_published.main(["--json"])
    rows = [r for r in json.loads(capsys.readouterr().out)["rows"] if r["status"] == "held_out"]
    papers = sorted(abs(r["error"]) for r in rows if not r["id"].startswith("llmfoundry-"))
    every = sorted(abs(r["error"]) for r in rows)
    assert len(papers) >= 40 and len(every) >= 200
    assert papers[-1] <= 0.25, papers[-5:]
    assert papers[len(papers) // 2] <= 0.05  # 3.5% today
    assert every[len(every) // 2] <= 0.05  # 3.0% today
    assert sum(e > 0.25 for e in every) <= 6, every[-10:]  # 5 today (docs/cost-model.md)
    published, assumptions = validate_published.load()
    cases = [
        validate_published.build_case(row, assumptions)
        for row in published
        if row["id"].startswith("bloom-176b")
    ]
    assert len(cases) == 3
    for case in cases:
        assert isinstance(case, validate_published.Case)
        inter = case.cluster.inter_node
        assert inter.bandwidth_bytes_per_s == pytest.approx(135e9 / 8 / 8)
        assert case.cluster.calibration.inter_node_comm_efficiency == 1.0
