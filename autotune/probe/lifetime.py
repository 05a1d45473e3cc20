"""A probe's processes end with the tuner that started them, and with the probe.

A tuner that is killed outright (SIGKILL from the OOM killer or a scheduler) cannot stop its
probe: the ranks would run on, holding device memory while a resumed tuner probes again (and
meets a false OOM). On Linux every rank, and the fork server, ask the kernel for a SIGKILL when
the process that started them ends (``PR_SET_PDEATHSIG``); elsewhere this is a no-op.

A process a probe's ranks start may leave their process group (a child started in a session
of its own, ninja's compilers) or their tree (a daemon that forks twice and whose middle
process exits, so the kernel re-parents it to init). Two nets find them, at every end of a
probe (its ranks done, its timeout, Ctrl-C):

- **the ranks' trees**: every process below the ranks (:func:`descendants`), taken just before
  the launcher stops them. A rank of a user's job is a child subreaper
  (:func:`adopt_orphans`): a daemon it starts is re-parented to the rank, not to init, so it
  stays in the rank's tree while the rank lives, and the rank ends its tree when it ends by
  itself (:func:`end_descendants`).
- **the probe's mark**: every rank's environment carries a value of its probe's own
  (:data:`MARK_ENV`), which whatever the job starts inherits, wherever it ends up; when the
  probe ends, the launcher kills every process whose environment carries it (:func:`marked`).
  This holds for a process re-parented to init after its rank died by a signal.

Neither needs a privilege: ``prctl`` on the process itself, and ``/proc/PID/environ`` of the
user's own processes. A cgroup would hold every process whatever its environment, but
creating one needs a delegated cgroup v2 subtree, which a batch job or a container rarely has.
What the nets miss: after a rank died by a signal (so it could not end its tree), a process of
its job that left the tree and whose environment lacks the mark: one started with an
environment of its own making (``env -i``, ``Popen(env={})``), or a fork without ``exec`` of
a rank forked from the warm process (``/proc/PID/environ`` shows the environment a process was
executed with, for those the warm process's).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import signal
import sys
from collections.abc import Iterable

import psutil

__all__ = [
    "MARK_ENV",
    "PARENT_ENV",
    "adopt_orphans",
    "descendants",
    "die_with_parent",
    "end_descendants",
    "kill_all",
    "marked",
    "new_mark",
]

PARENT_ENV = "AUTOTUNE_PARENT_PID"
"""Set by the spawner to its own pid, so a rank can tell whether its parent is already gone."""
MARK_ENV = "AUTOTUNE_PROBE_MARK"
"""In every rank's environment: its probe's mark (:func:`new_mark`), inherited by whatever the
job starts, so the launcher finds what outlives the probe (:func:`marked`)."""
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> bool:
    """``prctl(option, value)`` on Linux; whether the kernel took it."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(option, value, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(parent: int | None) -> None:
    """Be killed when the parent process ends; end now if ``parent`` is already gone.

    Args:
        parent: The pid that started this process (None: trust the current parent).
    """
    if not _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL):
        return
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)  # it ended before the request was made


def adopt_orphans() -> bool:
    """Make this process a child subreaper (``PR_SET_CHILD_SUBREAPER``, Linux 3.4): a process
    below it whose parent ends (a daemon that forked twice) is re-parented to this process
    instead of init, so it stays among this process's :func:`descendants` while this process
    lives. Returns whether the kernel took it (False elsewhere)."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def end_descendants() -> None:
    """Kill every process below this one (and reap those re-parented to it)."""
    kill_all(descendants([os.getpid()]))


def new_mark() -> str:
    """A probe's mark: random, so no other probe's processes carry it."""
    return secrets.token_hex(16)


def marked(mark: str) -> list[psutil.Process]:
    """Every live process whose environment carries ``mark`` in :data:`MARK_ENV`, as
    ``/proc/PID/environ`` shows it (the environment it was executed with). Only this user's
    processes can be read, which are the only ones a probe can start."""
    found: list[psutil.Process] = []
    for process in psutil.process_iter():
        if process.pid == os.getpid():
            continue
        with contextlib.suppress(psutil.Error, OSError):
            if process.environ().get(MARK_ENV) == mark:
                found.append(process)
    return found


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
