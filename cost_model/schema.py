"""Strict conversion between frozen dataclasses and plain YAML data.

Used by every file format autoplan reads (Cluster, Plan, calibration profiles). Guarantees:
unknown keys, missing keys, wrong types and bad values raise `SchemaError` naming the field
path (``stages[2].first_unit``), the value and the expected form; ``load(dump(x)) == x``.
A field may accept numbers with units (``80GiB``) by declaring ``metadata={"unit": ...}``.

`read_yaml` reads bounded input: a file of at most `MAX_FILE_BYTES`, at most `MAX_NODES` YAML
nodes nested at most `MAX_DEPTH` deep, no aliases (``*a``: PyYAML expands them into shared
references, so a 1 KB file of nested aliases is billions of values when walked or printed),
numbers of at most `MAX_NUMBER_CHARS` characters that neither overflow nor underflow a float;
`from_data` takes strings of at most `MAX_STRING_CHARS` characters. Messages show a user's
value through `shown` (about 80 characters at most).
"""

from __future__ import annotations

import dataclasses
import math
import os
import stat
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar, get_args, get_origin

import yaml

from cost_model.errors import SchemaError
from cost_model.files import atomic_write_text, probe_folder
from cost_model.messages import SHOWN_LIMIT
from cost_model.messages import shown as shown
from cost_model.units import Dimension, parse_quantity

T = TypeVar("T")

# Plan and cluster files are a few KB (a plan for 4,096 layers split into 4,096 stages is about
# 250 KB and 30,000 nodes, nested 4 deep): these bounds are generous and keep a hostile file
# to about a second of parsing and a few MB of memory.
MAX_FILE_BYTES = 2**20
MAX_NODES = 100_000
MAX_DEPTH = 20
MAX_NUMBER_CHARS = 100
# A name, spec or description (a model spec naming every field of a builder is ~300).
MAX_STRING_CHARS = 1000
# A path in a message: a path is the user's own and bounded by the OS (PATH_MAX), so more of
# it is shown than of other values.
PATH_LIMIT = 160


def unit_field(dimension: Dimension, **kwargs: Any) -> Any:
    """A dataclass field that accepts quantities with units of ``dimension`` in YAML."""
    return dataclasses.field(metadata={"unit": dimension}, **kwargs)


def from_data(cls: type[T], data: object, where: str = "") -> T:
    """Build dataclass ``cls`` from plain data, checking every key and type."""
    if not isinstance(data, Mapping):
        raise SchemaError(
            f"{_at(where)}expected a mapping of keys for {cls.__name__}, got {shown(data)}"
        )
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise SchemaError(
            f"{_at(where)}unknown key {shown(unknown[0])} for {cls.__name__}; "
            f"valid keys: {', '.join(fields)}"
        )
    kwargs: dict[str, Any] = {}
    for name, field in fields.items():
        path = f"{where}.{name}" if where else name
        if name not in data:
            required = (
                field.default is dataclasses.MISSING
                and field.default_factory is dataclasses.MISSING
            )
            if required:
                raise SchemaError(f"missing required key {path!r} for {cls.__name__}")
            continue
        kwargs[name] = _convert(hints[name], data[name], path, field.metadata.get("unit"))
    try:
        return cls(**kwargs)
    except SchemaError:
        raise
    except (ValueError, TypeError) as error:
        raise SchemaError(f"{_at(where)}{error}") from None


def to_data(obj: object) -> Any:
    """Plain data (dicts, lists, scalars) for a dataclass tree, keys in field order."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_data(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (tuple, list)):
        return [to_data(item) for item in obj]
    if isinstance(obj, Mapping):
        return {str(k): to_data(v) for k, v in obj.items()}
    return obj


class _Refused(yaml.MarkedYAMLError):
    """A document `read_yaml` refuses (an alias, too deep, too many nodes, a bad number):
    ``problem`` is the message's middle, ``fix`` its end."""

    def __init__(self, problem: str, fix: str, mark: yaml.Mark | None) -> None:
        super().__init__(problem=problem, problem_mark=mark)
        self.fix = fix


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader with the bounds of `read_yaml`, refusing a key given twice in one
    mapping (the safe loader keeps the last one silently: a hand edit that adds
    ``dp_degree: 4`` under ``dp_degree: 2``)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0

    def _next_event(self) -> Any:
        return self.peek_event()  # type: ignore[no-untyped-call]

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            event = self._next_event()
            raise _Refused(
                f"uses a YAML alias (*{shown(event.anchor, 40, quoted=False)})",
                "write the value out (these files take no anchors or aliases)",
                event.start_mark,
            )
        self._nodes += 1
        if self._nodes > MAX_NODES:
            raise _Refused(
                f"has more than {MAX_NODES:,} values (scalars, lists and mappings)",
                "is it the right file?",
                self._next_event().start_mark,
            )
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _Refused(
                    f"nests lists or mappings more than {MAX_DEPTH} deep",
                    "check the brackets and the indentation (these files nest 4 deep)",
                    self._next_event().start_mark,
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)):
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {shown(key)} is given twice; keep one", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)

    def construct_bounded_int(self, node: yaml.ScalarNode) -> int:
        _check_number_text(node)
        value: int = super().construct_yaml_int(node)
        return value

    def construct_bounded_float(self, node: yaml.ScalarNode) -> float:
        text = _check_number_text(node)
        value: float = super().construct_yaml_float(node)
        mantissa = text.lower().partition("e")[0]
        if value == 0 and any(digit in mantissa for digit in "123456789"):
            raise _Refused(
                f"has {text}, which is too small for a number (it would read as 0)",
                "write 0 or a number from about 2.2e-308 to 1.8e308 (check its unit)",
                node.start_mark,
            )
        if math.isinf(value) and ".inf" not in text.lower():
            raise _Refused(
                f"has {text}, which is too large for a number",
                "write a number from about 2.2e-308 to 1.8e308 (check its unit)",
                node.start_mark,
            )
        return value


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_bounded_int)
_BoundedLoader.add_constructor("tag:yaml.org,2002:float", _BoundedLoader.construct_bounded_float)


def _check_number_text(node: yaml.ScalarNode) -> str:
    """The text of a number node, refused when longer than `MAX_NUMBER_CHARS` (Python reads
    at most 4,300 digits into an int and no field needs more than 20)."""
    text = str(node.value)
    if len(text) > MAX_NUMBER_CHARS:
        raise _Refused(
            f"has a number of {len(text):,} characters ({text[:20]}...)",
            f"numbers have at most {MAX_NUMBER_CHARS} characters",
            node.start_mark,
        )
    return text


def read_yaml(path: str | Path, what: str) -> object:
    """Parse a YAML file within the bounds above; a missing, unreadable, oversized or refused
    file or bad syntax raises SchemaError naming the file."""
    path = Path(path)
    name = shown(str(path), PATH_LIMIT)
    if "\x00" in str(path):
        raise SchemaError(f"{what} file {name} contains a NUL byte; pass a YAML file")
    too_big = (
        f"{what} files are at most {MAX_FILE_BYTES:,} bytes (1 MiB; they are a few KB): "
        "is it the right file?"
    )
    try:
        status = path.stat()
        if stat.S_ISDIR(status.st_mode):
            raise SchemaError(f"{what} file {name} is a directory; pass a YAML file")
        if not stat.S_ISREG(status.st_mode):  # /dev/zero would be read for ever
            raise SchemaError(f"{what} file {name} is not a regular file; pass a YAML file")
        size = status.st_size
        if size > MAX_FILE_BYTES:
            raise SchemaError(f"{what} file {name} is {size:,} bytes; {too_big}")
        with path.open("rb") as file:
            raw = file.read(MAX_FILE_BYTES + 1)  # the file may have grown since stat
        if len(raw) > MAX_FILE_BYTES:
            raise SchemaError(f"{what} file {name} is over {MAX_FILE_BYTES:,} bytes; {too_big}")
        text = raw.decode("utf-8")
    except FileNotFoundError:
        raise SchemaError(f"{what} file {name} does not exist") from None
    except UnicodeDecodeError as error:
        raise SchemaError(
            f"{what} file {name} is not UTF-8 text (byte {error.start}); pass a YAML file"
        ) from None
    except OSError as error:
        raise SchemaError(f"cannot read {what} file {name}: {error.strerror}") from None
    if not text.strip():
        raise SchemaError(f"{what} file {name} is empty")
    try:
        loaded = yaml.load(text, Loader=_BoundedLoader)  # a SafeLoader
    except _Refused as error:
        mark = error.problem_mark
        line = f" at line {mark.line + 1}" if mark is not None else ""
        raise SchemaError(f"{what} file {name} {error.problem}{line}; {error.fix}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = f" at line {mark.line + 1}" if mark is not None else ""
        problem = str(getattr(error, "problem", None) or "syntax error")
        if len(problem) > 2 * SHOWN_LIMIT:  # PyYAML's problems quote tags and anchors whole
            problem = problem[: 2 * SHOWN_LIMIT - 3] + "..."
        raise SchemaError(f"{what} file {name} is not valid YAML{line}: {problem}") from None
    if loaded is None:
        raise SchemaError(f"{what} file {name} is empty (only comments)")
    return loaded


def check_writable(path: str | Path, what: str, *, create_folder: bool = False) -> None:
    """Fail before any work when ``path`` cannot be written: it is a folder, its folder is
    missing (created instead with ``create_folder``) or read-only. Raises SchemaError."""
    target = Path(path)
    if target.is_dir():
        raise SchemaError(f"{what} {str(target)!r} is a directory; give a file path")
    folder = target.parent
    if create_folder:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise SchemaError(
                f"{what} {str(target)!r}: cannot create folder {str(folder)!r}: {error.strerror}"
            ) from None
    if not folder.is_dir():
        raise SchemaError(
            f"{what} {str(target)!r}: folder {str(folder)!r} does not exist; create it"
        )
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise SchemaError(f"{what} {str(target)!r} is not writable; choose another path")
    # os.access says yes for root where the file system says no (/proc, a read-only mount):
    # create what an atomic write creates, a temporary file in the folder, and remove it
    try:
        probe_folder(target)
    except OSError as error:
        raise SchemaError(
            f"{what} {str(target)!r} is not writable ({error.strerror}); choose another path"
        ) from None


def write_yaml(path: str | Path, data: object, header: str = "") -> None:
    """Write plain data as block-style YAML, keys in the given order, atomically: the old
    file stays whole when writing fails (`cost_model.files.OutputFileError`)."""
    text = yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True)
    atomic_write_text(path, header + text)


def check_schema_version(data: object, supported: int, what: str) -> dict[str, Any]:
    """Check and strip ``schema_version``; returns the remaining mapping."""
    if not isinstance(data, Mapping):
        raise SchemaError(f"{what} must be a mapping of keys, got {type(data).__name__}")
    body = dict(data)
    version = body.pop("schema_version", None)
    if version is None:
        raise SchemaError(f"{what} has no 'schema_version'; add 'schema_version: {supported}'")
    # `True == 1` and `1.0 == 1` in Python: the type is checked first
    if type(version) is not int or version != supported:
        kind = "" if type(version) is int else f" (a {type(version).__name__}, not a number)"
        raise SchemaError(
            f"{what} has schema_version {shown(version)}{kind}; this autoplan reads version "
            f"{supported}: write 'schema_version: {supported}'"
        )
    return body


def _at(where: str) -> str:
    return f"{where}: " if where else ""


def _key_path(path: str, key: object) -> str:
    """``peak_flops.fp32``; a long or odd key is shown quoted and shortened."""
    if isinstance(key, str) and len(key) <= SHOWN_LIMIT // 2 and key.isprintable() and key:
        return f"{path}.{key}"
    return f"{path}[{shown(key, SHOWN_LIMIT // 2)}]"


def _convert(hint: Any, value: object, path: str, unit: Dimension | None) -> Any:
    origin = get_origin(hint)
    args = get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _convert(inner[0], value, path, unit)
        raise AssertionError(f"unsupported union {hint} at {path}")
    if origin is typing.Literal:
        if value not in args:
            choices = ", ".join(repr(a) for a in args)
            raise SchemaError(f"{path}: {shown(value)} is not one of {choices}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise SchemaError(f"{path}: expected a list, got {shown(value)}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{path}[{i}]", unit) for i, v in enumerate(value))
        if len(args) != len(value):
            raise SchemaError(f"{path}: expected a list of {len(args)} items, got {shown(value)}")
        return tuple(
            _convert(a, v, f"{path}[{i}]", unit)
            for i, (a, v) in enumerate(zip(args, value, strict=True))
        )
    if origin in (dict, Mapping) or origin is typing.Mapping:
        if not isinstance(value, Mapping):
            raise SchemaError(f"{path}: expected a mapping, got {shown(value)}")
        key_type, value_type = args
        return {
            _convert(key_type, k, _key_path(path, k), None): _convert(
                value_type, v, _key_path(path, k), unit
            )
            for k, v in value.items()
        }
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return from_data(hint, value, path)
    if hint is bool:
        if not isinstance(value, bool):
            raise SchemaError(f"{path}: expected true or false, got {shown(value)}")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise SchemaError(f"{path}: expected a string, got {shown(value)}")
        if len(value) > MAX_STRING_CHARS:
            raise SchemaError(
                f"{path}: {shown(value, SHOWN_LIMIT // 2)} is too long; a name or a description "
                f"has at most {MAX_STRING_CHARS:,} characters"
            )
        return value
    if hint in (int, float):
        return _number(hint, value, path, unit)
    if hint is Any or hint is object:
        return value
    raise AssertionError(f"unsupported type {hint} at {path}")


def _number(hint: type, value: object, path: str, unit: Dimension | None) -> int | float:
    if isinstance(value, bool):
        raise SchemaError(f"{path}: expected a number, got {shown(value)}")
    if isinstance(value, str):
        try:
            number = parse_quantity(value, unit or "number")
        except ValueError as error:
            raise SchemaError(f"{path}: {error}") from None
    elif isinstance(value, (int, float)):
        number = value
    else:
        raise SchemaError(f"{path}: expected a number, got {shown(value)}")
    if not math.isfinite(number):
        raise SchemaError(f"{path}: expected a finite number, got {shown(value)}")
    if hint is int and unit == "bytes" and isinstance(value, str):
        return round(number)  # "2.2GiB" is not a whole number of bytes: the nearest one
    if hint is int and isinstance(number, int):
        return number  # exact: float(number) would round a 17-digit count
    if hint is int:
        if float(number) != int(number):
            raise SchemaError(f"{path}: expected a whole number, got {shown(value)}")
        return int(number)
    return float(number)
