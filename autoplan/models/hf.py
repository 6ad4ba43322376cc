"""Hugging Face causal LMs from a local ``config.json`` (``--model hf:PATH``), on the meta device.

``PATH`` is a ``config.json`` file or a folder that holds one. Nothing is downloaded and no weights
are read: transformers builds the config's ``AutoModelForCausalLM`` class under
``torch.device("meta")``, and `autoplan.trace` traces it as any Hugging Face model (the
torch.export front end). `autoplan.models.spec` parses the spec; this module reads the file
(`config_file`, `read_config`) and builds the model (`build_causal_lm`).

Every mistake raises `ModelSpecError` (an `InputError`: one line, exit code 2 in the CLI) naming
the value, the rule and the fix: a missing file, JSON that does not parse, a config without a
``model_type`` transformers knows, one that needs the repository's own code (``auto_map``), one
whose model type has no causal-LM class, one transformers cannot build, and transformers not
installed (the ``hf`` extra).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from autoplan.contract.errors import ModelSpecError
from cost_model.messages import did_you_mean, shown

__all__ = ["build_causal_lm", "config_file", "read_config"]

_EXTRA = "pip install 'autoplan[hf]' (or transformers>=4.40)"
# the layer-count keys of Hugging Face configs (Llama's family, GPT-2, BLOOM/Falcon)
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
# the zoo's bound (autoplan.models._common.MAX_SIZE): tracing is linear in the layers
_MAX_LAYERS = 4096


def config_file(spec: str, path: str) -> Path:
    """The ``config.json`` that ``path`` names: the file itself, or the one in that folder."""
    if not path:
        raise ModelSpecError(
            f"model spec {shown(spec)} names no file; write hf:PATH with PATH a Hugging Face "
            "config.json or a folder holding one"
        )
    found = Path(path).expanduser()
    if found.is_dir():
        found = found / "config.json"
        if not found.is_file():
            raise ModelSpecError(
                f"{shown(path)} in model spec {shown(spec)} is a folder without a config.json; "
                "hf:PATH takes a Hugging Face config.json or a folder holding one"
            )
    elif not found.is_file():
        raise ModelSpecError(
            f"{shown(path)} in model spec {shown(spec)}: no such file; hf:PATH takes a Hugging "
            "Face config.json (or a folder holding one): check the path"
        )
    return found


def read_config(spec: str, file: Path) -> dict[str, Any]:
    """The JSON object in ``file``, with a ``model_type`` (the key transformers dispatches on)."""
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except OSError as error:
        raise ModelSpecError(
            f"cannot read {shown(str(file))} of model spec {shown(spec)}: {error.strerror}"
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        where = (
            f" ({error.msg}, line {error.lineno})"
            if isinstance(error, json.JSONDecodeError)
            else ""
        )
        raise ModelSpecError(
            f"{shown(str(file))} of model spec {shown(spec)} is not JSON{where}; hf:PATH takes "
            "a Hugging Face config.json as transformers writes it (save_pretrained)"
        ) from None
    if not isinstance(data, dict):
        raise ModelSpecError(
            f"{shown(str(file))} of model spec {shown(spec)} holds a JSON "
            f"{type(data).__name__}, not an object; give a Hugging Face config.json"
        )
    if not isinstance(data.get("model_type"), str):
        raise ModelSpecError(
            f"{shown(str(file))} of model spec {shown(spec)} has no model_type (the key "
            "transformers picks the model class by); give a config.json written by "
            'transformers, which has one (e.g. "model_type": "llama")'
        )
    return data


@contextlib.contextmanager
def _quiet_optional_imports() -> Iterator[None]:
    """transformers imports torchao where it is installed (its quantizer): torchao logs each
    native library its wheel cannot load here and torch's pytree warns of the enums torchao
    registers, lines on a user's stderr about code a meta build never runs. Errors still show."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _transformers(spec: str) -> ModuleType:
    try:
        with _quiet_optional_imports():
            return importlib.import_module("transformers")
    except ImportError:
        raise ModelSpecError(
            f"model spec {shown(spec)} needs Hugging Face transformers, which is not installed; "
            f"{_EXTRA}"
        ) from None


def _check_model_type(spec: str, file: Path, data: Mapping[str, Any], version: str) -> None:
    """A model type that transformers knows, without custom code, with a causal-LM class."""
    auto = importlib.import_module("transformers.models.auto.configuration_auto")
    causal = importlib.import_module("transformers.models.auto.modeling_auto")
    known: Mapping[str, str] = auto.CONFIG_MAPPING_NAMES
    causal_types: Mapping[str, str] = causal.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    model_type = data["model_type"]
    if "auto_map" in data:
        raise ModelSpecError(
            f"{shown(str(file))} of model spec {shown(spec)} needs its repository's own code "
            "(auto_map), which autoplan does not run; give the config of a model type "
            f"transformers {version} ships"
        )
    if model_type not in known:
        raise ModelSpecError(
            f"model_type {shown(model_type)} in {shown(str(file))} is not a model type "
            f"transformers {version} knows; {did_you_mean(model_type, known, n=1)}give a "
            "config.json of a model type it ships, or upgrade transformers"
        )
    if model_type not in causal_types:
        raise ModelSpecError(
            f"model_type {shown(model_type)} in {shown(str(file))} has no causal-LM class in "
            f"transformers {version} (AutoModelForCausalLM); autoplan plans causal LMs: give "
            "the config.json of one (llama, mistral, qwen2, gpt2, ...)"
        )


def _one_line(error: BaseException) -> str:
    """The error's text on one line (transformers' validators wrap the reason in a header)."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return shown(text.rstrip(".") or type(error).__name__, limit=240, quoted=False)


def build_causal_lm(
    spec: str,
    file: Path,
    data: Mapping[str, Any],
    *,
    dtype: torch.dtype | None = None,
    seq_len: int | None = None,
) -> nn.Module:
    """Build the causal LM that config ``data`` (read from ``file``) describes, on meta.

    ``dtype`` converts the built model (default: the dtype transformers builds from the config);
    ``seq_len`` becomes ``config.seq_len``, the sequence length `autoplan.trace` plans for
    (default: the config's ``max_position_embeddings``).
    """
    transformers = _transformers(spec)
    version = str(transformers.__version__)
    _check_model_type(spec, file, data, version)
    layers = next((data[k] for k in _LAYER_KEYS if isinstance(data.get(k), int)), None)
    if layers is not None and layers > _MAX_LAYERS:
        raise ModelSpecError(
            f"{shown(str(file))} of model spec {shown(spec)} has {layers:,} layers, more than "
            f"the {_MAX_LAYERS:,} autoplan traces (the largest published models have ~130); "
            "check the config"
        )
    auto = importlib.import_module("transformers.models.auto.configuration_auto")
    config_class = auto.CONFIG_MAPPING[data["model_type"]]
    try:
        # what AutoConfig.from_pretrained does with a local file, without resolving a hub name
        config = config_class.from_dict(dict(data))
        if seq_len is not None:
            config.seq_len = seq_len
        with torch.device("meta"), _quiet_optional_imports():
            model = transformers.AutoModelForCausalLM.from_config(config)
    except Exception as e:  # whatever transformers raises on a config it refuses
        raise ModelSpecError(
            f"transformers {version} cannot build a causal LM from {shown(str(file))} of model "
            f"spec {shown(spec)}: {type(e).__name__}: {_one_line(e)}; fix that field of the "
            "config"
        ) from None
    assert isinstance(model, nn.Module), type(model)  # transformers' own contract
    return model.to(dtype) if dtype is not None else model
