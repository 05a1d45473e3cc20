"""Where a command writes its output (``-o``), and what a run does when it cannot write:
special files, links, names too long, modes kept, a full disk under ``--simulate``, and an
RLHF plan's miss that names the real gap."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest
import yaml
from test_cli import autotune

import autotune as library
from autotune.config import ConfigError
from autotune.outputs import check_output, write_new_file

ROOT = os.geteuid() == 0


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A simulated study of llama-7b with a best, to export."""
    folder = tmp_path_factory.mktemp("study")
    storage = f"sqlite:///{folder / 'study.db'}"
    done = autotune(
        *("run", "--model", "llama-7b", "--simulate", "h100-80gb", "--budget", "3m"),
        *("--storage", storage, "--json"),
        cwd=folder,
    )
    assert done.returncode == 0 and json.loads(done.stdout)["best"], done.stderr
    return storage


def _export(
    storage: str, output: str | Path, *rest: str, cwd: Path
) -> subprocess.CompletedProcess[str]:
    return autotune(
        *("export", "--model", "llama-7b", "--format", "accelerate", "--storage", storage),
        *("-o", str(output), *rest),
        cwd=cwd,
    )


def _one_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_force_never_replaces_a_device_a_fifo_or_a_link(study: str, tmp_path: Path) -> None:
    """``-o NULL --force`` (a null device) writes into the device, which stays a device; a FIFO is
    written into as a stream; a symbolic link is refused, and its target is untouched."""
    if ROOT:  # a null device of the test's own: a failure must not replace the machine's
        null = tmp_path / "null"
        os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        done = _export(study, null, "--force", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert stat.S_ISCHR(os.lstat(null).st_mode)

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE, text=True)
    done = _export(study, fifo, "--force", cwd=tmp_path)
    read, _ = reader.communicate(timeout=60)
    assert done.returncode == 0, done.stderr
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert yaml.safe_load(read)["num_processes"] == 8

    target = tmp_path / "target.json"
    target.write_text("mine\n")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    line = _one_line(_export(study, link, "--force", cwd=tmp_path))
    assert "is a symbolic link" in line and "give -o the file itself" in line
    assert link.is_symlink() and target.read_text() == "mine\n"

    line = _one_line(_export(study, tmp_path, "--force", cwd=tmp_path))
    assert "is a folder" in line


def test_a_name_too_long_is_one_line(study: str, tmp_path: Path) -> None:
    """A 300-character output name is one line naming the limit (exit 2), for export and
    report alike; nothing is left in the folder."""
    name = "x" * 300 + ".json"
    line = _one_line(_export(study, tmp_path / name, cwd=tmp_path))
    assert "File name too long" in line and "pick a shorter -o" in line
    report = autotune(
        *("report", "--model", "llama-7b", "--storage", study, "-o", "r" * 300 + ".html"),
        cwd=tmp_path,
    )
    assert "pick a shorter -o" in _one_line(report)
    assert list(tmp_path.iterdir()) == []


def test_a_name_just_within_the_limit_is_written(tmp_path: Path) -> None:
    """A name of 255 bytes (the limit of Linux file systems) is written: the temporary file
    beside it does not borrow the name."""
    path = tmp_path / ("y" * 250 + ".json")
    write_new_file(path, "{}\n")
    assert path.read_text() == "{}\n"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_force_keeps_the_replaced_files_mode(study: str, tmp_path: Path) -> None:
    """A file of mode 600 replaced with ``--force`` stays 600 (a fresh file would be 640
    under the command's umask)."""
    path = tmp_path / "accelerate.yaml"
    path.write_text("old\n")
    path.chmod(0o600)
    done = _export(study, path, "--force", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert yaml.safe_load(path.read_text())["num_processes"] == 8


def test_check_output_refuses_by_what_the_file_is(tmp_path: Path) -> None:
    """The library's check: a missing folder, an existing file without force; a new name
    and a stream pass."""
    with pytest.raises(ConfigError, match="does not exist"):
        check_output(tmp_path / "missing" / "x.json")
    existing = tmp_path / "x.json"
    existing.write_text("")
    with pytest.raises(ConfigError, match="add --force"):
        check_output(existing)
    assert check_output(existing, force=True) is False
    assert check_output(tmp_path / "new.json") is False
    assert check_output(Path("/dev/null")) is True


def test_a_full_trials_disk_under_simulate_stops_with_one_line(tmp_path: Path) -> None:
    """A simulated run whose trials folder is on a full disk stops with one line (exit 1, no
    traceback) and leaves no trial running: its claim is withdrawn, as for real ranks."""
    if not ROOT:
        pytest.skip("a full file system needs a tmpfs mount (root)")
    trials = tmp_path / "trials"
    trials.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(trials)], check=True)
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    try:
        with (trials / "filler").open("wb") as filler, pytest.raises(OSError):
            filler.write(b"x" * (1 << 20))
            filler.flush()
        done = autotune(
            *("run", "--model", "llama-7b", "--simulate", "h100-80gb", "--budget", "30m"),
            *("--storage", storage, "--trials-dir", str(trials)),
            cwd=tmp_path,
        )
    finally:
        subprocess.run(["umount", "-l", str(trials)], check=False)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 1, done.stdout + done.stderr
    said = " ".join(done.stdout.split())
    assert "No space left on device" in said and "free space there" in said
    assert "no best: the run stopped on a fault of its own" in said
    found = library.trials(storage=storage)
    assert all(m.state != "RUNNING" for study in found for m in study.measurements)
    assert all(study.measurements == [] for study in found)


def test_an_rlhf_miss_names_the_real_gap() -> None:
    """llama-70b's rollout weights (128.5 GiB) against a 30 % share of an H100 (23.89 GiB):
    the miss says how far short the share is, not one sequence's KV cache."""
    plan = library.plan_rlhf(
        "grpo", model="llama-70b", gpu="h100-80gb", gpus=8, rollout_share="0.3"
    )
    row = plan.rows[0]
    engine = row.engine
    gap = engine.weight_bytes + engine.workspace_bytes + engine.sequence_kv_bytes
    gap -= engine.share_bytes
    assert gap > 100 * 2**30
    from autotune.units import format_bytes

    assert row.miss is not None
    assert f"is {format_bytes(gap)} short" in row.miss
    assert format_bytes(engine.weight_bytes) in row.miss


ESCAPES = "m\x1b[2J\x1b]0;pwned\x07\rx"
"""A model folder's name that clears the screen, sets the window's title and rings the bell."""


def test_outside_text_reaches_the_terminal_printable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model folder named with escape sequences: every command that shows it (the run's
    lines, ``best``, ``trials``, ``plan``, ``export`` and ``report``'s lines) writes each
    control character out (``\\x1b``), on stdout and stderr alike; none reaches the terminal."""
    from autotune.models import resolve_model
    from tests.test_bad_input import run_main

    folder = tmp_path / ESCAPES
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dict(resolve_model("tiny").config)))
    storage = ("--storage", f"sqlite:///{tmp_path / 'study.db'}")
    commands = (
        ("run", "--model", str(folder), "--simulate", "h100-80gb", "--budget", "1m", *storage),
        ("best", *storage),
        ("trials", *storage),
        ("plan", "--model", str(folder), "--gpu", "h100"),
        ("export", "--format", "torchrun", *storage),
        ("report", "-o", str(tmp_path / "r.html"), *storage),
    )
    for command in commands:
        code, _ = run_main(command, tmp_path, monkeypatch, capsys, take=False)
        out, err = capsys.readouterr()
        shown = out + err
        assert code == 0, (command, shown[-2000:])
        assert not [c for c in shown if c in "\x1b\x07\r"], (command, shown[-2000:])
        if command[0] in ("run", "best", "plan"):
            assert "m\\x1b[2J\\x1b]0;pwned\\x07\\rx" in shown, (command, shown[-2000:])
