"""Writing an export's files into a folder (``autoplan export -o DIR``) without harming the
user's own files.

Expects the files an exporter made (name -> text, plain names without folders). Guarantees:

- every file is written atomically (`cost_model.files`): a failed write leaves the old file;
- a symbolic link in the folder is never followed nor replaced: the export is refused with one
  line naming it (the folder itself may be a link: it is the user's own path);
- a file is replaced only when autoplan wrote it: the folder's manifest `MANIFEST` records
  the SHA-256 of each file export wrote last; a file whose content matches neither that record
  nor the new content (hand-edited, or someone else's) is refused with one line naming it and
  the fix, unless ``force``;
- nothing is written when any file is refused, and a file that already holds the new content
  is left untouched, so the same export twice succeeds and changes nothing;
- the manifest is written last; a manifest that cannot be read counts as empty (files then
  need the same content or ``force``).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cost_model.files import OutputFileError, atomic_write_text
from cost_model.messages import shown

__all__ = ["MANIFEST", "ExportWrite", "write_export"]

logger = logging.getLogger(__name__)

MANIFEST = ".autoplan-export.json"
_MANIFEST_FORMAT = 1
_MANIFEST_MAX_BYTES = 2**20  # a manifest lists a few files: ~100 bytes each
_PATH_LIMIT = 160
_OPTION = "-o/--output"


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportWrite:
    """What `write_export` did: the paths of the export's files (in the exporter's order),
    those it wrote now and those that already held the same content."""

    paths: tuple[Path, ...]
    written: tuple[Path, ...]
    unchanged: tuple[Path, ...]


def write_export(
    directory: str | Path, files: Mapping[str, str], *, force: bool = False
) -> ExportWrite:
    """Write ``files`` into ``directory`` (created if missing) as the module docstring says.

    Raises `OutputFileError`: exit code 2 for a refusal (a link, a file export did not write,
    a path that is not a folder), 1 when the machine fails the write (disk full)."""
    folder = Path(directory)
    _make_folder(folder)
    manifest_path = folder / MANIFEST
    _refuse_link(manifest_path)
    recorded = _read_manifest(manifest_path)
    digests = {name: _digest(text.encode("utf-8")) for name, text in files.items()}
    todo: list[str] = []
    unchanged: list[str] = []
    foreign: list[str] = []
    for name in files:
        assert name and "/" not in name and name not in (".", "..", MANIFEST), name
        path = folder / name
        _refuse_link(path)
        current = _current_digest(path)
        if current == digests[name]:
            unchanged.append(name)
        elif current is None or current == recorded.get(name) or force:
            todo.append(name)
        else:
            foreign.append(name)
    if foreign:
        more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
        raise OutputFileError(
            f"{_OPTION}: {_shown(folder / foreign[0])}{more} was not written by autoplan export "
            "or was edited since; pass --force to replace it, or choose another folder"
        )
    for name in todo:
        atomic_write_text(folder / name, files[name], what=_OPTION, follow_symlinks=False)
    kept = {
        name: digest
        for name, digest in recorded.items()
        if name not in files and _current_digest_or_none(folder / name) == digest
    }
    manifest = {
        "about": "files autoplan export wrote here, with their SHA-256; export replaces a file "
        "only while it still has this content (or with --force)",
        "format": _MANIFEST_FORMAT,
        "files": dict(sorted({**kept, **digests}.items())),
    }
    text = json.dumps(manifest, indent=2) + "\n"
    if todo or _current_digest(manifest_path) != _digest(text.encode("utf-8")):
        atomic_write_text(manifest_path, text, what=_OPTION, follow_symlinks=False)
    return ExportWrite(
        paths=tuple(folder / name for name in files),
        written=tuple(folder / name for name in todo),
        unchanged=tuple(folder / name for name in unchanged),
    )


def _make_folder(folder: Path) -> None:
    if folder.exists() and not folder.is_dir():
        raise OutputFileError(
            f"{_OPTION} {_shown(folder)} is a file; give a folder to write the export into"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OutputFileError.from_os_error(folder, error, what=_OPTION) from None


def _refuse_link(path: Path) -> None:
    """A link, or anything but a regular file, at ``path`` is refused (missing is fine)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as error:
        raise OutputFileError.from_os_error(path, error, what=_OPTION) from None
    if stat.S_ISLNK(mode):
        raise OutputFileError(
            f"{_OPTION}: {_shown(path)} is a symbolic link (to "
            f"{shown(os.readlink(path), _PATH_LIMIT // 2)}); export does not write through or "
            "replace links: remove the link or choose another folder",
            code=errno.ELOOP,
        )
    if not stat.S_ISREG(mode):
        raise OutputFileError(
            f"{_OPTION}: {_shown(path)} exists and is not a regular file; remove it or choose "
            "another folder"
        )


def _read_manifest(path: Path) -> dict[str, str]:
    """The recorded digests; {} for a missing, oversized or unreadable manifest."""
    try:
        with open(path, "rb") as stream:
            raw = stream.read(_MANIFEST_MAX_BYTES + 1)
    except FileNotFoundError:
        return {}
    except OSError as error:
        raise OutputFileError(
            f"{_OPTION}: cannot read {_shown(path)} ({error.strerror}); fix its permissions or "
            "choose another folder"
        ) from None
    try:
        if len(raw) > _MANIFEST_MAX_BYTES:
            raise ValueError("too large")
        data = json.loads(raw)
        entries = data["files"]
        if not isinstance(entries, dict):
            raise ValueError("files is not a mapping")
        return {
            str(name): digest
            for name, digest in entries.items()
            if isinstance(digest, str) and digest.startswith("sha256:")
        }
    except (ValueError, KeyError, TypeError) as error:
        logger.warning(
            "ignoring the export manifest %s (%s): files in the folder count as not written "
            "by autoplan",
            path,
            error,
        )
        return {}


def _current_digest(path: Path) -> str | None:
    """The digest of the regular file at ``path``, None if it does not exist."""
    try:
        with open(path, "rb") as stream:
            return "sha256:" + hashlib.file_digest(stream, "sha256").hexdigest()
    except FileNotFoundError:
        return None
    except OSError as error:
        raise OutputFileError(
            f"{_OPTION}: cannot read {_shown(path)} ({error.strerror}) to check who wrote it; "
            "fix its permissions or choose another folder"
        ) from None


def _current_digest_or_none(path: Path) -> str | None:
    if os.path.islink(path) or not path.is_file():
        return None
    try:
        return _current_digest(path)
    except OutputFileError:
        return None


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _shown(path: Path) -> str:
    return shown(str(path), _PATH_LIMIT)
