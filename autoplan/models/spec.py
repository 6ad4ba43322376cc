"""Model specs of the command line: ``NAME[:key=value,...]`` to a zoo model on the meta device.

``NAME`` is a preset (``gpt3-175b``, ``llama3-8b``, ...; see `autoplan.models.list_presets`)
or a builder (``gpt``, ``llama``, ``moe``) that needs its sizes as keys. Keys are the fields of the
model's config (``num_layers``, ``hidden_size``, ``seq_len``, ...) plus ``dtype`` (fp32, bf16,
fp16); values are parsed to the field's type. ``hf:PATH[:key=value,...]`` is a Hugging Face causal
LM from a local ``config.json`` (`autoplan.models.hf`), its keys ``seq_len`` (the sequence length
to plan for; default its ``max_position_embeddings``), ``dtype`` and the config's own scalar
fields. Examples::

    gpt3-175b
    llama3-8b:seq_len=4096
    gpt:num_layers=24,hidden_size=2304,num_heads=24,seq_len=2048,vocab_size=51200
    hf:checkpoints/llama-3-8b/config.json:seq_len=4096,num_hidden_layers=8

Every mistake raises `ModelSpecError` (an `InputError`: one line, exit code 2 in the CLI) that
names the bad part and lists what is valid.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autoplan.contract.errors import ModelSpecError
from autoplan.models import (
    GPTConfig,
    LlamaConfig,
    MoEConfig,
    gpt,
    hf,
    list_presets,
    llama,
    moe,
    preset,
    preset_config,
)
from cost_model.messages import did_you_mean
from cost_model.schema import shown

__all__ = ["BUILDERS", "ModelSpec", "build_model", "parse_model_spec", "spec_of", "valid_keys"]

BUILDERS: dict[str, tuple[Callable[..., nn.Module], type[Any]]] = {
    "gpt": (gpt, GPTConfig),
    "llama": (llama, LlamaConfig),
    "moe": (moe, MoEConfig),
}
# ``hf:PATH[:key=value,...]``: a Hugging Face causal LM from a local config.json
HF = "hf"
_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
}
_EXAMPLE = "gpt:num_layers=24,hidden_size=2304,num_heads=24,seq_len=2048,vocab_size=51200"
# a builder's own example where its required keys differ from gpt's (Mixtral 8x7B's sizes)
_EXAMPLES = {
    "moe": "moe:num_layers=32,hidden_size=4096,num_heads=32,seq_len=4096,vocab_size=32000,"
    "num_experts=8,top_k=2,moe_ffn_hidden_size=14336",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """A parsed ``NAME[:key=value,...]``: a preset or builder name and typed overrides, or
    ``hf`` with the ``config.json`` it reads (``path``)."""

    name: str
    overrides: Mapping[str, Any] = field(default_factory=dict)
    path: str | None = None

    @property
    def is_builder(self) -> bool:
        return self.name in BUILDERS

    @property
    def is_hf(self) -> bool:
        return self.name == HF


def _config_class(name: str) -> type[Any]:
    if name in BUILDERS:
        return BUILDERS[name][1]
    return type(preset_config(name))


def valid_keys(name: str) -> list[str]:
    """Keys a spec for preset or builder ``name`` accepts."""
    return [f.name for f in dataclasses.fields(_config_class(name))] + ["dtype"]


def _required_keys(name: str) -> list[str]:
    builder = BUILDERS[name][0]
    return [
        p.name
        for p in inspect.signature(builder).parameters.values()
        if p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY)
    ]


def _parse_value(spec: str, key: str, text: str, kind: str) -> Any:
    def fail(expected: str) -> ModelSpecError:
        return ModelSpecError(
            f"{key}={shown(text, quoted=False)} in model spec {shown(spec)}: expected {expected}"
        )

    if key == "dtype":
        if text.lower() not in _DTYPES:
            raise fail(f"a dtype ({', '.join(_DTYPES)})")
        return _DTYPES[text.lower()]
    if kind == "bool":
        if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise fail("true or false")
        return text.lower() in ("true", "1", "yes")
    if kind == "int":
        try:
            return int(text)
        except ValueError:
            raise fail("a whole number") from None
    if kind == "float":
        try:
            return float(text)
        except ValueError:
            raise fail("a number") from None
    return text


def parse_model_spec(spec: str) -> ModelSpec:
    """Parse ``NAME[:key=value,...]``; raises `ModelSpecError` naming the bad part."""
    name, _, rest = spec.strip().partition(":")
    name = name.strip()
    presets = list_presets()
    if not name:
        raise ModelSpecError(
            f"empty model spec {shown(spec)}; give a preset ({', '.join(presets)}) or a builder "
            f"with its sizes, e.g. {_EXAMPLE}"
        )
    if name == HF:
        return _parse_hf(spec, rest)
    if name not in BUILDERS and name not in presets:
        raise ModelSpecError(
            f"unknown model {shown(name)}; {_did_you_mean(name, presets)}valid presets: "
            f"{', '.join(presets)} (`autoplan models` describes them); builders with their "
            f"sizes: {', '.join(f'{b}:...' for b in BUILDERS)}; or hf:PATH, a Hugging Face "
            "config.json"
        )
    kinds = {f.name: str(f.type) for f in dataclasses.fields(_config_class(name))}
    keys = valid_keys(name)
    overrides: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, text = item.partition("=")
        key, text = key.strip(), text.strip()
        if not sep or not key or not text:
            raise ModelSpecError(
                f"cannot read {shown(item)} in model spec {shown(spec)}; write key=value pairs "
                f"separated by commas, e.g. {_EXAMPLE}"
            )
        if key not in keys:
            raise ModelSpecError(
                f"unknown key {shown(key)} for model {shown(name)} in {shown(spec)}; valid keys: "
                f"{', '.join(keys)}"
            )
        if key in overrides:
            raise ModelSpecError(f"key {shown(key)} appears twice in model spec {shown(spec)}")
        overrides[key] = _parse_value(spec, key, text, kinds.get(key, "str"))
    if name in BUILDERS:
        missing = [k for k in _required_keys(name) if k not in overrides]
        if missing:
            example = _EXAMPLES.get(name, _EXAMPLE)
            raise ModelSpecError(
                f"model builder {shown(name)} needs {', '.join(_required_keys(name))}; missing: "
                f"{', '.join(missing)} (e.g. {example}); optional keys: "
                f"{', '.join(k for k in keys if k not in _required_keys(name))}"
            )
    return ModelSpec(name=name, overrides=overrides)


def _did_you_mean(name: str, presets: list[str]) -> str:
    """``did you mean ...? `` for a near miss of a preset or builder, or for a path without
    its ``hf:``; empty when nothing is close."""
    if name.endswith(".json") or "/" in name:
        return f"did you mean hf:{name}? "
    return did_you_mean(name, [*presets, *BUILDERS])


def _parse_hf(spec: str, rest: str) -> ModelSpec:
    """``hf:PATH[:key=value,...]``: the file must hold a config, the keys must be its scalar
    fields (typed as the file has them), ``seq_len`` or ``dtype``."""
    path, keys_text = rest.strip(), ""
    head, sep, tail = path.rpartition(":")
    if sep and "=" in tail:
        path, keys_text = head.strip(), tail
    data = hf.read_config(spec, hf.config_file(spec, path))
    kinds = {
        key: type(value).__name__
        for key, value in data.items()
        if isinstance(value, (bool, int, float, str))
    }
    kinds.update(seq_len="int", dtype="str")
    overrides: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in keys_text.split(","))):
        key, sep, text = item.partition("=")
        key, text = key.strip(), text.strip()
        if not sep or not key or not text:
            raise ModelSpecError(
                f"cannot read {shown(item)} in model spec {shown(spec)}; write "
                "hf:PATH:key=value,... (e.g. hf:config.json:seq_len=4096,dtype=bf16)"
            )
        if key not in kinds or key == "model_type":
            raise ModelSpecError(
                f"unknown key {shown(key)} in model spec {shown(spec)}: "
                f"{did_you_mean(key, kinds, n=1)}keys are seq_len, "
                "dtype and the scalar fields of the config.json"
            )
        if key in overrides:
            raise ModelSpecError(f"key {shown(key)} appears twice in model spec {shown(spec)}")
        overrides[key] = _parse_value(spec, key, text, kinds[key])
    if overrides.get("seq_len", 1) < 1:
        raise ModelSpecError(
            f"seq_len={overrides['seq_len']} in model spec {shown(spec)}: expected a whole "
            "number >= 1"
        )
    return ModelSpec(name=HF, overrides=overrides, path=path)


def _build_hf(parsed: ModelSpec, overrides: Mapping[str, Any]) -> nn.Module:
    assert parsed.path is not None  # _parse_hf sets it
    keys = ",".join(f"{k}={_DTYPE_NAMES.get(v) or _text(v)}" for k, v in overrides.items())
    spec = f"{HF}:{parsed.path}" + (f":{keys}" if keys else "")  # the spec, for messages
    file = hf.config_file(spec, parsed.path)
    data = hf.read_config(spec, file)
    fields = {k: v for k, v in overrides.items() if k not in ("seq_len", "dtype")}
    return hf.build_causal_lm(
        spec,
        file,
        {**data, **fields},
        dtype=overrides.get("dtype"),
        seq_len=overrides.get("seq_len"),
    )


def build_model(spec: str | ModelSpec, **overrides: Any) -> nn.Module:
    """Build the model a spec names, on the meta device; ``overrides`` add config fields.

    An override that contradicts a value in the spec raises `ModelSpecError`.
    """
    parsed = parse_model_spec(spec) if isinstance(spec, str) else spec
    merged = dict(parsed.overrides)
    for key, value in overrides.items():
        if key in merged and merged[key] != value:
            raise ModelSpecError(
                f"{key} = {shown(value)} contradicts {key}={shown(merged[key])} in model spec "
                f"{shown(parsed.name)}; give it once"
            )
        merged[key] = value
    if parsed.is_hf:
        return _build_hf(parsed, merged)
    if parsed.is_builder:
        builder = BUILDERS[parsed.name][0]
        return builder(**merged)
    return preset(parsed.name, **merged)


_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def spec_of(model: nn.Module) -> str | None:
    """A spec that rebuilds ``model`` (a zoo model: the nearest preset with the fields that
    differ, or its builder with every field), checked by parsing it back; None for any other
    model. Plans record it, so that ``autoplan explain plan.yaml`` needs no ``--model``."""
    config = getattr(model, "config", None)
    builder = next((name for name, (_, kind) in BUILDERS.items() if type(config) is kind), None)
    if builder is None or config is None:
        return None
    fields = [f.name for f in dataclasses.fields(config)]
    param = next(iter(model.parameters()), None)
    dtype = _DTYPE_NAMES.get(param.dtype) if param is not None else None
    extra = [] if dtype in (None, "fp32") else [f"dtype={dtype}"]
    candidates = []
    for name in list_presets():
        base = preset_config(name)
        if type(base) is type(config):
            diff = [
                f"{key}={_text(getattr(config, key))}"
                for key in fields
                if getattr(base, key) != getattr(config, key)
            ]
            candidates.append((len(diff), name, diff))
    candidates.sort(key=lambda c: c[0])
    options = [
        f"{name}:{','.join(diff + extra)}" if diff or extra else name
        for count, name, diff in candidates[:1]
        if count <= 3
    ]
    # every field, bar a head_dim of hidden / num_heads (the builders' default)
    default_head = getattr(config, "head_dim", None) == config.hidden_size // config.num_heads
    keys = [k for k in fields if not (k == "head_dim" and default_head)]
    options.append(
        f"{builder}:" + ",".join([f"{k}={_text(getattr(config, k))}" for k in keys] + extra)
    )
    for spec in options:
        try:
            parsed = parse_model_spec(spec)
            rebuilt = _config_class(parsed.name)
            overrides = {k: v for k, v in parsed.overrides.items() if k != "dtype"}
            if parsed.is_builder:
                again = rebuilt(**overrides)
            else:
                again = preset_config(parsed.name, **overrides)
        except (ModelSpecError, TypeError, ValueError):
            continue
        if again == config:
            return spec
    return None
