"""How fast the commands that read or predict answer: a fresh process, start to exit.

`autotune plan`, `best` and `trials` load no torch (the core is torch-free), so each should
answer in under a second. A small study is made first with a simulated search; then each
command runs once to warm up and ``--repeats`` times in a fresh interpreter, and the median
wall time is printed beside the goal.

    python bench/cli_startup.py [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
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
        commands = {
            "autotune plan --help": ["plan", "--help"],
            "autotune plan (llama-7b, 8 x h100)": ["plan", "--gpu", "h100-80gb", "--gpus", "8"],
            "autotune best": ["best", "--storage", storage],
            "autotune trials": ["trials", "--storage", storage],
        }
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
    print(f"{'command':<40} {'median':>8}  goal")
    for row in rows:
        mark = "ok" if row["median_s"] < GOAL_S else "MISSED"
        print(f"{row['command']:<40} {row['median_s']:>7.2f}s  < {GOAL_S:.0f} s {mark}")


if __name__ == "__main__":
    main()
