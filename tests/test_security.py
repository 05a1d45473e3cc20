"""User text never reaches a shell; what autotune creates is not open to other users.

(Passwords in storage URLs: tests/study/test_secrets.py, against a real PostgreSQL server.)
"""

from __future__ import annotations

import ast
import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

from autotune.urls import masked, redact
from tests.test_cli import TINY_CPU, autotune

PACKAGE = Path(__file__).resolve().parents[1] / "autotune"
HOSTILE = "m $(touch pwned) `touch pwned2`; touch pwned3 & 'q\" *"
"""A folder name that runs three commands if a shell ever sees it unquoted."""


def _calls(tree: ast.AST) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)]


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else "?"


def test_no_code_of_autotune_starts_a_shell() -> None:
    """No ``shell=True``, ``os.system``, ``os.popen`` or ``os.exec*p`` with a command string:
    every process starts from an argv list."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for call in _calls(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(PACKAGE.parent)}:{call.lineno}"
            name = _name(call.func)
            if name in ("os.system", "os.popen", "commands.getoutput"):
                found.append(f"{where}: {name}")
            for keyword in call.keywords:
                if keyword.arg == "shell" and not (
                    isinstance(keyword.value, ast.Constant) and keyword.value.value is False
                ):
                    found.append(f"{where}: shell={ast.unparse(keyword.value)}")
            if name.startswith("subprocess.") and call.args:
                first = call.args[0]
                if isinstance(first, ast.Constant | ast.JoinedStr | ast.BinOp):
                    found.append(f"{where}: {name} with a command string")
    assert not found, found
    assert len(list(PACKAGE.rglob("*.py"))) > 40  # the walk saw the package


def test_a_hostile_path_runs_nothing_and_cmd_txt_is_safe_to_paste(tmp_path: Path) -> None:
    """A real CPU probe whose trials folder holds shell syntax: nothing runs, and the
    ``cmd.txt`` it writes (a command to reproduce the probe) quotes every argument."""
    trials = tmp_path / HOSTILE
    done = autotune("probe", *TINY_CPU, "--trials-dir", str(trials), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    [probe] = list((trials / "probes").iterdir())
    assert (probe / "result.json").is_file()
    assert not list(tmp_path.rglob("pwned*")) and not list(Path.cwd().glob("pwned*"))
    lines = (probe / "cmd.txt").read_text().splitlines()
    commands = [shlex.split(line) for line in lines if line and not line.startswith("#")]
    assert any(str(probe) in words for words in commands), lines  # one word, as given


def _private(path: Path) -> list[str]:
    """Everything below ``path`` that other users may read, or the group may write."""
    loose = []
    for item in [path, *path.rglob("*")]:
        if item.is_symlink() or stat.S_ISFIFO(item.lstat().st_mode):
            continue
        mode = item.stat().st_mode
        if mode & (stat.S_IRWXO | stat.S_IWGRP):
            loose.append(f"{item.relative_to(path.parent)} {stat.filemode(mode)}")
    return loose


def test_probe_folders_and_the_trial_database_are_not_open_to_other_users(tmp_path: Path) -> None:
    """Under the usual umask 022, a run's probe folders, logs and database, and a probe's
    folder, are closed to other users and not writable by the group."""
    umask = os.umask(0o022)
    try:
        run = autotune(
            "run", "--model", "llama-7b", "--simulate", "h100-80gb", "--budget", "5m",
            "--storage", f"sqlite:///{tmp_path}/db/t.db", "--trials-dir", str(tmp_path / "t"),
            cwd=tmp_path,
        )  # fmt: skip
        probe = autotune("probe", *TINY_CPU, "--trials-dir", str(tmp_path / "p"), cwd=tmp_path)
    finally:
        os.umask(umask)
    assert run.returncode == 0, run.stderr
    assert probe.returncode == 0, probe.stderr
    for made in ("db", "t", "p"):
        assert (tmp_path / made).exists()
        assert not _private(tmp_path / made), _private(tmp_path / made)
    assert stat.S_IMODE((tmp_path / "db" / "t.db").stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "p").stat().st_mode) == 0o750


def test_an_inherited_test_fault_variable_does_nothing_in_a_real_run(tmp_path: Path) -> None:
    """``AUTOTUNE_TEST_FAULT`` in the environment of the real command (not the test suite's
    armed entry point) reaches no rank: the probe trains and is ok, and its folder holds no
    fault request. The armed entry point, given the same variable, does fail the rank."""
    env = {**os.environ, "AUTOTUNE_TEST_FAULT": "error"}
    args = ("probe", *TINY_CPU, "--micro-batch", "1", "--json")
    real = subprocess.run(
        [sys.executable, "-c", "from autotune.cli import main; main()", *args,
         "--trials-dir", str(tmp_path / "real")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert real.returncode == 0, real.stderr
    assert json.loads(real.stdout)["outcome"] == "ok"
    assert not list((tmp_path / "real").rglob("test-fault"))
    armed = autotune(*args, "--trials-dir", str(tmp_path / "armed"), cwd=tmp_path, env=env)
    assert json.loads(armed.stdout)["outcome"] == "error", armed.stderr


@pytest.mark.parametrize(
    ("url", "shown", "secrets"),
    [
        ("postgresql://u:pw@h/db", "postgresql://u:***@h/db", ["pw"]),
        ("postgresql+psycopg://u:p%40w@h:5/db", "postgresql+psycopg://u:***@h:5/db", ["p@w"]),
        ("postgresql://u@h/db?password=pw&sslmode=require",
         "postgresql://u@h/db?password=***&sslmode=require", ["pw"]),
        ("postgresql://u@h/db?sslpassword=pw&passfile=/home/u/.pgpass&sslkey=/k.pem",
         "postgresql://u@h/db?sslpassword=***&passfile=***&sslkey=***",
         ["pw", "/home/u/.pgpass", "/k.pem"]),
        ("postgresql://u@h/db?options=-c%20statement_timeout%3D5", None, []),
        ("sqlite:///trials/autotune.db?timeout=30", None, []),
    ],
)  # fmt: skip
def test_every_secret_form_of_a_storage_url_is_masked(
    url: str, shown: str | None, secrets: list[str]
) -> None:
    """The user part's password and libpq's secret fields (``password``, ``sslpassword``,
    ``passfile``, ``sslkey``) are masked; what is no secret is kept as given. A driver's error
    that quotes a secret decoded loses it too."""
    assert masked(url) == (shown or url)
    error = redact(f"cannot parse {url!r}, near {unquote(url)!r}", url)
    assert all(secret not in error for secret in secrets), error
