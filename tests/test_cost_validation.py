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
def test_every_held_out_published_run_meets_the_target(capsys: pytest.CaptureFixture[str]) -> None:
    """The whole benchmark (about 10 s): every held-out row within 25% and their median within
    10% (issue 4's target), and the BLOOM rows priced at the inter-node rate measured on their
    cluster (bench/data/validation_assumptions.yaml), 135 Gb/s a node of 8 GPUs."""
    validate_published.main(["--json"])
    rows = json.loads(capsys.readouterr().out)["rows"]
    held_out = sorted(abs(row["error"]) for row in rows if row["status"] == "held_out")
    assert len(held_out) >= 40
    assert held_out[-1] <= 0.25, held_out[-5:]
    assert held_out[len(held_out) // 2] <= 0.10
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
