"""The README's transcript is what ``make run`` prints on a machine without a GPU.

The test reads the command from the Makefile's ``run`` target (its CPU branch), runs it in a
fresh folder with real CPU probes, and compares the README's transcript with the run's output
line by line where the output is determined: the lines up to the first probe and its result,
the table's columns, the last two lines (the run may end with its budget spent, on a slow or
busy CPU). Measured numbers differ from run to run, so every number is compared as a number
(``#``), and a configuration's name as a configuration.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
NUMBER = re.compile(r"\d[\d,]*(\.\d+)?")
LABEL = re.compile(
    r"\b(single|ddp|fsdp|deepspeed)( z#)?( off:\w+)?( ac:(off|every|ops)(-#)?(\+ops)?)?"
    r"( loss:\w+)?"
)


STOPPED_DONE = (
    "stopped: search done: no remaining configuration can beat the best measured; # probes this "
    "run, TIME of its TIME budget"
)
"""How the README's run ended, as :func:`_shape` writes it."""


def _transcript() -> list[str]:
    text = (ROOT / "README.md").read_text()
    after = text.split("<!-- transcript:", 1)[1]
    block = after.split("```\n", 1)[1].split("\n```", 1)[0]
    return block.splitlines()


def _make_run_cpu() -> tuple[str, list[str]]:
    """The ``run`` target's CPU branch: its echo line and autotune's arguments."""
    target = (ROOT / "Makefile").read_text().split("\nrun: ", 1)[1].split("\n\n", 1)[0]
    cpu = target.split("else", 1)[1].replace("\\\n", " ")
    echo = re.search(r'echo "([^"]+)"', cpu)
    command = re.search(r"\$\(BIN\)/autotune (.+?);", cpu)
    assert echo and command, target
    return echo.group(1), shlex.split(command.group(1))


DURATION = re.compile(r"\b\d+(?:\.\d+)?(?:ms|s)\b|\b\d+m\d+s\b|\b\d+h\d+m\b")
"""A duration as autotune prints it (``250ms``, ``45.2s``, ``2m05s``, ``1h30m``)."""


def _shape(line: str) -> str:
    line = DURATION.sub("TIME", line.rstrip())
    line = NUMBER.sub("#", line)
    line = LABEL.sub("CONFIG", line)
    return re.sub(r"([━─ ])\1+", r"\1", line)


def test_the_readme_transcript_is_what_make_run_prints(tmp_path: Path) -> None:
    echo, args = _make_run_cpu()
    done = subprocess.run(
        [sys.executable, "-c", "from autotune.cli import main; main()", *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    ran = [echo, *done.stdout.splitlines()]
    readme = _transcript()
    assert readme[0] == echo  # make's own line, as the Makefile has it

    def until_first_result(lines: list[str]) -> list[str]:
        first = next(i for i, line in enumerate(lines) if line.startswith("probe 1: "))
        return [_shape(line) for line in lines[: first + 2]]

    assert until_first_result(readme) == until_first_result(ran)

    def columns(lines: list[str]) -> list[str]:
        header = next(line for line in lines if line.startswith("┃"))
        return [cell.strip() for cell in header.strip("┃").split("┃")]

    assert columns(readme) == columns(ran)
    # The run ends as the README's did (every configuration that could beat the best ruled
    # out), or, on a slower or busier CPU, with its budget spent first: either way its last
    # line names the best configuration measured.
    assert _shape(readme[-2]) == STOPPED_DONE
    assert _shape(ran[-2]) == STOPPED_DONE or (
        _shape(ran[-2]).startswith("stopped: budget spent: next would be CONFIG")
        and _shape(ran[-2]).endswith("; # probes this run, TIME of its TIME budget")
    ), ran[-2]
    assert _shape(readme[-1]) == _shape(ran[-1])
    shapes = {_shape(line) for line in ran}
    for line in readme:  # every other kind of line is one the run printed too
        if line.startswith(("probe ", "  #", "  ")) and "tok/s" in line:
            assert _shape(line) in shapes, line


def test_the_set_up_commands_are_on_the_readmes_first_screen() -> None:
    """A new user finds the two set-up commands without scrolling: both lines, as commands
    in a code block, within the README's first 60 lines."""
    first_screen = (ROOT / "README.md").read_text().splitlines()[:60]
    commands = {line.split("#", 1)[0].strip() for line in first_screen}
    assert {"make run", "make test"} <= commands
