"""Test faults: real failures a rank commits on request, so that the launcher's handling of
each can be tested (a segfault, a SIGKILL, a hang, an exception, a flood of output, a torn
report).

A real run can never switch one on. The request travels in the probe's folder (the file
:data:`FAULT_FILE`), which only a launcher running in a process the test suite armed
(:func:`arm`, from its ``conftest.py`` and its own entry point) writes, from that process's
:data:`FAULT_ENV`. The ``autotune`` command and the library never arm: a variable inherited
from a shell or a scheduler does nothing, and it is never forwarded to other nodes (ranks on
every node read the shared probe folder instead). Pure: no torch.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = [
    "FAULT_ENV",
    "FAULT_FILE",
    "arm",
    "fault_for",
    "read_request",
    "write_request",
]

FAULT_ENV = "AUTOTUNE_TEST_FAULT"
"""In an armed process: ``KIND@RANK`` (or ``KIND`` for every rank; ``KIND@RANK:ENGINE`` only
in probes of that engine, ``KIND@RANK:LABEL`` only in probes of the configuration of that
label, ``TrainConfig.label()``) makes that rank fail for real. Right after the build:
``segfault``, ``sigkill``, ``hang``, ``error``, ``flood`` (a flood of stdout and stderr,
then training on) and ``stray`` (a child in a process group of its own, as ninja starts its
compilers, then a hang). After the last size, before a clean exit: ``garble`` (its report cut in
half), ``empty`` (emptied), ``noreport`` (deleted), ``linger`` (its report finished, it never
exits: a teardown that hangs)."""
FAULT_FILE = "test-fault"
"""The request in a probe's folder, written by an armed launcher."""

_armed = False


def arm() -> None:
    """Let this process's launcher pass :data:`FAULT_ENV` on to its probes' ranks. Called by
    the test suite only."""
    global _armed
    _armed = True


def write_request(probe_dir: Path) -> None:
    """Put this process's fault request in ``probe_dir`` when it is armed; remove any other."""
    request = os.environ.get(FAULT_ENV, "").strip() if _armed else ""
    path = probe_dir / FAULT_FILE
    if request:
        path.write_text(request + "\n")
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def read_request(probe_dir: Path) -> str:
    """The fault request in ``probe_dir`` (empty when there is none)."""
    try:
        return (probe_dir / FAULT_FILE).read_text().strip()
    except OSError:
        return ""


def fault_for(request: str, rank: int, engine: str, label: str = "") -> str | None:
    """The fault ``request`` asks of ``rank`` in a probe of ``engine`` whose configuration's
    label is ``label``, if any."""
    kind, _, where = request.partition("@")
    which, _, only = where.partition(":")
    if not kind or (which and int(which) != rank) or (only and only not in (engine, label)):
        return None
    return kind
