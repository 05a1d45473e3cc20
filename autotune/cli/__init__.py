"""The ``autotune`` command line.

Every command that prints results also takes ``--json``. Bad input ends with one line that
says what to do, and exit code 2; `autotune probe` exits 0 when at least one micro-batch
size fits, 1 when none does.

One module a command (or a family of them), each a thin layer over :mod:`autotune.api`:
``_probe``, ``_plan``, ``_run`` (the search, an RL iteration's layouts, job files) and
``_results`` (``best``, ``trials``, ``export``, ``report``, ``models``); the options several
commands share are declared once in :mod:`autotune.cli.options`, and the application, its
consoles and :func:`main` are ``_app``'s. The commands are registered here, in the order
``--help`` lists them.
"""

from __future__ import annotations

from autotune.cli._app import app, command, main
from autotune.cli._plan import plan
from autotune.cli._probe import probe
from autotune.cli._results import best, export, models, report, trials
from autotune.cli._run import run

for _command in (probe, plan, run, best, trials, export, report, models):
    command()(_command)

__all__ = ["app", "main"]
