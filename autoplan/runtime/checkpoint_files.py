"""The files of a checkpoint folder, for `autoplan.runtime.checkpoint`: the marker, each file's
size and SHA-256, the checks of a saved checkpoint against them, the comparison of a saved
model's tensor shapes with this one's, fsynced writes, and one-line reasons for errors.

The marker, ``DIR/step_00000100/autoplan.json``, holds the step, the model fingerprint and
every model tensor's full shape, the plan digest, the world size, the caller's ``run`` facts,
the earliest non-finite step, the job that wrote it, and each file's size and SHA-256, all
under a checksum of its own (`marker_bytes`).

Expects paths on a file system every rank sees; nothing here talks to other ranks (the caller
splits the work and gathers the verdicts). Guarantees:

- `read_marker` gives a marker only when it is whole: JSON, named by its folder's step, and (in
  format 2) matching its own checksum, with a file list and the model's shapes; otherwise one
  line saying why. A marker of format 1 (neither ``format`` nor ``checksum``) is given as is.
- `hash_written` hashes exactly the files one rank wrote (DCP names them per rank; rank 0 also
  takes ``.metadata``), so the ranks together hash each file once; `check_files` names each
  file that is missing, truncated, resized or fails its SHA-256.
- `model_mismatch` names, tensor by tensor, what changed between a saved model and this one
  (or its fingerprint when the shapes agree).
- `write_synced` and `fsync_folder` return once the data and the folder entry are on disk (a
  file system that refuses to fsync a folder is let be).
- `reason` turns any error into one line of at most `SHOWN` characters (DCP's per-rank
  failures unwrapped, an OS error by its message and errno name); `folder_problem` says why a
  rank cannot write into a folder.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from autoplan.contract.errors import InputError
from cost_model.messages import shown

__all__ = [
    "MARKER",
    "SHOWN",
    "CheckpointError",
    "check_files",
    "folder_problem",
    "fsync_folder",
    "hash_written",
    "marker_bytes",
    "model_mismatch",
    "read_marker",
    "reason",
    "step_dirs",
    "tensor_shapes",
    "write_synced",
]

_STEP_DIR = re.compile(r"^step_(\d{8})$")
MARKER = "autoplan.json"
_METADATA = ".metadata"  # DCP's, written by its coordinator (rank 0)
SHOWN = 160  # characters of a path or reason in a message


# here, in the lowest layer, so that `checkpoint_lock` can raise it too; exported by
# `autoplan.runtime.checkpoint`
class CheckpointError(InputError):
    """A checkpoint folder that cannot be used (another model, a file, in use by another job,
    unwritable, a bad interval)."""


def marker_bytes(marker: Mapping[str, Any]) -> bytes:
    """The marker's text: ``marker`` and a SHA-256 of its canonical form."""
    body = {key: value for key, value in marker.items() if key != "checksum"}
    return (json.dumps({**body, "checksum": _canonical_digest(body)}, indent=1) + "\n").encode()


def _canonical_digest(body: Mapping[str, Any]) -> str:
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def read_marker(folder: Path) -> tuple[dict[str, Any] | None, str | None]:
    """``(marker, None)`` for a whole marker of ``folder``, or ``(None, why not)``."""
    path = folder / MARKER
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None, f"{MARKER} is missing (the job stopped while saving it)"
    except OSError as error:
        return None, f"{MARKER} cannot be read ({reason(error)})"
    try:
        marker = json.loads(raw)
    except (ValueError, RecursionError) as error:
        return None, f"{MARKER} is damaged (not JSON: {error})"
    if not isinstance(marker, dict):
        return None, f"{MARKER} is damaged (not a JSON object)"
    if "format" in marker or "checksum" in marker:  # format 1 had neither
        saved = marker.pop("checksum", None)
        if saved != _canonical_digest(marker):
            return None, f"{MARKER} is damaged (its checksum does not match its content)"
        if not isinstance(marker.get("files"), dict) or not all(
            isinstance(record, dict) for record in marker["files"].values()
        ):
            return None, f"{MARKER} is damaged (no file list)"
        shapes = marker.get("model_state")
        if not isinstance(shapes, dict) or not all(
            isinstance(shape, list) and all(isinstance(size, int) for size in shape)
            for shape in shapes.values()
        ):
            return None, f"{MARKER} is damaged (no model shapes)"
    step = _STEP_DIR.match(folder.name)
    if step is not None and marker.get("step") != int(step.group(1)):
        return None, f"{MARKER} is damaged (it names step {shown(marker.get('step'))})"
    return marker, None


def hash_written(staging: Path, metadata: Any, rank: int, world_size: int) -> dict[str, Any]:
    """Size and SHA-256 of the files this rank wrote into ``staging``: DCP names them
    ``__<rank>_<n>.distcp`` (torch/distributed/checkpoint/filesystem.py, ``_StoragePrefix``);
    rank 0 also takes DCP's ``.metadata`` and any file named otherwise."""
    names = {getattr(info, "relative_path", None) for info in metadata.storage_data.values()}
    names.discard(None)
    prefixes = tuple(f"__{r}_" for r in range(world_size))
    mine = []
    for name in sorted(str(n) for n in names):
        writer = next((r for r, p in enumerate(prefixes) if name.startswith(p)), 0)
        if writer == rank:
            mine.append(name)
    if rank == 0:
        mine.append(_METADATA)
    files = {}
    for name in mine:
        size, digest = _file_digest(staging / name)
        files[name] = {"size": size, "sha256": digest, "rank": rank}
    return files


def _file_digest(path: Path) -> tuple[int, str]:
    with path.open("rb") as stream:
        digest = hashlib.file_digest(stream, "sha256").hexdigest()
        return stream.tell(), digest


def check_files(
    folder: Path, files: Mapping[str, Any], names: Sequence[str]
) -> list[tuple[str, str]]:
    """``(name, what is wrong)`` for each of ``names`` that differs from its record."""
    problems = []
    for name in names:
        record = files[name]
        path = folder / name
        try:
            size = path.stat().st_size
            expected = record.get("size")
            if size != expected:
                how = "truncated" if isinstance(expected, int) and size < expected else "resized"
                problems.append((name, f"is damaged ({how}: {size} bytes of {expected} written)"))
                continue
            if _file_digest(path)[1] != record.get("sha256"):
                problems.append((name, "is damaged (fails its SHA-256 checksum)"))
        except FileNotFoundError:
            problems.append((name, "is missing"))
        except OSError as error:
            problems.append((name, f"cannot be read ({reason(error)})"))
    return problems


def tensor_shapes(model_state: Mapping[str, Any]) -> dict[str, list[int]]:
    """Each tensor's full shape (a DTensor's ``shape`` is its global one)."""
    return {
        name: list(value.shape)
        for name, value in model_state.items()
        if isinstance(value, torch.Tensor)
    }


def model_mismatch(
    path: Path, marker: Mapping[str, Any], shapes: Mapping[str, list[int]], fingerprint: str
) -> str | None:
    """The one-line error for a checkpoint of another model, or None."""
    saved: dict[str, list[int]] | None = marker.get("model_state")
    if saved is None:  # format 1: its DCP metadata has the shapes
        saved = _metadata_shapes(path)
    changes = _model_changes(saved, shapes) if saved is not None else []
    saved_fingerprint = str(marker.get("model_fingerprint", ""))
    if not changes and not (fingerprint and saved_fingerprint and saved_fingerprint != fingerprint):
        return None
    if changes:
        what = ", ".join(changes[:3]) + (
            f", and {len(changes) - 3} more" if len(changes) > 3 else ""
        )
    else:
        what = (
            f"the same parameter shapes, but another structure or sequence length (fingerprint "
            f"{saved_fingerprint}, this model's {fingerprint})"
        )
    return (
        f"checkpoint {path} is of another model: {what}; point --checkpoint-dir at this model's "
        "checkpoints or at an empty folder, or build the model the checkpoint was saved from"
    )


def _model_changes(saved: Mapping[str, list[int]], now: Mapping[str, list[int]]) -> list[str]:
    """What differs, tensor by tensor: changed shapes first (``"h.0.q.weight (64, 64) now
    (128, 64)"``, in the checkpoint's order), then tensors gone, then new ones."""
    changed = [
        f"{name} {_shape_text(shape)} now {_shape_text(now[name])}"
        for name, shape in saved.items()
        if name in now and list(now[name]) != list(shape)
    ]
    gone = [f"{name} {_shape_text(shape)} gone" for name, shape in saved.items() if name not in now]
    new = [f"{name} {_shape_text(shape)} new" for name, shape in now.items() if name not in saved]
    return changed + gone + new


def _shape_text(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(size) for size in shape) + ("," if len(shape) == 1 else "") + ")"


def _metadata_shapes(path: Path) -> dict[str, list[int]] | None:
    """The model tensors' shapes in a checkpoint's DCP metadata (None: unreadable)."""
    try:
        metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception:
        return None
    return {
        key[len("model.") :]: list(value.size)
        for key, value in metadata.items()
        if key.startswith("model.") and isinstance(value, TensorStorageMetadata)
    }


def step_dirs(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_dir() and _STEP_DIR.match(p.name))


def write_synced(path: Path, data: bytes) -> None:
    with path.open("wb") as stream:
        stream.write(data)
        stream.flush()
        os.fsync(stream.fileno())


def fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as error:  # some file systems refuse to fsync a folder (EINVAL)
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def reason(error: BaseException) -> str:
    """One line for what went wrong: DCP's per-rank failures unwrapped, an OS error by its
    message and errno name."""
    if isinstance(error, CheckpointException):
        for rank, failure in sorted(error.failures.items()):
            inner = failure[0] if isinstance(failure, tuple) else failure
            return f"{reason(inner)} on rank {rank}"
    if isinstance(error, OSError) and error.strerror:
        name = errno.errorcode.get(error.errno or 0)
        where = f" ({Path(str(error.filename)).name})" if error.filename else ""
        return f"{error.strerror}" + (f" ({name})" if name else "") + where
    cause = error.__cause__ or error.__context__
    if isinstance(cause, OSError) and cause.strerror:
        return reason(cause)
    text = " ".join(str(error).split()) or type(error).__name__
    if type(error).__name__ not in text:
        text = f"{type(error).__name__}: {text}"
    return shown(text, SHOWN, quoted=False)


def folder_problem(directory: Path, rank: int) -> str | None:
    """Why this rank cannot save into ``directory`` (None: it can)."""
    shown_dir = shown(str(directory), SHOWN)
    try:
        if directory.exists() and not directory.is_dir():
            return (
                f"checkpoint folder {shown_dir} is a file, not a folder: pass a folder (it is "
                "created if missing), or move the file away"
            )
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".autoplan-write-test-{rank}-{uuid.uuid4().hex}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        return (
            f"checkpoint folder {shown_dir} is not writable ({error.strerror or error}); "
            "pass a folder this job can write to"
        )
    return None
