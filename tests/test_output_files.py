"""Files autoplan writes are written whole or not at all (`cost_model.files`), and `export -o`
never writes through a link nor replaces a file it did not write (`autoplan.export.writing`).

A full disk is real: the CLI runs in a subprocess whose file size limit (RLIMIT_FSIZE) is
below the size of what it writes, with SIGXFSZ ignored, so the write fails with EFBIG as a full
file system fails with ENOSPC, part-way through. A read-only folder is real too: tests run as
root, whom a mode of 0o555 does not stop, so the subprocess drops CAP_DAC_OVERRIDE from its
capability bounding set first (Linux prctl(PR_CAPBSET_DROP)); as a non-root user the mode
alone stops it.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from autoplan.export.writing import MANIFEST, write_export
from cost_model.files import OutputFileError, atomic_output, atomic_write_text, is_temporary
from cost_model.messages import shown
from tests.conftest import run_cli, shared_by_workers

ROOT = Path(__file__).resolve().parent.parent
PLAN_ARGS = ("--model", "gpt2-small", "--cluster", "dgx-a100-80g", "--global-batch", "8")
LIMIT_BYTES = 512  # below every file written here: a plan is ~800 bytes, a picture ~25 KB

_PR_CAPBSET_DROP = 24  # <linux/prctl.h>
_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH = 1, 2  # <linux/capability.h>


def _full_disk() -> None:
    """In the child before exec: writes past `LIMIT_BYTES` fail with EFBIG (an ignored
    SIGXFSZ and the limit both survive exec)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT_BYTES, LIMIT_BYTES))


def _no_dac_override() -> None:
    """In the child before exec: file modes bind even root (the capability is gone after exec)."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _can_drop_capabilities() -> bool:
    if os.geteuid() != 0:
        return True
    probe = subprocess.run([sys.executable, "-c", "pass"], preexec_fn=_no_dac_override, check=False)
    return probe.returncode == 0


def _run(
    args: Sequence[str], cwd: Path, preexec: Callable[[], None] | None = None
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, COLUMNS="120", NO_COLOR="1", PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=env,
        preexec_fn=preexec,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _autoplan(
    *args: str, cwd: Path, preexec: Callable[[], None] | None = None
) -> subprocess.CompletedProcess[str]:
    return _run(["-m", "autoplan", *args], cwd, preexec)


def _error_line(result: subprocess.CompletedProcess[str], code: int) -> str:
    """The run failed with ``code``, no traceback and exactly one error line (progress lines
    on stderr are allowed); returns that line."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, result.stderr
    assert errors[0].startswith("autoplan: error: "), result.stderr
    assert result.stderr.strip().splitlines()[-1] == errors[0]
    return errors[0]


def _leftovers(folder: Path) -> list[str]:
    """Temporary files left behind, and empty files (a write that failed in place)."""
    return [
        p.name
        for p in folder.iterdir()
        if is_temporary(p) or (p.is_file() and not p.stat().st_size)
    ]


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """A plan made by the real command line (the file every CLI test here starts from, and
    none writes): made once for every worker that runs one of them (~15 s)."""

    def make(folder: Path) -> Path:
        result = _autoplan("plan", *PLAN_ARGS, "--budget", "1", "-o", "plan.yaml", cwd=folder)
        assert result.returncode == 0, result.stderr
        return folder / "plan.yaml"

    path = shared_by_workers(tmp_path_factory, worker_id, "planned", make)
    assert path.read_text().startswith("# autoplan plan")
    return path


# ------------------------------------------------------------------------------ the writer


def test_a_write_replaces_the_file_whole_and_keeps_its_mode(tmp_path: Path) -> None:
    path = tmp_path / "out.yaml"
    atomic_write_text(path, "first\n")
    assert path.read_text() == "first\n"
    path.chmod(0o640)
    atomic_write_text(path, "second\n")
    assert path.read_text() == "second\n" and (path.stat().st_mode & 0o777) == 0o640
    # a link is written through by default (as open() would), or replaced when told not to
    elsewhere = tmp_path / "elsewhere.yaml"
    elsewhere.write_text("theirs\n")
    link = tmp_path / "link.yaml"
    link.symlink_to(elsewhere)
    atomic_write_text(link, "through\n")
    assert link.is_symlink() and elsewhere.read_text() == "through\n"
    atomic_write_text(link, "replaced\n", follow_symlinks=False)
    assert not link.is_symlink() and link.read_text() == "replaced\n"
    assert elsewhere.read_text() == "through\n"
    assert _leftovers(tmp_path) == []


def test_a_failed_writer_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "picture.png"
    path.write_bytes(b"old picture")
    with pytest.raises(ZeroDivisionError), atomic_output(path) as temporary:
        assert temporary.parent == tmp_path and temporary.suffix == ".png"
        temporary.write_bytes(b"half a pict")
        _ = 1 / 0
    with pytest.raises(OutputFileError) as raised, atomic_output(path, what="--plot") as temporary:
        temporary.write_bytes(b"half")
        raise OSError(28, "No space left on device")  # ENOSPC as a writer would raise it
    assert path.read_bytes() == b"old picture"
    assert _leftovers(tmp_path) == []
    message = str(raised.value)
    assert message.startswith(f"cannot write --plot {str(path)!r}: the disk is full (ENOSPC)")
    assert raised.value.exit_code == 1 and "\n" not in message
    # a folder that does not exist is the user's path: exit 2
    with pytest.raises(OutputFileError, match="its folder does not exist") as missing:
        atomic_write_text(tmp_path / "no" / "such.yaml", "x")
    assert missing.value.exit_code == 2


_LIBRARY_ON_A_FULL_DISK = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from cost_model.files import OutputFileError, atomic_output, atomic_write_text
    from autoplan.export.writing import write_export

    folder = Path(sys.argv[1])
    results = {}

    def picture(path):
        with atomic_output(path) as temporary:  # as savefig writes: by path
            temporary.write_bytes(b"x" * 5000)

    for name, write in [
        ("old.yaml", lambda path: atomic_write_text(path, "new " * 1000)),
        ("new.yaml", lambda path: atomic_write_text(path, "new " * 1000)),
        ("old.png", picture),
        ("export", lambda path: write_export(path, {"ds_config.json": "{}" * 1000})),
    ]:
        try:
            write(folder / name)
            results[name] = None
        except OutputFileError as error:
            results[name] = [str(error), error.exit_code, error.errno]
    print(json.dumps(results))
    """
)


def test_on_a_full_disk_the_writer_fails_in_one_line_and_keeps_the_old_file(
    tmp_path: Path,
) -> None:
    (tmp_path / "old.yaml").write_text("old plan\n")
    (tmp_path / "old.png").write_bytes(b"old picture")
    write_export(tmp_path / "export", {"ds_config.json": "{}\n"})
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    result = _run(["-c", _LIBRARY_ON_A_FULL_DISK, str(tmp_path)], tmp_path, _full_disk)
    assert result.returncode == 0, result.stderr
    failures = json.loads(result.stdout)
    for name, failure in failures.items():
        assert failure is not None, f"{name}: the write past the size limit did not fail"
        message, exit_code, code = failure
        assert "(EFBIG)" in message and str(tmp_path / name) in message, message
        assert exit_code == 1 and code == 27, failure  # EFBIG: a failure of the run
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before  # old files byte for byte, no new file, the manifest as it was
    assert _leftovers(tmp_path) == [] and _leftovers(tmp_path / "export") == []


_LIBRARY_READ_ONLY = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from cost_model.files import OutputFileError, atomic_write_text
    try:
        atomic_write_text(Path(sys.argv[1]) / "plan.yaml", "new plan")
        print(json.dumps(None))
    except OutputFileError as error:
        print(json.dumps([str(error), error.exit_code]))
    """
)


@pytest.mark.skipif(not _can_drop_capabilities(), reason="cannot drop CAP_DAC_OVERRIDE here")
def test_a_read_only_folder_is_refused_and_keeps_the_old_file(
    tmp_path: Path, plan_file: Path
) -> None:
    folder = tmp_path / "read-only"
    folder.mkdir()
    old = folder / "plan.yaml"
    old.write_text("old plan\n")
    folder.chmod(0o555)
    try:
        result = _run(["-c", _LIBRARY_READ_ONLY, str(folder)], tmp_path, _no_dac_override)
        assert result.returncode == 0, result.stderr
        message, exit_code = json.loads(result.stdout)
        assert "permission denied (EACCES)" in message and exit_code == 2, message
        # the CLI checks before the search: a user's path, exit 2
        cli = _autoplan("plan", *PLAN_ARGS, "-o", str(old), cwd=tmp_path, preexec=_no_dac_override)
        line = _error_line(cli, 2)
        assert f"-o/--output {str(old)!r} is not writable" in line, line
        assert old.read_text() == "old plan\n" and _leftovers(folder) == []
    finally:
        folder.chmod(0o755)


# ------------------------------------------------------------------ the CLI on a full disk


def test_plan_on_a_full_disk_keeps_the_old_plan(tmp_path: Path, plan_file: Path) -> None:
    old = tmp_path / "existing.yaml"
    old.write_bytes(plan_file.read_bytes() + b"# the old plan\n")
    before = old.read_bytes()
    result = _autoplan(
        "plan", *PLAN_ARGS, "--budget", "1", "-o", "existing.yaml", cwd=tmp_path, preexec=_full_disk
    )
    line = _error_line(result, 1)
    assert "cannot write 'existing.yaml':" in line and "(EFBIG)" in line, line
    assert "the old file, if any, is unchanged" in line
    assert old.read_bytes() == before
    assert _leftovers(tmp_path) == []


def test_timeline_on_a_full_disk_leaves_no_file(tmp_path: Path, plan_file: Path) -> None:
    result = _autoplan(
        "explain", str(plan_file), "--timeline", "timeline.png", cwd=tmp_path, preexec=_full_disk
    )
    line = _error_line(result, 1)
    assert "cannot write --timeline 'timeline.png':" in line and "(EFBIG)" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no 0-byte picture, no temporary


def test_plot_on_a_full_disk_keeps_the_old_picture(tmp_path: Path) -> None:
    old = tmp_path / "whatif.png"
    old.write_bytes(b"\x89PNG the old picture")
    result = _autoplan(
        "whatif",
        "--model",
        "gpt2-small",
        "--cluster",
        "dgx-a100-80g",
        "--num-devices",
        "8",
        "--global-batch",
        "8",
        "--budget",
        "1",
        "--plot",
        "whatif.png",
        cwd=tmp_path,
        preexec=_full_disk,
    )
    line = _error_line(result, 1)
    assert "cannot write --plot 'whatif.png':" in line and "(EFBIG)" in line, line
    assert old.read_bytes() == b"\x89PNG the old picture"
    assert _leftovers(tmp_path) == []


# ------------------------------------------------------------------------------ export -o


def _sha256(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def test_export_replaces_only_what_it_wrote(tmp_path: Path) -> None:
    out = tmp_path / "launch"
    files = {"a.json": "{}\n", "b.txt": "--num-layers 2\n"}
    first = write_export(out, files)
    assert first.written == (out / "a.json", out / "b.txt") and first.unchanged == ()
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["files"] == {"a.json": _sha256(out / "a.json"), "b.txt": _sha256(out / "b.txt")}
    stamp = (out / MANIFEST).stat().st_mtime_ns
    # the same export again: nothing to do, nothing touched
    again = write_export(out, files)
    assert again.written == () and again.unchanged == first.written
    assert (out / MANIFEST).stat().st_mtime_ns == stamp
    # a new export over files it wrote: replaced
    changed = write_export(out, {"a.json": '{"x": 1}\n', "b.txt": "--num-layers 2\n"})
    assert changed.written == (out / "a.json",) and (out / "a.json").read_text() == '{"x": 1}\n'
    # a hand edit is the user's: refused, and nothing is written (b.txt neither)
    (out / "a.json").write_text('{"x": 1, "mine": true}\n')
    with pytest.raises(OutputFileError) as raised:
        write_export(out, {"a.json": "{}\n", "b.txt": "--num-layers 4\n"})
    assert str(raised.value) == (
        f"-o/--output: {str(out / 'a.json')!r} was not written by autoplan export or was "
        "edited since; pass --force to replace it, or choose another folder"
    )
    assert raised.value.exit_code == 2
    assert (out / "a.json").read_text() == '{"x": 1, "mine": true}\n'
    assert (out / "b.txt").read_text() == "--num-layers 2\n"
    forced = write_export(out, {"a.json": "{}\n", "b.txt": "--num-layers 4\n"}, force=True)
    assert set(forced.written) == {out / "a.json", out / "b.txt"}
    assert json.loads((out / MANIFEST).read_text())["files"]["a.json"] == _sha256(out / "a.json")
    # a file of another tool's in a fresh folder: refused; the same content is accepted
    other = tmp_path / "other"
    other.mkdir()
    (other / "a.json").write_text('{"theirs": 1}\n')
    (other / "b.txt").write_text("--num-layers 2\n")
    with pytest.raises(OutputFileError, match=r"a\.json' was not written by autoplan export"):
        write_export(other, files)
    (other / "a.json").write_text("{}\n")
    assert write_export(other, files).unchanged == (other / "a.json", other / "b.txt")
    assert _leftovers(out) == [] and _leftovers(other) == []


def test_export_never_follows_or_replaces_a_link(tmp_path: Path) -> None:
    out = tmp_path / "launch"
    out.mkdir()
    victim = tmp_path / "victim.json"
    victim.write_text("outside the folder\n")
    (out / "a.json").symlink_to(victim)
    for force in (False, True):
        with pytest.raises(OutputFileError) as raised:
            write_export(out, {"a.json": "{}\n"}, force=force)
        # paths as messages show them: shortened past 160 characters, a link's target past 80
        # (pytest's tmp_path under xdist workers is long enough to be shortened)
        assert str(raised.value) == (
            f"-o/--output: {shown(str(out / 'a.json'), 160)} is a symbolic link (to "
            f"{shown(str(victim), 80)}); "
            "export does not write through or replace links: remove the link or choose another "
            "folder"
        )
    assert victim.read_text() == "outside the folder\n" and (out / "a.json").is_symlink()
    # the manifest neither (it would redirect the record of what export wrote)
    (out / "a.json").unlink()
    (out / MANIFEST).symlink_to(victim)
    with pytest.raises(OutputFileError, match="is a symbolic link"):
        write_export(out, {"a.json": "{}\n"})
    assert victim.read_text() == "outside the folder\n" and not (out / "a.json").exists()
    # the folder itself may be a link: the user's own path
    (out / MANIFEST).unlink()
    linked = tmp_path / "linked"
    linked.symlink_to(out)
    assert write_export(linked, {"a.json": "{}\n"}).written == (linked / "a.json",)
    assert (out / "a.json").read_text() == "{}\n"


def test_export_cli_refuses_an_edited_file_until_forced(tmp_path: Path, plan_file: Path) -> None:
    out = tmp_path / "launch"
    args = ("export", str(plan_file), "--to", "deepspeed", "-o", str(out))
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr
    config = out / "ds_config.json"
    assert f"wrote {config}" in first.stdout
    exported = config.read_text()
    again = run_cli(*args, "--json")  # idempotent
    assert again.returncode == 0, again.stderr
    data = json.loads(again.stdout)
    assert data["written"] == [str(config)] and data["unchanged"] == [str(config)]
    config.write_text(exported + "\n")  # a hand edit
    refused = run_cli(*args)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert lines == [
        f"autoplan: error: -o/--output: {str(config)!r} was not written by autoplan export or "
        "was edited since; pass --force to replace it, or choose another folder"
    ]
    assert config.read_text() != exported  # the user's edit is kept
    forced = run_cli(*args, "--force")
    assert forced.returncode == 0, forced.stderr
    assert config.read_text() == exported and f"wrote {config}" in forced.stdout
    assert run_cli(*args).returncode == 0
    config.unlink()
    config.symlink_to(plan_file)
    linked = run_cli(*args, "--force")
    assert linked.returncode == 2 and "is a symbolic link" in linked.stderr, linked.stderr
    assert plan_file.read_text().startswith("# autoplan plan")
