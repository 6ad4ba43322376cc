"""``--model hf:PATH``: a Hugging Face causal LM from a local config.json, built on meta by
transformers, through ``trace``, ``plan``, ``estimate`` and ``whatif``; each bad config refused
in one line; near misses of model and cluster names answered with "did you mean"."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from autoplan.contract.errors import ModelSpecError
from autoplan.models.spec import build_model
from autoplan.tracing import trace
from tests.conftest import run_cli

transformers = pytest.importorskip("transformers")

S, H, HEADS, V = 32, 64, 4, 128
CLUSTER = "local:devices_per_node=2"


def _llama_config() -> Any:
    return transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=2,
        intermediate_size=256, vocab_size=V, max_position_embeddings=S,
    )  # fmt: skip


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with a tiny Llama's config.json, as transformers writes it (no weights)."""
    folder = tmp_path_factory.mktemp("hf-llama")
    _llama_config().save_pretrained(folder)
    return folder


def _json(*args: str) -> dict[str, Any]:
    result = run_cli(*args, "--json")
    assert result.returncode == 0, result.stderr
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def _one_line_error(args: tuple[str, ...], *fragments: str) -> str:
    result = run_cli(*args)
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autoplan: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def test_trace_builds_the_config_as_transformers_does(llama_dir: Path) -> None:
    """The spec's model is the one transformers builds from that config in Python: the same
    graph (fingerprint) and parameter count; a folder and its config.json name the same."""
    with torch.device("meta"):
        reference = trace(transformers.LlamaForCausalLM(_llama_config()))
    data = _json("trace", "--model", f"hf:{llama_dir}")
    assert data["model"] == f"hf:{llama_dir}"
    assert data["front_end"] == "export"
    assert data["fingerprint"] == reference.profile.fingerprint
    assert data["totals"]["num_params"] == reference.profile.num_params
    assert (data["seq_len"], data["num_units"], data["num_kv_heads"]) == (S, 4, 2)
    # keys: the sequence length to plan for and config fields (a third block)
    short = _json(
        "trace", "--model", f"hf:{llama_dir / 'config.json'}:seq_len=16,num_hidden_layers=3"
    )
    assert (short["seq_len"], short["num_units"]) == (16, 5)


@pytest.fixture(scope="module")
def planned(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """``autoplan plan`` on the spec: the spec and the plan file it wrote."""
    spec = f"hf:{llama_dir}"
    out = tmp_path_factory.mktemp("hf-plan") / "plan.yaml"
    plan = _json(
        "plan", "--model", spec, "--cluster", CLUSTER, "--global-batch", "4", "--budget", "5",
        "-o", str(out),
    )  # fmt: skip
    assert plan["model"] == spec and plan["num_devices"] == 2
    assert plan["plans"][0]["estimate"]["step_time_s"] > 0
    return spec, out


def test_plan_estimate_and_whatif_take_the_spec(planned: tuple[str, Path]) -> None:
    spec, out = planned
    assert f"name: {spec}" in out.read_text()  # the plan names its model, for explain
    # autoplan's runtime keeps a torch.export graph in fp32 (its dtype limit): --dtype fp32
    estimate = _json(
        "estimate", "--model", f"{spec}:seq_len=16", "--cluster", CLUSTER, "--tp", "2",
        "--global-batch", "4", "--dtype", "fp32",
    )  # fmt: skip
    assert estimate["step_time_s"] > 0
    whatif = _json(
        "whatif", "--model", spec, "--cluster", "local", "--num-devices", "1,2",
        "--global-batch", "4", "--budget", "5",
    )  # fmt: skip
    rows = whatif["rows"]
    assert [(r["num_devices"], r["fits"]) for r in rows] == [(1, True), (2, True)]


@pytest.mark.parametrize(
    ("content", "fragments"),
    [
        (None, ["no such file", "hf:PATH takes a Hugging Face config.json"]),
        ("", ["is a folder without a config.json"]),
        ('{"model_type": "llama",', ["is not JSON", "line 1"]),
        ('{"hidden_size": 8}', ["has no model_type"]),
        (
            '{"model_type": "lama"}',
            ["model_type 'lama'", "is not a model type transformers", "did you mean llama?"],
        ),
        (
            '{"model_type": "vit"}',
            ["model_type 'vit'", "has no causal-LM class", "AutoModelForCausalLM"],
        ),
        (
            '{"model_type": "x", "auto_map": {"AutoConfig": "x.XConfig"}}',
            ["needs its repository's own code (auto_map)"],
        ),
    ],
)
def test_a_bad_config_is_one_line(
    content: str | None, fragments: list[str], tmp_path: Path
) -> None:
    """``content`` is the folder's config.json (None: no folder; empty: no file in it)."""
    folder = tmp_path / "model"
    if content is not None:
        folder.mkdir()
        if content:
            (folder / "config.json").write_text(content)
    _one_line_error(("trace", "--model", f"hf:{folder}"), *fragments)


def test_a_config_transformers_cannot_build_is_one_line(llama_dir: Path) -> None:
    """transformers' own validation (hidden size a multiple of the heads) names the field."""
    _one_line_error(
        ("estimate", "--model", f"hf:{llama_dir}:hidden_size=65", "--cluster", CLUSTER,
         "--global-batch", "4"),
        "cannot build a causal LM", "hidden size (65) is not a multiple",
    )  # fmt: skip
    _one_line_error(
        ("trace", "--model", f"hf:{llama_dir}:hiden_size=8"),
        "unknown key 'hiden_size'", "did you mean hidden_size?",
    )  # fmt: skip


def test_without_transformers_the_spec_names_the_extra(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # what `import` finds uninstalled
    with pytest.raises(ModelSpecError, match=r"needs Hugging Face transformers.*autoplan\[hf\]"):
        build_model(f"hf:{llama_dir}")


def test_export_refuses_a_hugging_face_model(planned: tuple[str, Path]) -> None:
    """An export restates the model's sizes from a zoo config, which an hf: model lacks."""
    _, plan = planned
    _one_line_error(("export", str(plan), "--to", "torchtitan"), "is a Hugging Face config.json")


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (("trace", "--model", "gpt3-157b"), ["unknown model 'gpt3-157b'; did you mean gpt3-175b"]),
        (("trace", "--model", "x/config.json"), ["did you mean hf:x/config.json?"]),
        (
            (
                "estimate",
                "--model",
                "gpt2-small",
                "--cluster",
                "dgx-a100-8g",
                "--global-batch",
                "8",
            ),
            ["unknown cluster preset 'dgx-a100-8g'; did you mean dgx-a100-80g"],
        ),
        (
            ("cluster", "show", "h100"),
            ["unknown cluster preset 'h100'; did you mean dgx-h100-80g?"],
        ),
    ],
)
def test_a_near_miss_gets_did_you_mean(args: tuple[str, ...], fragments: list[str]) -> None:
    _one_line_error(args, *fragments)
