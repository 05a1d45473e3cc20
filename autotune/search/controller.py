"""The tuning loop: propose, record as RUNNING trials, probe, record what happened; repeat.

The controller owns the budget and the interruptions; the ladder (``propose``) owns the
choices; the store owns every write to the study; a :class:`~autotune.devices.Device` answers
the probes (real ranks, or the simulated GPU: the controller cannot tell), and its clock
charges the budget. A probe is started only if the time it is expected to take fits in what
is left: its predicted cost (start-up, build, steps: :mod:`autotune.estimator.cost`) scaled by
how long the run's probes took against their predictions. Otherwise the run stops and says
what it would have probed next and for how long; a run with more budget resumes there (the
proposal is a function of the study). The first probe of a run always starts. A probe's timeout
is the earlier of the budget's end and a hang guard: ``HANG_FACTOR`` times the longest probe so
far, or, before any was measured, times the probe's own predicted cost (so a job that hangs in
a run's first probe is a ``timeout`` well before the budget's end, not a probe the budget cut
short). A probe the budget cut short is recorded as interrupted, and retried by a later run.
Ctrl-C (or SIGTERM, which the CLI turns into the same interruption) stops the running probe
(the device kills its process group), records its trials as failed with the reason, and ends
the run with the best found so far.

Before each probe the device is asked for its set-up steps (:meth:`Device.setup`: building
the DeepSpeed ops the probe will load, once; starting the warm process its ranks fork from).
Each runs as a step of its own: its time is the run's, not the probe's, so it counts in
neither the probe's timeout nor the measured probe durations that scale the predicted costs.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import random
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optuna.trial import Trial

from autotune.config import ConfigError
from autotune.devices.base import Clock, Device, SetupResult
from autotune.estimator.cost import build_seconds, probe_seconds
from autotune.estimator.plan import PlanRow, point_estimates
from autotune.models import resolve_model
from autotune.probe.launcher import folder_fault, folder_hint, new_probe_dir
from autotune.probe.outcome import Outcome, Stage, tally
from autotune.probe.result import ProbeResult
from autotune.probe.spec import ProbeSpec, ProbeTemplate
from autotune.search.ladder import Proposal, propose
from autotune.space import Workload, micro_batch_options
from autotune.study.measurement import Measurement, measured_workload
from autotune.study.store import STORAGE_ERRORS, TrialStore, storage_problem

__all__ = ["Controller", "Event", "RunSummary"]

FIRST_PROBE_GUESS_S = 120.0
"""Expected duration of the first probe, before any was measured (start-up, build, steps)."""
MIN_PROBE_TIMEOUT_S = 30.0
HANG_FACTOR = 4.0
"""Once probes were measured, one that runs this many times longer than the longest of them
(and longer than ``FIRST_PROBE_GUESS_S``) is taken to hang and is stopped as a timeout; before
any was, one that runs this many times longer than its predicted cost (start-up, build, steps:
:mod:`autotune.estimator.cost`; at least ``MIN_PROBE_TIMEOUT_S``)."""
WAIT_FIRST_S = 0.25
WAIT_LONGEST_S = 5.0
"""With nothing left to propose while other workers' probes are in flight, the study is read
again after this pause, doubling from ``WAIT_FIRST_S`` up to ``WAIT_LONGEST_S``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Event:
    """What the live view shows after each step of the loop."""

    kind: str
    """``resume`` (stale trials failed), ``setup`` (the device's set-up step about to run;
    ``message`` says what), ``setup_done`` (it ended: ``setup``), ``probe`` (about to start),
    ``result`` (one probe done), ``learn`` (a probe of the user's job changed the search:
    ``message`` says how), ``wait`` (nothing to propose until other workers' probes in
    flight end), ``stop``."""
    proposal: Proposal | None = None
    result: ProbeResult | None = None
    measured: list[Measurement] = field(default_factory=list)
    """The probe's sizes as recorded: throughput at the workload's accumulation, the figure
    every table and the study show (``result`` holds the probe's own)."""
    setup: SetupResult | None = None
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
    failure: str | None = None
    """What failed under the run (the trial database), or None."""
    mistake: str | None = None
    """What the user's job did wrong (an ignored flag, another engine, a crash or an end
    before its first step at the run's first probe), which stopped the run before anything
    was recorded against the probe's configuration; None otherwise."""
    stale: int = 0
    """Trials left running by a tuner that ended, failed by this run (their points retried)."""
    probes: int
    elapsed_s: float
    best: Measurement | None
    measurements: list[Measurement] = field(default_factory=list)
    next_proposal: Proposal | None = None
    """What the run would have probed next had the budget allowed (a resumed run starts
    there)."""
    next_s: float | None = None
    """How long that probe is expected to take."""
    setups: list[SetupResult] = field(default_factory=list)
    """The device's set-up steps this run (building DeepSpeed ops), in order."""
    learnt: list[str] = field(default_factory=list)
    """What probes of the user's job taught this run that changed its search (the engines
    the job trains under), a line each, in order."""

    @property
    def why_no_best(self) -> str | None:
        """Why the run ends without a best (None when it has one). "No configuration fits"
        only where configurations were measured and none fit; a run cut short, or stopped by
        a fault of its own, says so instead."""
        if self.best is not None:
            return None
        if self.interrupted:
            return (
                f"no best yet: the run was interrupted ({self.interrupted}) before a "
                "configuration that fits was measured; run again to go on"
            )
        if self.mistake:
            return f"no best: the job did not run as asked ({self.mistake})"
        if self.failure:
            return f"no best: the run stopped on a fault of its own ({self.failure})"
        ended = ("interrupted", "stale", None)
        if all(m.outcome in ended for m in self.measurements):
            return "no best: no configuration was measured"
        if not any(m.state == "COMPLETE" and not m.feasible for m in self.measurements):
            # Probes that failed (timed out, crashed): nothing was found not to fit either.
            counts = tally(m.outcome for m in self.measurements if m.outcome not in ended)
            return (
                f"no best: no configuration was measured to fit or not ({counts}): autotune "
                "trials lists each with its message"
            )
        return "no configuration fits"

    def to_dict(self) -> dict[str, Any]:
        best = self.best
        following = self.next_proposal
        return {
            "stop_reason": self.stop_reason,
            "interrupted": self.interrupted,
            "failure": self.failure,
            "mistake": self.mistake,
            "stale": self.stale,
            "probes": self.probes,
            "elapsed_s": self.elapsed_s,
            "setup": [step.to_dict() for step in self.setups],
            "learnt": list(self.learnt),
            "next": None
            if following is None
            else {
                "config": following.config.to_dict(),
                "label": following.config.label(),
                "micro_batch_sizes": list(following.micro_batch_sizes),
                "expected_s": self.next_s,
            },
            "best": None
            if best is None
            else {
                **best.attrs,
                "config": best.config.to_dict(),
                "label": best.config.label(),
                "micro_batch_size": best.micro_batch_size,
                "objective": best.value,
                "tokens_per_second": best.tokens_per_second,
                "mfu": best.mfu,
                "repeats": best.repeats,
            },
        }


class Controller:
    """Runs the search against one study until it is done, the budget ends, or Ctrl-C.

    Args:
        store: The study (its fingerprint says the workload, the capacity and the objective).
        rows: The planner's predictions for every configuration of the space.
        device: What answers the probes.
        template: What every probe of the run shares (model, ranks, device, steps); the
            controller fills in the configuration, sizes, timeout and seed.
        budget_s: Seconds of the device's clock the run may use.
        trials_dir: Where probe folders go (one folder per study).
        clock: Charges the budget; by default the device's own clock.
        probe_timeout_s: The longest a probe may run before it is taken to hang.
        on_event: Called at each step of the loop (the live view).
        replan: The planner's rows for another workload: called when probes of a user's
            job measured it otherwise than the rows assume (its loss's dtype, a lone rank's
            wrapper: :meth:`_learn_job`); None: the rows stand.
    """

    def __init__(
        self,
        *,
        store: TrialStore,
        rows: list[PlanRow],
        device: Device,
        template: ProbeTemplate,
        budget_s: float,
        trials_dir: Path,
        clock: Clock | None = None,
        probe_timeout_s: float = 900.0,
        on_event: Callable[[Event], None] | None = None,
        replan: Callable[[Workload], list[PlanRow]] | None = None,
    ) -> None:
        if budget_s <= 0:
            raise ConfigError("the budget must be positive, like 30m")
        self.store = store
        self.rows = rows
        self.device = device
        self.template = template
        self.budget_s = budget_s
        self.trials_dir = trials_dir
        self.clock = clock or device.clock()
        self.probe_timeout_s = probe_timeout_s
        self.on_event = on_event or (lambda event: None)
        self.replan = replan
        self._durations: list[float] = []
        self._predicted: list[float] = []
        """Predicted durations of the probes in ``_durations``, in order."""
        self._rows = {row.config: row for row in rows}
        self._model = resolve_model(template.model)
        self._setups: list[SetupResult] = []
        self._setting_up: str | None = None
        """The set-up step running now, if one is."""
        self._probing = False
        """A probe is running (an interruption stops it and records it interrupted)."""
        self._landed = False
        """A probe ran and the run has not counted it yet: its result is being recorded or
        read (an interruption there still counts it)."""
        self._learnt: list[str] = []
        """What probes of the user's job changed in the search (:attr:`RunSummary.learnt`)."""

    def elapsed(self) -> float:
        """Budget used so far, by the clock."""
        return self.clock.elapsed()

    def _predicted_s(self, proposal: Proposal) -> float:
        """The probe's predicted cost: start-up, build, and each size's steps (an OOM where
        the planner says the size does not fit)."""
        row = self._rows.get(proposal.config)
        if row is None:
            return FIRST_PROBE_GUESS_S
        workload = self.store.workload
        steps: list[float | None] = []
        for mbs in proposal.micro_batch_sizes:
            speed = row.speeds.get(mbs)
            fits = row.peak_at(mbs) <= row.capacity_bytes
            tokens = mbs * workload.seq_len * workload.data_parallel  # one micro-step a step
            steps.append(tokens / speed if speed and fits else None)
        build_s = build_seconds(
            self._model,
            proposal.config,
            world_size=workload.world_size,
            # The node the planner planned for (its GPUs per node).
            ranks_per_node=row.host.ranks_per_node if row.host else workload.world_size,
        )
        return probe_seconds(
            build_s=build_s,
            step_seconds=steps,
            steps=self.template.warmup_steps + self.template.timed_steps,
        )

    def _cost_scale(self) -> float:
        """How long the run's probes took against their predicted cost (median ratio)."""
        if not self._durations:
            return 1.0
        return statistics.median(
            m / p for m, p in zip(self._durations, self._predicted, strict=True)
        )

    def _fail_stale(self) -> list[int]:
        """Fail the trials of tuners that ended (their points are retried once), and say so."""
        stale = self.store.fail_stale()
        if stale:
            self.on_event(
                Event(
                    kind="resume",
                    message=f"{len(stale)} trial(s) left running by a tuner that ended were "
                    "failed; their points are retried once",
                )
            )
        return stale

    def run(self) -> RunSummary:
        """Search until done; returns why it stopped and the best measurement.

        The search is done when nothing is left to propose and no other worker's probe is in
        flight: while one is, its result may open more of the search or move the best, so the
        run waits for it (its budget still counts) and reads the study again; a worker that
        died meanwhile has its trials failed, and their points are retried.
        """
        stale = self._fail_stale()
        probes = 0
        pause = WAIT_FIRST_S
        waiting = False
        reason = "search done: no remaining configuration can beat the best measured"
        interrupted: str | None = None
        failure: str | None = None
        mistake: str | None = None
        sizes = micro_batch_options(self.store.workload)
        objective = self.store.fingerprint.objective
        following: tuple[Proposal, float] | None = None
        try:
            while True:
                left = self.budget_s - self.elapsed()
                if left <= 0:
                    reason = "budget spent"
                    break
                measurements = self.store.measurements()
                proposal = propose(self.rows, measurements, sizes, objective)
                if proposal is None:
                    in_flight = sum(m.state == "RUNNING" for m in measurements)
                    if not in_flight:
                        break
                    if not waiting:
                        self.on_event(
                            Event(
                                kind="wait",
                                best=self.store.best(measurements),
                                probes=probes,
                                budget_left_s=left,
                                message=f"waiting for {in_flight} trial(s) that other workers "
                                "are probing",
                            )
                        )
                    waiting = True
                    ended = self._fail_stale()  # a worker that died: its points are open again
                    if ended:
                        stale += ended
                        continue
                    time.sleep(pause)
                    pause = min(2 * pause, WAIT_LONGEST_S)
                    continue
                waiting, pause = False, WAIT_FIRST_S
                self._set_up(proposal, probes)
                left = self.budget_s - self.elapsed()
                predicted_s = self._predicted_s(proposal)
                need = max(predicted_s * self._cost_scale(), MIN_PROBE_TIMEOUT_S)
                if probes and left < need:
                    following = (proposal, need)
                    reason = (
                        f"budget spent: next would be {proposal.config.label()} at micro-batch "
                        f"{','.join(map(str, proposal.micro_batch_sizes))}, about {need:.0f} s "
                        f"with {left:.0f} s left; a run with more budget resumes there"
                    )
                    break
                announce = functools.partial(
                    self.on_event,
                    Event(
                        kind="probe",
                        proposal=proposal,
                        best=self.store.best(measurements),
                        probes=probes,
                        budget_left_s=left,
                    ),
                )
                result = self._probe(
                    proposal,
                    left_s=left,
                    predicted_s=predicted_s,
                    announce=announce,
                    # The run's first probe of a job with nothing measured yet: a smoke test.
                    smoke=not probes and self.store.best(measurements) is None,
                )
                if result is None:
                    # Another worker took a point of it: propose again from what it claimed,
                    # after a random pause (two workers that withdrew at once part ways).
                    time.sleep(random.uniform(0.05, 0.5))
                    continue
                probes += 1
                self._landed = False
                recorded = self.store.measurements()
                self.on_event(
                    Event(
                        kind="result",
                        proposal=proposal,
                        result=result,
                        measured=[m for m in recorded if m.probe_dir == str(result.probe_dir)],
                        best=self.store.best(recorded),
                        probes=probes,
                        budget_left_s=self.budget_s - self.elapsed(),
                    )
                )
        except _Stop as stop:
            reason, failure, mistake = str(stop), stop.failure, stop.mistake
            probes += self._landed  # a probe whose job did not run as asked ran all the same
        except STORAGE_ERRORS as error:
            cut = _interruption(error)
            if cut is not None:
                # Its record failed: the probe's trials stay RUNNING, and the next run fails
                # them as stale and probes their points again.
                interrupted = str(cut) or "Ctrl-C"
                probes += self._probing or self._landed
                reason = (
                    f"interrupted ({interrupted}); recording it failed: "
                    f"{storage_problem(error)}; a probe that was running is probed again by "
                    "the next run"
                )
            else:
                failure = storage_problem(error)
                lost = self.store.lost_file()
                reason = (
                    f"the trial database failed: {failure}; {lost}, and the trials it held "
                    "are lost with it"
                    if lost
                    else f"the trial database failed: {failure}; the trials recorded before "
                    "are kept, and a probe that was running is probed again by the next run"
                )
        except KeyboardInterrupt as stop:
            interrupted = str(stop) or "Ctrl-C"
            # The probe it stopped ran, and is recorded interrupted; one that had ended ran too.
            probes += self._probing or self._landed
            reason = (
                f"interrupted ({interrupted}) during the set-up step ({self._setting_up}): "
                "it was stopped; no probe was running"
                if self._setting_up
                else f"interrupted ({interrupted}) while waiting for other workers' probes: "
                "no probe was running"
                if waiting
                else f"interrupted ({interrupted}): the running probe was stopped and recorded"
                if self._probing
                else f"interrupted ({interrupted}) while the probe that ended was recorded: what "
                "it recorded stands, and the next run probes the rest again"
                if self._landed
                else f"interrupted ({interrupted}) between probes: no probe was running"
            )
        try:
            measurements = self.store.measurements()
        except STORAGE_ERRORS:
            measurements = []  # the database cannot be read either: the reason says why
        best = self.store.best(measurements) if measurements else None
        self.on_event(Event(kind="stop", best=best, probes=probes, message=reason))
        return RunSummary(
            stop_reason=reason,
            interrupted=interrupted,
            failure=failure,
            mistake=mistake,
            stale=len(stale),
            probes=probes,
            elapsed_s=self.elapsed(),
            best=best,
            measurements=measurements,
            next_proposal=following[0] if following else None,
            next_s=following[1] if following else None,
            setups=list(self._setups),
            learnt=list(self._learnt),
        )

    def _set_up(self, proposal: Proposal, probes: int) -> None:
        """Run the device's set-up steps for the proposal's probe, if it has any: charged
        neither to a probe nor to the run's budget (an op build of minutes on a busy machine
        would otherwise spend a short budget before the first probe); the summary lists each
        with its time."""
        spec = self.template.spec(
            proposal.config, proposal.micro_batch_sizes, timeout_s=self.probe_timeout_s
        )
        for step in self.device.setup(spec):
            self.on_event(
                Event(
                    kind="setup",
                    message=step.label,
                    probes=probes,
                    budget_left_s=self.budget_s - self.elapsed(),
                )
            )
            self._setting_up = step.label
            done = step.run()
            self._setting_up = None
            self.clock.exempt(done.seconds)
            self._setups.append(done)
            self.on_event(
                Event(
                    kind="setup_done",
                    setup=done,
                    message=done.message,
                    probes=probes,
                    budget_left_s=self.budget_s - self.elapsed(),
                )
            )

    def _timeout(self, left_s: float, predicted_s: float | None = None) -> tuple[float, bool]:
        """The next probe's timeout, and whether the budget (not a hang guard) sets it.

        The hang guard scales the longest probe measured so far; before any, the probe's own
        ``predicted_s`` (None: ``probe_timeout_s`` alone)."""
        guard = self.probe_timeout_s
        if self._durations:
            longest = max(self._durations)
            guard = min(guard, max(FIRST_PROBE_GUESS_S, HANG_FACTOR * longest))
        elif predicted_s is not None:
            guard = min(guard, max(MIN_PROBE_TIMEOUT_S, HANG_FACTOR * predicted_s))
        return max(min(guard, left_s), MIN_PROBE_TIMEOUT_S), left_s < guard

    def _probe(
        self,
        proposal: Proposal,
        *,
        left_s: float,
        predicted_s: float,
        announce: Callable[[], None],
        smoke: bool = False,
    ) -> ProbeResult | None:
        """Probe the proposal (``announce`` once its points are claimed, so a point another
        worker took is never shown as a probe); None when another worker claimed one of its
        points first.

        A probe of the user's job that shows the job's own mistake (the measurement layer's:
        an ignored flag, another engine, an end before its first step), or with ``smoke`` any
        error (the job crashed or rejected its arguments), stops the run: nothing is recorded
        against the configuration, and the reason says what the job did and what to check.
        """
        timeout_s, budget_bound = self._timeout(left_s, predicted_s)
        spec = self.template.spec(
            proposal.config,
            proposal.micro_batch_sizes,
            timeout_s=timeout_s,
            seed=proposal.data_seed,  # a re-measurement: other data, an independent sample
        )
        try:
            probe_dir = new_probe_dir(
                self.trials_dir.resolve(), _folder(self.store.study.study_name)
            )
        except OSError as error:
            why = f"no probe folder can be made in {self.trials_dir} ({error.strerror or error})"
            hint = folder_hint(error.strerror or str(error))
            raise _Stop(f"{why}: {hint}", failure=why) from None
        trials: list[Trial] = []
        try:
            # An interruption inside the claim leaves RUNNING trials of this process, which
            # the next run fails as stale.
            trials = self.store.claim(proposal.config, proposal.repeats()) or []
            if not trials:
                with contextlib.suppress(OSError):
                    probe_dir.rmdir()  # another worker holds a point of it: no probe here
                return None
            announce()
            self._probing = True  # until the probe returns: an interruption leaves it set
            result = self._launch(spec, probe_dir, trials)
            self._probing, self._landed = False, not result.tuner_fault
        except KeyboardInterrupt:
            self.store.interrupt(trials, probe_dir, "interrupted")
            raise
        if result.tuner_fault:
            # No evidence about the configuration: the claim is taken back, the run stops.
            self.store.withdraw(trials, result.tuner_fault)
            shutil.rmtree(probe_dir, ignore_errors=True)
            raise _Stop(
                f"{result.tuner_fault}; nothing was recorded against {proposal.config.label()}",
                failure=result.tuner_fault,
            )
        mistake = _job_mistake(result, smoke)
        # Another engine than asked: the job's own choice, learnt (unless nothing re-plans).
        learns = mistake is not None and result.other_engine is not None and bool(self.replan)
        if mistake is not None and not learns:
            self.store.withdraw(trials, mistake)  # the probe folder stays: its logs
            raise _Stop(
                f"{mistake} (the probe's logs: {probe_dir}); nothing was recorded against "
                f"{proposal.config.label()}",
                mistake=mistake,
            )
        self._durations.append(result.wall_s)
        self._predicted.append(predicted_s)
        self.clock.charge(result.wall_s)
        if result.outcome is Outcome.TIMEOUT and budget_bound:
            # Cut by the end of the budget, not hung: a later run with time retries it.
            self.store.interrupt(trials, probe_dir, "the budget ended during the probe")
            return result
        try:
            self.store.record(trials, result)
        except STORAGE_ERRORS:
            # Mark the probe's trials interrupted where the database still takes that much
            # (the next run retries them either way: as interrupted, or as stale).
            with contextlib.suppress(*STORAGE_ERRORS):
                self.store.interrupt(trials, probe_dir, "its result could not be recorded")
            raise
        self._learn_job()
        if learns:
            self._learnt_engines(result, str(mistake), probes=len(self._durations))
        return result

    def _learnt_engines(self, result: ProbeResult, mistake: str, *, probes: int) -> None:
        """Say what a probe that trained under another engine than asked taught the search:
        the engines the job trains under (the rows are re-planned to them); stop the run
        where the space it searches holds none of them."""
        workload = self.store.workload
        seen = result.other_engine
        wrapper = seen.extra.get("wrapper") if seen is not None else None
        asked = result.spec.config.label()
        if not self.rows:
            found = workload.job_engines_unsearched("its probes found")
            raise _Stop(f"{mistake}; {found}", mistake=mistake)
        line = (
            f"your job trained under {wrapper or 'another engine'} where autotune asked for "
            f"{asked}: the search keeps to {workload.job_engines_text()}, the engines it "
            "trains under when asked"
        )
        self._learnt.append(line)
        self.on_event(
            Event(
                kind="learn",
                message=line,
                probes=probes,
                budget_left_s=self.budget_s - self.elapsed(),
            )
        )

    def _learn_job(self) -> None:
        """Re-plan once probes of the user's job measured it otherwise than the rows assume
        (:func:`~autotune.study.measurement.measured_workload`: the dtype its loss takes the
        logits in, the wrapper of a lone rank): every prediction from here on counts the
        job's own terms, and the measurements recorded so far are read against the new
        predictions (the ladder calibrates on their ratios)."""
        if self.replan is None:
            return
        workload = measured_workload(self.store.workload, self.store.measurements())
        if workload == self.store.workload:
            return
        self.rows = self.replan(workload)
        self._rows = {row.config: row for row in self.rows}
        self.store.workload = workload
        self.store.estimates = point_estimates(self.rows, workload)

    def _launch(self, spec: ProbeSpec, probe_dir: Path, trials: list[Trial]) -> ProbeResult:
        """The device's answer to ``spec``; a probe folder the device itself cannot write (a
        full disk under the simulated or replayed device, which write their results there
        too) is the tuner's fault, as the launcher reports it for real ranks."""
        try:
            return self.device.launch(spec, probe_dir, on_poll=lambda _: self.store.beat(trials))
        except OSError as error:
            interruption = _interruption(error)
            if interruption is not None:
                raise interruption from None  # a stop that a failing clean-up hid
            if error.errno not in _DISK_ERRNOS and not _within(error.filename, probe_dir):
                raise  # not the folder's fault
            return ProbeResult(
                spec=spec,
                probe_dir=probe_dir,
                outcome=Outcome.ERROR,
                stage=Stage.STARTUP,
                message=str(error),
                device=spec.device,
                tuner_fault=folder_fault(probe_dir, error.strerror or str(error)),
            )


_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
"""A full disk, a quota or a read-only file system: a write's failure that names no file (a
``write`` or a ``close``) but the folder's disk."""


def _interruption(error: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C or SIGTERM ``error`` was raised while handling, if any (an interruption
    whose clean-up failed is still an interruption)."""
    seen: BaseException | None = error.__context__
    while seen is not None:
        if isinstance(seen, KeyboardInterrupt):
            return seen
        seen = seen.__context__
    return None


def _within(filename: object, folder: Path) -> bool:
    """Whether the file an ``OSError`` names lies in ``folder``."""
    if not isinstance(filename, str | bytes | os.PathLike):
        return False
    return Path(os.fsdecode(filename)).absolute().is_relative_to(folder.absolute())


def _job_mistake(result: ProbeResult, smoke: bool) -> str | None:
    """What a probe of the user's job says the job did wrong, in one line (the job's own last
    lines included), or None: the layer's checks at any probe; with ``smoke`` (the run's
    first probe, nothing fitted yet) any error too, a crash or rejected arguments, and a
    hang before the job's first training step."""
    if result.spec.script is None:
        return None
    if result.job_mistake is not None:
        return result.message or result.job_mistake
    if smoke and result.outcome is Outcome.ERROR:
        return (
            f"the job failed at the first probe: {result.message}: check that it runs with the "
            "arguments after -- and the --framework given"
        )
    if smoke and result.outcome is Outcome.TIMEOUT and result.stage is Stage.STARTUP:
        # It hung before its first training step: every probe after would wait as long.
        return f"the job hung at the first probe: {result.message}"
    return None


class _Stop(Exception):
    """Ends the run early with its message as the reason (no probe is running); with
    ``failure``, a fault of the tuner's own (the run's summary says it failed); with
    ``mistake``, the user's job's own (the command says it as bad input)."""

    def __init__(
        self, reason: str, *, failure: str | None = None, mistake: str | None = None
    ) -> None:
        super().__init__(reason)
        self.failure = failure
        self.mistake = mistake


def _folder(study_name: str) -> str:
    """A study name as one folder name under the trials directory."""
    return study_name.replace("/", "__").replace("@", "_at_")
