"""A probe's processes end with the tuner that started them.

A tuner that is killed outright (SIGKILL from the OOM killer or a scheduler) cannot stop its
probe: the ranks would run on, holding device memory while a resumed tuner probes again (and
meets a false OOM). On Linux every rank, and the fork server, ask the kernel for a SIGKILL when
the process that started them ends (``PR_SET_PDEATHSIG``); elsewhere this is a no-op.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Iterable

import psutil

__all__ = ["PARENT_ENV", "descendants", "die_with_parent", "kill_all"]

PARENT_ENV = "AUTOTUNE_PARENT_PID"
"""Set by the spawner to its own pid, so a rank can tell whether its parent is already gone."""
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None) -> None:
    """Be killed when the parent process ends; end now if ``parent`` is already gone.

    Args:
        parent: The pid that started this process (None: trust the current parent).
    """
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return
        if parent is not None and os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)  # it ended before the request was made


def descendants(pids: Iterable[int]) -> list[psutil.Process]:
    """Every live process below ``pids``, found while they live. A process group does not
    hold them all: ninja starts each compiler in a process group of its own, so a kill of a
    probe's (or a build step's) groups leaves its compilers running unless they are ended
    one by one too."""
    found: list[psutil.Process] = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            found.extend(psutil.Process(pid).children(recursive=True))
    return found


def kill_all(processes: Iterable[psutil.Process]) -> None:
    """SIGKILL each process still alive (psutil checks it is the same process, not a new one
    with its pid) and reap what it can."""
    alive = []
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.kill()
            alive.append(process)
    psutil.wait_procs(alive, timeout=5)
