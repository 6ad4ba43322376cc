"""Files written whole or not at all.

Every file autoplan writes for a user (plans, cluster files, pictures, export configs,
calibration results) goes through this module. Expects a path whose folder exists.
Guarantees: the content goes to a temporary file in the same folder (named
``.NAME.<random>.tmp<suffix>``), which is flushed and fsynced, then renamed over ``path``
(rename is atomic on POSIX), and the folder is fsynced so the rename survives a crash. A reader
sees the old file or the new one, never a part. On any failure (disk full, permission, a file
size limit, ...) the temporary file is removed, the old file is left byte for byte, and
`OutputFileError` is raised with one line naming the path and the reason.

A symlink at ``path`` is followed (the file it points to is replaced, as ``open(path, "w")``
would); ``follow_symlinks=False`` replaces the link itself instead (``autoplan export``,
which also refuses links before it writes). A replaced file keeps its permission bits; a new
file gets the process's umask.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

from cost_model.errors import InputError
from cost_model.messages import shown

logger = logging.getLogger(__name__)

__all__ = [
    "OutputFileError",
    "atomic_output",
    "atomic_write_bytes",
    "atomic_write_text",
    "is_temporary",
    "probe_folder",
]

# errno -> (reason, fix, exit code): 1 for a failure of the run (the machine), 2 for a path
# the user can change.
_REASONS: dict[int, tuple[str, str, int]] = {
    errno.ENOSPC: ("the disk is full", "free space or choose another path", 1),
    errno.EDQUOT: ("the disk quota is used up", "free space or choose another path", 1),
    errno.EFBIG: (
        "the file is larger than this process may write (file size limit, ulimit -f)",
        "raise the limit or choose another path",
        1,
    ),
    errno.EIO: ("an I/O error on the device", "check the disk or choose another path", 1),
    errno.EACCES: ("permission denied", "choose a folder you can write to", 2),
    errno.EPERM: ("operation not permitted", "choose a folder you can write to", 2),
    errno.EROFS: ("the file system is read-only", "choose a writable folder", 2),
    errno.ENOENT: ("its folder does not exist", "create the folder first", 2),
    errno.ENOTDIR: ("a part of the path is not a folder", "fix the path", 2),
    errno.EISDIR: ("it is a directory", "give a file path", 2),
    errno.ENAMETOOLONG: ("the name is too long", "choose a shorter path", 2),
    errno.ELOOP: ("too many levels of symbolic links", "fix the links or the path", 2),
    errno.EXDEV: ("the file is on another file system than its folder", "fix the path", 2),
}
_PATH_LIMIT = 160
_TMP_MARK = ".tmp"


class OutputFileError(InputError):
    """A file could not be written; the old file (if any) is unchanged.

    The message is one line naming the path, the reason and the fix. ``exit_code`` is 1 when
    the machine failed the run (disk full, a size limit, an I/O error) and 2 when the path is
    the problem (permission, a missing folder, a read-only file system); the CLI exits with it.
    ``errno`` is the underlying OS error number, or None for a refusal that is not one.
    """

    def __init__(self, message: str, *, exit_code: int = 2, code: int | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.errno = code

    @classmethod
    def from_os_error(cls, path: str | Path, error: OSError, *, what: str = "") -> OutputFileError:
        """The one-line error for ``error`` met while writing ``path``."""
        code = error.errno or 0
        reason, fix, exit_code = _REASONS.get(
            code, (error.strerror or str(error) or type(error).__name__, "choose another path", 1)
        )
        name = errno.errorcode.get(code)
        label = f"{what} " if what else ""
        return cls(
            f"cannot write {label}{shown(str(path), _PATH_LIMIT)}: {reason}"
            + (f" ({name})" if name else "")
            + f"; the old file, if any, is unchanged; {fix}",
            exit_code=exit_code,
            code=code or None,
        )


def atomic_write_bytes(
    path: str | Path, data: bytes, *, what: str = "", follow_symlinks: bool = True
) -> None:
    """Replace ``path`` with ``data`` atomically (see the module docstring). ``what`` names the
    file in messages (``"-o/--output"``); ``follow_symlinks=False`` replaces a symlink at
    ``path`` itself instead of the file it points to. Raises `OutputFileError`."""
    with atomic_output(path, what=what, follow_symlinks=follow_symlinks) as temporary:
        try:
            with open(temporary, "wb") as stream:
                stream.write(data)
        except OSError as error:
            raise OutputFileError.from_os_error(path, error, what=what) from None


def atomic_write_text(
    path: str | Path, text: str, *, what: str = "", follow_symlinks: bool = True
) -> None:
    """`atomic_write_bytes` of ``text`` in UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"), what=what, follow_symlinks=follow_symlinks)


@contextlib.contextmanager
def atomic_output(
    path: str | Path, *, what: str = "", follow_symlinks: bool = True
) -> Iterator[Path]:
    """Yield an empty temporary file in ``path``'s folder, with ``path``'s suffix (writers such
    as matplotlib's ``savefig`` infer the format from it), for the caller to write by path.

    When the block ends normally the file is fsynced and renamed over ``path`` and the folder
    fsynced; when it raises (or writing fails), the temporary file is removed and the old
    ``path`` is untouched. An `OSError` from the block becomes `OutputFileError`; any other
    exception passes through after the clean-up. With ``follow_symlinks=False`` a symlink at
    ``path`` is replaced by the new file, never written through (its folder may be a link).
    """
    shown_path = Path(path)
    if follow_symlinks:
        target = Path(os.path.realpath(path))  # write where a symlink points, as open() would
    else:
        target = Path(os.path.realpath(shown_path.parent)) / shown_path.name
    if target.is_dir() and not target.is_symlink():
        raise OutputFileError.from_os_error(
            shown_path, IsADirectoryError(errno.EISDIR, "Is a directory"), what=what
        )
    try:
        temporary = _create_temporary(target)
    except OSError as error:
        raise OutputFileError.from_os_error(shown_path, error, what=what) from None
    done = False
    try:
        try:
            yield temporary
            _keep_mode(target, temporary)
            _fsync_file(temporary)
            os.replace(temporary, target)
            done = True
        except OSError as error:
            raise OutputFileError.from_os_error(shown_path, error, what=what) from None
    finally:
        if not done:
            with contextlib.suppress(OSError):
                temporary.unlink()
    _fsync_folder(target.parent)


def probe_folder(path: str | Path) -> None:
    """Create and remove a temporary file next to ``path`` (as an atomic write would): raises
    the `OSError` of a folder that cannot take one, even where ``os.access`` says yes (root on
    a read-only mount or /proc)."""
    os.unlink(_create_temporary(Path(os.path.realpath(path))))


def is_temporary(path: str | Path) -> bool:
    """Whether ``path`` is named like one of this module's temporary files (for clean-up
    checks and tests)."""
    name = Path(path).name
    return name.startswith(".") and _TMP_MARK in name


def _create_temporary(target: Path) -> Path:
    """A new empty file next to ``target``, created exclusively (mode 0o666 less the umask)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    # a name of at most 255 bytes: keep the start of a long file name
    stem = target.name[:200]
    for _ in range(100):
        candidate = target.with_name(f".{stem}.{secrets.token_hex(4)}{_TMP_MARK}{target.suffix}")
        try:
            os.close(os.open(candidate, flags, 0o666))
        except FileExistsError:
            continue
        return candidate
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(target))


def _keep_mode(target: Path, temporary: Path) -> None:
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        return
    os.chmod(temporary, mode)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_folder(folder: Path) -> None:
    """Make the rename durable. The new file is in place already: a folder that cannot be
    fsynced (some file systems refuse, EINVAL) is logged, not an error."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            logger.warning("could not fsync folder %s after a rename: %s", folder, error)
