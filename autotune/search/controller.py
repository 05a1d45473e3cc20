"""The tuning loop: propose, record as RUNNING trials, probe, record what happened; repeat.

The controller owns the budget and the interruptions; the ladder (``propose``) owns the
choices; the runner is the real probe launcher or the simulated device (the same call). A
probe is started only if the time it is expected to take (the median of the probes so far,
or the first probe's guess) fits in what is left. Its timeout is the earlier of the budget's
end and a hang guard (``HANG_FACTOR`` times the longest probe so far); a probe the budget
cut short is recorded as interrupted, and retried by a later run.
Ctrl-C (or SIGTERM, which the CLI turns into the same interruption) stops the running probe
(the launcher kills its process group), records its trials as failed with the reason, and ends
the run with the best found so far.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from optuna.trial import Trial, TrialState

from autotune.config import ConfigError
from autotune.estimator.plan import PlanRow
from autotune.models import ModelSpec
from autotune.probe.launcher import new_probe_dir
from autotune.probe.outcome import Outcome
from autotune.probe.result import ProbeResult
from autotune.probe.spec import ProbeSpec
from autotune.search.ladder import Proposal, propose
from autotune.space import Workload, micro_batch_options
from autotune.study.store import Measurement, TrialStore

__all__ = ["Controller", "Event", "ProbeRunner", "RunSummary"]

FIRST_PROBE_GUESS_S = 120.0
"""Expected duration of the first probe, before any was measured (start-up, build, steps)."""
MIN_PROBE_TIMEOUT_S = 30.0
HANG_FACTOR = 4.0
"""Once probes were measured, one that runs this many times longer than the longest of them
(and longer than ``FIRST_PROBE_GUESS_S``) is taken to hang and is stopped as a timeout."""


class ProbeRunner(Protocol):
    """``autotune.probe.launch_probe`` or ``SimulatedDevice.launch_probe``."""

    def __call__(
        self, spec: ProbeSpec, probe_dir: Path, *, on_poll: Callable[[float], None] | None = ...
    ) -> ProbeResult: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class Event:
    """What the live view shows after each step of the loop."""

    kind: str
    """``resume`` (stale trials failed), ``probe`` (about to start), ``result`` (one probe
    done), ``stop``."""
    proposal: Proposal | None = None
    result: ProbeResult | None = None
    best: Measurement | None = None
    probes: int = 0
    budget_left_s: float = 0.0
    message: str = ""


@dataclass(kw_only=True)
class RunSummary:
    """How a run ended."""

    stop_reason: str
    interrupted: str | None = None
    """What stopped the run early (``Ctrl-C``, ``SIGTERM``), or None."""
    stale: int = 0
    """Trials left running by a tuner that ended, failed at the start (their points retried)."""
    probes: int
    elapsed_s: float
    best: Measurement | None
    measurements: list[Measurement] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        best = self.best
        return {
            "stop_reason": self.stop_reason,
            "interrupted": self.interrupted,
            "stale": self.stale,
            "probes": self.probes,
            "elapsed_s": self.elapsed_s,
            "best": None
            if best is None
            else {
                "config": best.config.to_dict(),
                "label": best.config.label(),
                "micro_batch_size": best.micro_batch_size,
                "objective": best.value,
                **best.attrs,
            },
        }


class Controller:
    """Runs the search against one study until it is done, the budget ends, or Ctrl-C."""

    def __init__(
        self,
        *,
        model: ModelSpec,
        model_ref: str,
        workload: Workload,
        store: TrialStore,
        rows: list[PlanRow],
        runner: ProbeRunner,
        budget_s: float,
        trials_dir: Path,
        device: str,
        device_memory_bytes: int | None,
        capacity_bytes: int,
        simulated: bool = False,
        probe_timeout_s: float = 900.0,
        warmup_steps: int = 2,
        timed_steps: int = 3,
        on_event: Callable[[Event], None] | None = None,
    ) -> None:
        if budget_s <= 0:
            raise ConfigError("the budget must be positive, like 30m")
        self.model = model
        self.model_ref = model_ref
        self.workload = workload
        self.store = store
        self.rows = rows
        self.runner = runner
        self.budget_s = budget_s
        self.trials_dir = trials_dir
        self.device = device
        self.device_memory_bytes = device_memory_bytes
        self.capacity_bytes = capacity_bytes
        self.simulated = simulated
        self.probe_timeout_s = probe_timeout_s
        self.warmup_steps = warmup_steps
        self.timed_steps = timed_steps
        self.on_event = on_event or (lambda event: None)
        self._spent = 0.0  # simulated seconds, when the runner is the simulated device
        self._started = time.monotonic()
        self._durations: list[float] = []

    def elapsed(self) -> float:
        """Budget used: wall-clock, or the simulated probes' time on a simulated device."""
        return self._spent if self.simulated else time.monotonic() - self._started

    def _expected_probe_s(self) -> float:
        return statistics.median(self._durations) if self._durations else FIRST_PROBE_GUESS_S

    def run(self) -> RunSummary:
        """Search until done; returns why it stopped and the best measurement."""
        stale = self.store.fail_stale()  # a tuner that died: its points are retried once
        if stale:
            self.on_event(
                Event(
                    kind="resume",
                    message=f"{len(stale)} trial(s) left running by a tuner that ended were "
                    "failed; their points are retried once",
                )
            )
        probes = 0
        reason = "search done: no remaining configuration can beat the best measured"
        interrupted: str | None = None
        sizes = micro_batch_options(self.workload)
        try:
            while True:
                left = self.budget_s - self.elapsed()
                if left < max(self._expected_probe_s(), MIN_PROBE_TIMEOUT_S) and probes:
                    reason = f"budget spent ({left:.0f} s left, a probe takes about "
                    reason += f"{self._expected_probe_s():.0f} s)"
                    break
                if left <= 0:
                    reason = "budget spent"
                    break
                proposal = propose(self.rows, self.store.measurements(), sizes)
                if proposal is None:
                    break
                self.on_event(
                    Event(
                        kind="probe",
                        proposal=proposal,
                        best=self.store.best(),
                        probes=probes,
                        budget_left_s=left,
                    )
                )
                result = self._probe(proposal, left_s=left)
                if result is None:
                    # Another worker took a point of it: propose again from what it claimed,
                    # after a random pause (two workers that withdrew at once part ways).
                    time.sleep(random.uniform(0.05, 0.5))
                    continue
                probes += 1
                self.on_event(
                    Event(
                        kind="result",
                        proposal=proposal,
                        result=result,
                        best=self.store.best(),
                        probes=probes,
                        budget_left_s=self.budget_s - self.elapsed(),
                    )
                )
        except KeyboardInterrupt as stop:
            interrupted = str(stop) or "Ctrl-C"
            reason = f"interrupted ({interrupted}): the running probe was stopped and recorded"
        best = self.store.best()
        self.on_event(Event(kind="stop", best=best, probes=probes, message=reason))
        return RunSummary(
            stop_reason=reason,
            interrupted=interrupted,
            stale=len(stale),
            probes=probes,
            elapsed_s=self.elapsed(),
            best=best,
            measurements=self.store.measurements(),
        )

    def _timeout(self, left_s: float) -> tuple[float, bool]:
        """The next probe's timeout, and whether the budget (not a hang guard) sets it."""
        guard = self.probe_timeout_s
        if self._durations:
            longest = max(self._durations)
            guard = min(guard, max(FIRST_PROBE_GUESS_S, HANG_FACTOR * longest))
        return max(min(guard, left_s), MIN_PROBE_TIMEOUT_S), left_s < guard

    def _probe(self, proposal: Proposal, *, left_s: float) -> ProbeResult | None:
        """Probe the proposal; None when another worker claimed one of its points first."""
        timeout_s, budget_bound = self._timeout(left_s)
        spec = ProbeSpec(
            model=self.model_ref,
            config=proposal.config,
            micro_batch_sizes=proposal.micro_batch_sizes,
            seq_len=self.workload.seq_len,
            num_processes=self.workload.world_size,
            device=self.device,
            device_memory_bytes=self.device_memory_bytes,
            warmup_steps=self.warmup_steps,
            timed_steps=self.timed_steps,
            timeout_s=timeout_s,
            seed=proposal.repeat,  # a re-measurement: other data, an independent sample
        )
        probe_dir = new_probe_dir(self.trials_dir.resolve(), _folder(self.store.study.study_name))
        trials: list[Trial] = []
        try:
            # An interruption inside the claim leaves RUNNING trials of this process, which
            # the next run fails as stale.
            trials = (
                self.store.claim(
                    proposal.config, proposal.micro_batch_sizes, repeat=proposal.repeat
                )
                or []
            )
            if not trials:
                return None
            result = self.runner(spec, probe_dir, on_poll=lambda _: self.store.beat(trials))
        except KeyboardInterrupt:
            self._interrupted(trials, probe_dir, "interrupted")
            raise
        self._durations.append(result.wall_s)
        if self.simulated:
            self._spent += result.wall_s
        if result.outcome is Outcome.TIMEOUT and budget_bound:
            # Cut by the end of the budget, not hung: a later run with time retries it.
            self._interrupted(trials, probe_dir, "the budget ended during the probe")
            return result
        for trial in trials:
            self.store.tell(trial, result, capacity_bytes=self.capacity_bytes)
        return result

    def _interrupted(self, trials: list[Trial], probe_dir: Path, why: str) -> None:
        """Record trials cut short through no fault of their point (retried once)."""
        for trial in trials:
            trial.set_user_attr("outcome", "interrupted")
            trial.set_user_attr("message", why)
            trial.set_user_attr("probe_dir", str(probe_dir))
            self.store.study.tell(trial, state=TrialState.FAIL)


def _folder(study_name: str) -> str:
    """A study name as one folder name under the trials directory."""
    return study_name.replace("/", "__").replace("@", "_at_")
