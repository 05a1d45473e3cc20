"""What answers a probe: one interface for real ranks, the simulated GPU and recorded grids.

A :class:`Device` takes a :class:`~autotune.probe.ProbeSpec` and a probe folder and returns a
:class:`~autotune.probe.ProbeResult`; the search never knows which device answers. Each device
also says how a tuning budget is charged (:meth:`Device.clock`): by the wall clock where probes
really run, by the probes' own reported durations where they are simulated or replayed.
A device may need steps of its own before a probe can run (:meth:`Device.setup`: building
DeepSpeed's ops, starting the warm process ranks fork from), taken outside the probe's
timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from autotune.probe.result import ProbeResult
from autotune.probe.spec import ProbeSpec

__all__ = [
    "AnsweredDevice",
    "Clock",
    "Device",
    "ProbeClock",
    "SetupResult",
    "SetupStep",
    "WallClock",
]


class Clock(Protocol):
    """The budget's clock: how much of it a tuning run has used."""

    def elapsed(self) -> float:
        """Seconds used so far."""
        ...

    def charge(self, seconds: float) -> None:
        """A probe that reports it took ``seconds`` has finished."""
        ...

    def exempt(self, seconds: float) -> None:
        """A device's set-up step (building DeepSpeed ops, starting warm workers) that took
        ``seconds`` has finished: time the budget does not count, so a one-time build never
        spends the probes' budget."""
        ...


class WallClock:
    """Real elapsed time, from the clock's creation (probes cost what they took), less the
    set-up steps' time."""

    def __init__(self) -> None:
        self._started = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self._started

    def charge(self, seconds: float) -> None:
        pass  # the wall clock has moved on by itself

    def exempt(self, seconds: float) -> None:
        self._started += seconds


class ProbeClock:
    """The sum of the probes' reported durations: a simulated probe answers in microseconds,
    yet charges the budget the time it would have taken on the GPU."""

    def __init__(self) -> None:
        self._spent = 0.0

    def elapsed(self) -> float:
        return self._spent

    def charge(self, seconds: float) -> None:
        self._spent += seconds

    def exempt(self, seconds: float) -> None:
        pass  # set-up steps never charged it


@dataclass(frozen=True, kw_only=True, slots=True)
class SetupResult:
    """How a device's set-up step ended."""

    label: str
    """What the step did (``building DeepSpeed ops: cpu_adam``)."""
    ok: bool
    seconds: float
    message: str
    """One line: what was done, or why it failed."""
    warnings: tuple[str, ...] = field(default_factory=tuple)
    """Lines the step warned with (a stale lock it removed)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "ok": self.ok,
            "seconds": self.seconds,
            "message": self.message,
            "warnings": list(self.warnings),
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class SetupStep:
    """Work a device does once before it can run a probe, outside the probe's timeout."""

    label: str
    """What the step does, for the live view (``building DeepSpeed ops: cpu_adam``)."""
    run: Callable[[], SetupResult]
    """Does it; blocks until done. A KeyboardInterrupt stops it before it propagates."""


class Device(Protocol):
    """Runs probes. Implementations: :class:`~autotune.devices.local.LocalDevice` (real ranks on
    this node's GPUs or CPU), :class:`~autotune.devices.simulated.SimulatedDevice` (the
    estimator, with seeded error and noise; every result says ``simulated``) and
    :class:`~autotune.devices.replay.ReplayDevice` (a grid recorded on a real GPU).

    Contract: :meth:`launch` blocks until the probe is over, writes ``result.json`` (and
    whatever else the device keeps) into ``probe_dir``, and returns the result; it never
    raises for what happened inside the probe (an OOM, a crash, a timeout are outcomes). A
    KeyboardInterrupt stops the probe before it propagates.
    """

    @property
    def kind(self) -> str:
        """``cuda``, ``cpu``, ``simulated`` or ``replay``: a study's measurements never mix
        kinds."""
        ...

    def setup(self, spec: ProbeSpec) -> list[SetupStep]:
        """What must be done before ``spec`` can be probed, in order (empty: nothing). Cheap
        to ask before every probe; the steps are the caller's to run."""
        ...

    def launch(
        self,
        spec: ProbeSpec,
        probe_dir: Path,
        *,
        on_poll: Callable[[float], None] | None = None,
    ) -> ProbeResult:
        """Run one probe; ``on_poll`` is called with the elapsed seconds while it runs."""
        ...

    def clock(self) -> Clock:
        """A fresh clock that charges this device's probes to a budget."""
        ...

    def close(self) -> None:
        """Release what the device holds between probes (a warm process); it may be used
        again after, and then sets itself up again."""
        ...


class AnsweredDevice:
    """What a device that answers probes without running them (the estimator, recordings)
    has in common: each probe is charged the time it reports (:class:`ProbeClock`), and
    there is nothing to set up before a probe or to release after."""

    def clock(self) -> Clock:
        """Budgets are charged the time each probe reports it took (on the GPU it stands
        for), not the microseconds the answer took."""
        return ProbeClock()

    def setup(self, spec: ProbeSpec) -> list[SetupStep]:
        """Nothing to build or start."""
        return []

    def close(self) -> None:
        """Nothing held."""
