"""Finished ``autotune run`` studies that several tests start from.

A simulated run spends its seconds on the trial database's writes, and several tests need the
same finished study: each run of the same arguments is made once per test session (xdist's
workers share it through a file lock in the session's folder) and each test copies what it
needs, so a test that changes its database (a fault, a resume) changes only its own copy. The
run has ended before anyone copies its files: no process holds the SQLite file open.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from filelock import FileLock

LLAMA_H100_RUN = ("run", "--model", "llama-7b", "--simulate", "h100-80gb", "--budget", "30m")
"""llama-7b on a simulated H100 node (8 GPUs, the default there) for 30 minutes of its clock,
which its search ends within: the finished study tests/test_export.py exports from, and the
run tests/study/test_storage_faults.py faults."""


@dataclass(frozen=True)
class FinishedRun:
    """One ``autotune run`` that exited 0: the folder it ran in (its study in the default
    storage, ``trials/autotune.db``, its probe folders under ``trials/``) and its output."""

    folder: Path
    stdout: str
    stderr: str

    @property
    def database(self) -> Path:
        """The study's SQLite file."""
        return self.folder / "trials" / "autotune.db"

    @property
    def storage(self) -> str:
        """The SQLite URL of the study, for tests that only read it."""
        return f"sqlite:///{self.database}"

    def copy_to(self, folder: Path) -> Path:
        """The run's folder copied into ``folder`` (the database then is where a run in
        ``folder`` finds it by default); returns ``folder``."""
        shutil.copytree(self.folder, folder, dirs_exist_ok=True)
        return folder

    def copy_database(self, path: Path) -> Path:
        """The study's SQLite file alone, copied to ``path``; returns ``path``."""
        shutil.copyfile(self.database, path)
        return path


def finished_run(tmp_path_factory: pytest.TempPathFactory, *args: str) -> FinishedRun:
    """``autotune *args`` (a ``run`` in the default storage, in a folder of its own), made the
    first time this session asks for these arguments and asserted to exit 0; later calls,
    in this worker or another, get the same run."""
    from test_cli import autotune  # test_cli imports this module

    base = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        base = base.parent  # the session's folder, above each worker's own
    key = hashlib.sha256("\0".join(args).encode()).hexdigest()[:16]
    home = base / f"finished-run-{key}"
    with FileLock(str(base / f"finished-run-{key}.lock")):
        if not (home / "done").is_file():
            shutil.rmtree(home, ignore_errors=True)  # a run that failed before
            folder = home / "run"
            folder.mkdir(parents=True)
            done = autotune(*args, cwd=folder)
            assert done.returncode == 0, done.stderr
            (home / "stdout").write_text(done.stdout)
            (home / "stderr").write_text(done.stderr)
            (home / "done").write_text(" ".join(args))
    return FinishedRun(
        folder=home / "run",
        stdout=(home / "stdout").read_text(),
        stderr=(home / "stderr").read_text(),
    )
