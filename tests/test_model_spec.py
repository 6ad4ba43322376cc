"""`autoplan.models.spec`: ``NAME[:key=value,...]`` to zoo models, and one-line errors."""

from __future__ import annotations

import pytest
import torch

from autoplan.contract.errors import InputError, ModelSpecError
from autoplan.models import GPT, Llama, list_presets
from autoplan.models.spec import build_model, parse_model_spec, valid_keys


def test_presets_and_overrides() -> None:
    spec = parse_model_spec("llama3-8b:seq_len=4096")
    assert spec.name == "llama3-8b" and dict(spec.overrides) == {"seq_len": 4096}
    model = build_model(spec)
    assert isinstance(model, Llama)
    assert model.config.seq_len == 4096 and model.config.num_kv_heads == 8
    assert next(model.parameters()).is_meta
    assert isinstance(build_model("gpt3-175b:num_layers=2"), GPT)


def test_builder_with_typed_values() -> None:
    model = build_model(
        "gpt:num_layers=24,hidden_size=2304,num_heads=24,seq_len=2048,vocab_size=51200,"
        "dropout=0.1,tie_embeddings=false,dtype=bf16"
    )
    assert isinstance(model, GPT)
    config = model.config
    assert (config.num_layers, config.hidden_size, config.num_heads) == (24, 2304, 24)
    assert (config.seq_len, config.vocab_size, config.ffn_hidden_size) == (2048, 51200, 9216)
    assert config.dropout == 0.1 and config.tie_embeddings is False
    assert next(model.parameters()).dtype == torch.bfloat16
    llama = build_model(
        "llama: num_layers=2, hidden_size=64, num_heads=4, seq_len=32, vocab_size=128"
    )
    assert isinstance(llama, Llama) and llama.config.num_kv_heads == 4


def test_extra_overrides_merge_or_conflict() -> None:
    model = build_model("gpt2-small", num_layers=2)
    assert model.config.num_layers == 2
    assert build_model("gpt2-small:num_layers=2", num_layers=2).config.num_layers == 2
    with pytest.raises(ModelSpecError, match="contradicts num_layers=2"):
        build_model("gpt2-small:num_layers=2", num_layers=3)


@pytest.mark.parametrize(
    ("spec", "fragments"),
    [
        ("", ["empty model spec", "gpt3-175b"]),
        ("gpt4", ["unknown model 'gpt4'", "llama3-405b", "builders with their sizes: gpt:..."]),
        ("llama3-8b:foo=1", ["unknown key 'foo'", "valid keys:", "seq_len", "num_kv_heads"]),
        ("gpt2-small:num_layers", ["cannot read 'num_layers'", "key=value"]),
        ("gpt2-small:num_layers=abc", ["num_layers=abc", "a whole number"]),
        ("gpt2-small:dropout=x", ["dropout=x", "a number"]),
        ("gpt2-small:tie_embeddings=maybe", ["true or false"]),
        ("gpt2-small:dtype=int8", ["a dtype", "bf16"]),
        ("gpt2-small:num_layers=2,num_layers=3", ["appears twice"]),
        ("gpt:num_layers=2,hidden_size=64", ["needs num_layers", "missing: num_heads, seq_len"]),
    ],
)
def test_bad_specs_say_what_is_valid(spec: str, fragments: list[str]) -> None:
    with pytest.raises(ModelSpecError) as caught:
        build_model(spec)
    message = str(caught.value)
    assert isinstance(caught.value, InputError)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_zoo_validation_errors_pass_through() -> None:
    with pytest.raises(ModelSpecError, match="divisible by num_heads"):
        build_model("gpt:num_layers=1,hidden_size=65,num_heads=4,seq_len=8,vocab_size=16")


def test_valid_keys_cover_every_preset() -> None:
    for name in list_presets():
        keys = valid_keys(name)
        assert {"num_layers", "hidden_size", "seq_len", "vocab_size", "dtype"} <= set(keys)
