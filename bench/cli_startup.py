"""How fast the commands that read or predict answer: a fresh process, start to exit.

`autotune plan`, `best` and `trials` load no torch (the core is torch-free), so each should
answer in under a second, on a study of 10,000 trials too (a nightly job's database after
months). A small study is made first with a simulated search, then a copy of it grown to
``--trials`` trials (its own trials repeated, renumbered); each command runs once to
warm up and ``--repeats`` times in a fresh interpreter, and the median wall time is printed
beside the goal.

    python bench/cli_startup.py [--repeats 5] [--trials 10000] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOAL_S = 1.0
# As a user's shell runs it: bytecode cached after the first run (some sandboxes set
# PYTHONDONTWRITEBYTECODE, which makes every start recompile autotune's own modules).
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def _time(args: list[str], cwd: Path) -> float:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "autotune.cli", *args],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        check=False,
    )
    elapsed = time.perf_counter() - started
    if done.returncode not in (0, 1):
        raise SystemExit(f"autotune {' '.join(args)} failed: {done.stderr.strip()}")
    return elapsed


_CHILDREN = {
    "trial_params": "param_name, param_value, distribution_json",
    "trial_values": "objective, value, value_type",
    "trial_user_attributes": "key, value_json",
    "trial_system_attributes": "key, value_json",
}
"""Optuna's per-trial tables (schema v3.2.0.a, the one autotune's reader knows) and the
columns a copy of a finished trial carries over."""


def _grown(folder: Path, trials: int) -> str:
    """A copy of the small study grown to ``trials`` trials: its finished trials added again
    in turn, renumbered, as Optuna stores them (what a long-lived study holds). Written with
    SQL in one transaction: through Optuna's API, 10,000 trials take minutes to add.
    Returns its storage URL."""
    shutil.copy(folder / "autotune.db", folder / "large.db")
    with contextlib.closing(sqlite3.connect(folder / "large.db")) as db, db:
        ids = [i for (i,) in db.execute("SELECT trial_id FROM trials WHERE state != 'RUNNING'")]
        (count,) = db.execute("SELECT COUNT(*) FROM trials").fetchone()
        while count < trials:
            (top_id, top_number) = db.execute(
                "SELECT MAX(trial_id), MAX(number) FROM trials"
            ).fetchone()
            batch = ids[: trials - count]
            marks = ",".join("?" * len(batch))
            db.execute(
                "INSERT INTO trials (trial_id, number, study_id, state, datetime_start, "
                "datetime_complete) SELECT trial_id + ?, number + ?, study_id, state, "
                f"datetime_start, datetime_complete FROM trials WHERE trial_id IN ({marks})",
                (top_id, top_number + 1, *batch),
            )
            for table, columns in _CHILDREN.items():
                db.execute(
                    f"INSERT INTO {table} (trial_id, {columns}) SELECT trial_id + ?, {columns} "
                    f"FROM {table} WHERE trial_id IN ({marks})",
                    (top_id, *batch),
                )
            count += len(batch)
    return f"sqlite:///{folder}/large.db"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--trials", type=int, default=10_000, help="Trials of the large study.")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        storage = f"sqlite:///{cwd}/autotune.db"
        _time(
            ["run", "--model", "qwen2.5-1.5b", "--simulate", "h100-80gb", "--gpus", "1",
             "--global-batch", "64", "--budget", "20m", "--storage", storage, "--json"],
            cwd,
        )  # fmt: skip
        large = _grown(cwd, args.trials)
        commands = {
            "autotune plan --help": ["plan", "--help"],
            "autotune plan (llama-7b, 8 x h100)": ["plan", "--gpu", "h100-80gb", "--gpus", "8"],
            "autotune plan (llama-70b, 64 x h100, TP/PP/CP too)": [
                "plan", "--model", "llama-70b", "--gpu", "h100-80gb", "--gpus", "64",
            ],
            "autotune best": ["best", "--storage", storage],
            "autotune trials": ["trials", "--storage", storage],
            f"autotune best ({args.trials:,} trials)": ["best", "--storage", large],
            f"autotune trials --last 50 ({args.trials:,} trials)": [
                "trials", "--storage", large, "--last", "50",
            ],
            f"autotune trials ({args.trials:,} trials, the table's default)": [
                "trials", "--storage", large,
            ],
        }  # fmt: skip
        rows = []
        for label, command in commands.items():
            _time(command, cwd)  # warm: bytecode written, files in the page cache
            times = [_time(command, cwd) for _ in range(args.repeats)]
            rows.append({"command": label, "median_s": statistics.median(times), "goal_s": GOAL_S})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    machine = platform.processor() or platform.machine()
    print(
        f"fresh-process wall time, median of {args.repeats} ({platform.node()}, "
        f"Python {platform.python_version()}, {machine})"
    )
    print(f"{'command':<58} {'median':>8}  goal")
    for row in rows:
        mark = "ok" if row["median_s"] < GOAL_S else "MISSED"
        print(f"{row['command']:<58} {row['median_s']:>7.2f}s  < {GOAL_S:.0f} s {mark}")


if __name__ == "__main__":
    main()
