"""What ``autotune run`` shows while it works.

Every probe leaves one line (a log that reads the same in a terminal, a CI log or a nightly
job's output file), and so does a device's set-up step (building DeepSpeed's ops, with its
time). On a terminal a status panel stays below the lines and refreshes a few times a second:
the current rung and micro-batch (or the set-up step), how long it has run, the last outcome,
the best so far (tokens/s and MFU), probes done, and the budget as a bar.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from types import TracebackType

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table

from autotune.devices.base import SetupResult
from autotune.probe.result import SizeResult
from autotune.search.controller import Event
from autotune.study.fingerprint import Objective
from autotune.study.measurement import Measurement, prediction_gap
from autotune.units import format_duration

__all__ = ["RunView", "outcome_text", "speed_text"]


def outcome_text(sizes: Iterable[SizeResult], fallback: str) -> str:
    """One probe's sizes as ``2: ok 10,803 tok/s, 4: oom`` (or the probe's outcome), at the
    probe's own accumulation (``autotune probe``)."""
    parts = []
    for s in sizes:
        text = f"{s.micro_batch_size}: {s.outcome}"
        if s.tokens_per_second:
            text += f" {s.tokens_per_second:,.0f} tok/s"
        parts.append(text)
    return ", ".join(parts) or fallback


def measured_text(measured: Iterable[Measurement], fallback: str) -> str:
    """A probe's sizes as the study recorded them, at the workload's accumulation (the
    figure of the tables): ``2: ok 10,803 tok/s (accum 4), 4: oom``."""
    parts = []
    for m in sorted(measured, key=lambda m: m.micro_batch_size):
        text = f"{m.micro_batch_size}: {m.outcome or m.state.lower()}"
        if m.tokens_per_second:
            text += f" {m.tokens_per_second:,.0f} tok/s (accum {m.grad_accum})"
        parts.append(text)
    return ", ".join(parts) or fallback


def speed_text(m: Measurement | None) -> str:
    """``74,270 tokens/s, MFU 43.2%`` at the user's global batch (``-`` without one)."""
    if m is None or not m.value:
        return "-"
    return f"{m.tokens_per_second or 0:,.0f} tokens/s" + (f", MFU {m.mfu:.1%}" if m.mfu else "")


def print_setup_done(console: Console, done: SetupResult) -> None:
    """A finished set-up step: its warnings, then how it ended, in how long."""
    for warning in done.warnings:
        console.print(f"  {warning}", style="yellow", markup=False, highlight=False)
    line = f"  {'done' if done.ok else 'failed'} in {format_duration(done.seconds)}: "
    console.print(
        line + done.message, style="" if done.ok else "red", markup=False, highlight=False
    )


class RunView:
    """Consumes the controller's events; a context manager around the run."""

    def __init__(
        self,
        console: Console,
        *,
        budget_s: float,
        simulated: bool,
        objective: Objective = Objective.TOKENS,
        live: bool | None = None,
        job: bool = False,
    ) -> None:
        self.console = console
        self.job = job
        """The probes run the user's job: the view says how far the job was from the
        stand-in's prediction after the first probe that measured."""
        self._gap_said = False
        self.budget_s = budget_s
        self.simulated = simulated
        self.objective = objective
        self.live = console.is_terminal if live is None else live
        self._event: Event | None = None
        self._event_at = time.monotonic()
        self._last = "-"
        self._best: Measurement | None = None
        self._probes = 0
        self._screen: Live | None = None

    def __enter__(self) -> RunView:
        if self.live:
            self._screen = Live(self, console=self.console, refresh_per_second=4, transient=True)
            self._screen.__enter__()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self._screen is not None:
            self._screen.__exit__(kind, error, trace)
            self._screen = None

    def __call__(self, event: Event) -> None:
        self._event, self._event_at = event, time.monotonic()
        self._probes = event.probes
        self._best = event.best or self._best
        if event.kind == "resume":
            self.console.print(f"[yellow]resumed: {event.message}[/]")
        elif event.kind == "probe" and event.proposal:
            p = event.proposal
            predicted = self.objective.text(p.predicted)
            if p.riding is not None:
                why = f"predicted {predicted}; {p.riding} re-measures the best"
            elif p.repeat:
                why = (
                    f"re-measure {p.repeat}: the best or within the noise of it, "
                    f"measured {predicted}"
                )
            else:
                why = f"predicted {predicted}"
            self.console.print(
                f"[dim]probe {event.probes + 1}: {p.config.label()} at micro-batch "
                f"{','.join(map(str, p.micro_batch_sizes))} ({why})[/]"
            )
        elif event.kind == "result" and event.result:
            self._last = (
                measured_text(event.measured, event.result.outcome.value)
                if event.measured
                else outcome_text(event.result.sizes, event.result.outcome.value)
            )
            self.console.print(f"  {self._last}")
            self._say_gap(event.measured)
        elif event.kind == "setup":
            line = f"set-up: {event.message} (its own step, in no probe)"
            self.console.print(line, style="dim", markup=False, highlight=False)
        elif event.kind == "setup_done" and event.setup:
            print_setup_done(self.console, event.setup)
        elif event.kind == "learn":
            self.console.print(f"  {event.message}", markup=False, highlight=False)
        elif event.kind == "wait":
            self.console.print(event.message, style="dim", markup=False, highlight=False)

    def _say_gap(self, measured: list[Measurement]) -> None:
        if not self.job or self._gap_said:
            return
        gap = prediction_gap(measured)
        if gap is not None:
            self._gap_said = True
            self.console.print(
                f"  your job: {gap.text()} for autotune's stand-in{gap.loss_note()}; the "
                "search now calibrates on your job",
                style="dim",
                markup=False,
                highlight=False,
            )

    def _budget_left(self) -> float:
        event = self._event
        if event is None:
            return self.budget_s
        if event.kind == "stop":
            return 0.0
        left = event.budget_left_s
        if not self.simulated:  # wall-clock keeps running while a probe does
            left -= time.monotonic() - self._event_at
        return max(0.0, left)

    def __rich__(self) -> RenderableType:
        event = self._event
        status = Table.grid(padding=(0, 2))
        status.add_column(style="bold")
        status.add_column()
        if event is not None and event.kind == "setup":
            running = time.monotonic() - self._event_at
            status.add_row("set-up", f"{event.message} ({format_duration(running)})")
        if event is not None and event.kind == "wait":
            waited = time.monotonic() - self._event_at
            status.add_row("waiting", f"{event.message} ({format_duration(waited)})")
        if event is not None and event.kind == "probe" and event.proposal:
            p = event.proposal
            running = time.monotonic() - self._event_at
            status.add_row(
                "probing",
                f"{p.config.label()} at micro-batch {','.join(map(str, p.micro_batch_sizes))}"
                + (f", re-measure {p.repeat}" if p.repeat and p.riding is None else "")
                + (f" ({p.riding} re-measured)" if p.riding is not None else "")
                + ("" if self.simulated else f" ({format_duration(running)})"),
            )
        status.add_row("last", self._last)
        best = self._best
        status.add_row(
            "best",
            f"{speed_text(best)} ({best.config.label()}, micro-batch {best.micro_batch_size})"
            if best
            else "-",
        )
        left = self._budget_left()
        status.add_row("probes", str(self._probes))
        bar = ProgressBar(total=self.budget_s, completed=self.budget_s - left, width=40)
        budget = Table.grid(padding=(0, 1))
        budget.add_row(bar, f"{format_duration(left)} of {format_duration(self.budget_s)} left")
        status.add_row("budget", budget)
        return Group(status)
