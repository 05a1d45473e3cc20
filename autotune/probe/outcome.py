"""What happened to a probe: one small, pure classification.

"Is this an OOM?" is answered from the exception's type first and its message only as a
fallback; what to do about it is the search's business, not this module's. A probe of several
ranks is classified from every rank's exit status and report: an OOM in any rank is the probe's
OOM, a rank the kernel killed is a host OOM, and so on (see :func:`classify_probe`).
"""

from __future__ import annotations

import collections
import enum
import signal
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


class Outcome(enum.StrEnum):
    """How a probe (or one micro-batch size of it) ended."""

    OK = "ok"
    OOM = "oom"
    """The device (or the emulated device limit) ran out of memory."""
    HOST_OOM = "host_oom"
    """A rank was killed with SIGKILL that the launcher did not send: the kernel's OOM killer."""
    TIMEOUT = "timeout"
    """The probe did not finish within its wall-clock limit and was killed."""
    CRASH = "crash"
    """A rank died from a signal (segfault, abort, bus error, ...)."""
    ERROR = "error"
    """Any other failure; the message says which."""


class Stage(enum.StrEnum):
    """Where in the probe a failure happened."""

    STARTUP = "startup"
    BUILD = "build"
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    ROLLOUT = "rollout"
    """An RL iteration's rollout: the engine's share taken beside the trainer's states."""
    SCORING = "scoring"
    """An RL iteration's scoring forwards (the frozen models, the critic's values)."""


# Fallback substrings, for OOMs that arrive as a plain RuntimeError or only as text
# (a C++ extension, NCCL, a subprocess's stderr). Lower-cased.
OOM_MESSAGES: tuple[str, ...] = (
    " out of memory",
    "cuda out of memory",
    "cublas_status_alloc_failed",
    "cudnn_status_not_enough_workspace",
    "cudnn_status_alloc_failed",
    "defaultcpuallocator: can't allocate memory",
    "hip out of memory",
    "xpu out of memory",
    "cudaerrormemoryallocation",
    "ncclsystemerror: system call (e.g. socket, malloc) or external library call failed",
)


# Errors a rank sees because *another* rank died: never the cause of a probe's failure.
PEER_FAILURE_MESSAGES: tuple[str, ...] = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "communicator was aborted",
    "socket timeout",
    "timed out in call to",
)


def tally(outcomes: Iterable[str | None]) -> str:
    """How many probes ended each way, most first: ``2 timeout, 1 error``."""
    counts = collections.Counter(outcomes)
    return ", ".join(f"{n} {outcome}" for outcome, n in counts.most_common())


def is_peer_failure(text: str) -> bool:
    """Whether an error text only reports that another rank went away."""
    lowered = text.lower()
    return any(pattern in lowered for pattern in PEER_FAILURE_MESSAGES)


def is_oom_message(text: str) -> bool:
    """Whether an error text reports an out-of-memory condition."""
    lowered = text.lower()
    return any(pattern in lowered for pattern in OOM_MESSAGES)


def is_oom_error(error: BaseException) -> bool:
    """Whether an exception is an out-of-memory error (type first, message as fallback)."""
    if isinstance(error, MemoryError):
        return True
    # A torch error can only exist once torch is imported; this module never imports it, so
    # the tuner's side (which classifies, but never trains) stays free of torch.
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(error, torch.OutOfMemoryError):
        return True
    if isinstance(error, RuntimeError) and error.args:
        return is_oom_message(str(error.args[0]))
    return False


@dataclass(frozen=True, kw_only=True, slots=True)
class RankExit:
    """How one rank's process ended, as the launcher saw it."""

    rank: int
    returncode: int | None
    """Exit code; negative for a signal (``-9`` SIGKILL); None if it could not be reaped."""
    report: dict[str, Any] | None = None
    """The rank's own report (rank<N>.json), if it wrote one that can be read."""
    report_problem: str = ""
    """Why there is no report: ``rank1.json is missing``, ``... is not valid JSON (...)``."""
    killed_by_launcher: bool = False
    """The launcher sent the signal (timeout, or cleanup after another rank failed)."""
    stderr_tail: str = ""
    """Last lines of the probe's stderr, for messages of ranks that wrote no report."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Classification:
    """The probe's outcome, where it happened and why."""

    outcome: Outcome
    stage: Stage | None = None
    message: str = ""
    rank: int | None = None


def _signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def _failed_report(exit_: RankExit) -> dict[str, Any] | None:
    report = exit_.report
    if report and report.get("status") not in (None, Outcome.OK.value):
        return report
    return None


def classify_probe(exits: Sequence[RankExit], *, timed_out: bool) -> Classification:
    """Classify a whole probe from every rank's exit.

    Priority: a reported OOM in any rank (it is usually the cause of everything after it),
    then a SIGKILL the launcher did not send (host OOM), then the timeout, then other signals
    (crash), then reported errors, then non-zero exits without a report, then a rank that
    exited cleanly without a report that can be read (never ``ok`` from part of the ranks).
    """
    reported = [(e, r) for e in exits if (r := _failed_report(e)) is not None]
    # Root causes first: a rank that lost its peer reports a symptom, not the cause.
    reported.sort(key=lambda item: is_peer_failure(item[1].get("message", "")))
    for exit_, report in reported:
        if report["status"] == Outcome.OOM.value:
            return Classification(
                outcome=Outcome.OOM,
                stage=Stage(report["stage"]) if report.get("stage") else None,
                message=report.get("message", ""),
                rank=exit_.rank,
            )
    unexpected = [e for e in exits if not e.killed_by_launcher]
    for exit_ in unexpected:
        if exit_.returncode == -signal.SIGKILL:
            return Classification(
                outcome=Outcome.HOST_OOM,
                message=f"rank {exit_.rank} was killed by SIGKILL (the kernel's OOM killer?)",
                rank=exit_.rank,
            )
    if timed_out:
        return Classification(outcome=Outcome.TIMEOUT, message="probe exceeded its time limit")
    for exit_ in unexpected:
        if exit_.returncode is not None and exit_.returncode < 0:
            return Classification(
                outcome=Outcome.CRASH,
                message=f"rank {exit_.rank} died from {_signal_name(exit_.returncode)}",
                rank=exit_.rank,
            )
    for exit_, report in reported:
        if is_peer_failure(report.get("message", "")) and any(
            e.returncode not in (0, None) and e.report is None and not e.killed_by_launcher
            for e in exits
        ):
            break  # a rank died without a report: that death is the cause, classified below
        return Classification(
            outcome=Outcome(report["status"]),
            stage=Stage(report["stage"]) if report.get("stage") else None,
            message=report.get("message", ""),
            rank=exit_.rank,
        )
    # Ranks that died without a report come first: the others may only have lost them.
    for exit_ in sorted(unexpected, key=lambda e: e.report is not None):
        if exit_.returncode != 0:
            tail = exit_.stderr_tail.strip().splitlines()
            last = tail[-1] if tail else ""
            outcome = Outcome.OOM if is_oom_message(exit_.stderr_tail) else Outcome.ERROR
            problem = f" ({exit_.report_problem})" if exit_.report_problem else ""
            return Classification(
                outcome=outcome,
                message=f"rank {exit_.rank} exited with code {exit_.returncode}{problem}: "
                f"{last}".strip().rstrip(":"),
                rank=exit_.rank,
            )
    # Every rank exited cleanly: the probe is ok only if every rank's report says so.
    for exit_ in exits:
        if exit_.report is None:
            return Classification(
                outcome=Outcome.ERROR,
                message=f"rank {exit_.rank} exited cleanly, but "
                f"{exit_.report_problem or 'left no report'}: its measurements are lost",
                rank=exit_.rank,
            )
    return Classification(outcome=Outcome.OK)
