"""The terminal tables of every command: a probe's sizes, a plan, the best configurations of a
run or of a trial database, its trials, and the model presets.

Each function takes the typed result the library returns and gives a rich renderable; the
command line only prints it. ``--json`` output comes from the results' own ``to_dict``.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable, Sequence

from rich.console import Group, RenderableType
from rich.table import Column, Table
from rich.text import Text

from autotune.estimator.plan import PlanRow
from autotune.estimator.rlhf import RLHFRow
from autotune.jobs import JobResult
from autotune.models import ModelSpec
from autotune.probe.result import ProbeResult
from autotune.probe.spec import ProbeSpec, ProbeTemplate
from autotune.study.measurement import Measurement, pooled
from autotune.units import format_bytes, format_duration

__all__ = [
    "best_table",
    "models_table",
    "plan_table",
    "pooled_note",
    "printable",
    "probe_report",
    "ranking_table",
    "ranks_text",
    "trials_table",
]


def _fmt(value: float | None, spec: str, empty: str = "-") -> str:
    return empty if value is None else format(value, spec)


def _bytes(value: int | None) -> str:
    return format_bytes(value) if value else "-"


def pooled_note(repeats: int) -> str:
    """What follows a speed that is the mean of several measurements of one point."""
    return f" (mean of {repeats})" if repeats > 1 else ""


def ranks_text(spec: ProbeSpec | ProbeTemplate) -> str:
    """The ranks of a probe or a run: ``8`` on one node, ``2 nodes x 8`` across nodes."""
    if spec.nodes == 1:
        return str(spec.num_processes)
    return f"{spec.nodes} nodes x {spec.num_processes}"


def probe_report(result: ProbeResult) -> RenderableType:
    """One probe: a header line, a row per micro-batch size, the outcome and where it lies."""
    spec = result.spec
    device = result.device + (f" ({result.gpu_name})" if result.gpu_name else "")
    limit = spec.device_memory_bytes
    header = (
        f"[bold]{spec.model}[/] seq {spec.seq_len} · {spec.config.label()} · "
        f"{ranks_text(spec)} x {device}"
        + (f" · [magenta]emulated device memory {format_bytes(limit)}[/]" if limit else "")
    )
    table = Table(show_header=True, header_style="bold")
    for column in (
        "micro-batch", "outcome", "tokens/s", "tokens/s/rank", "MFU", "step", "peak alloc",
        "peak reserved", "loss",
    ):  # fmt: skip
        table.add_column(column, justify="right")
    for size in result.sizes:
        outcome = (
            "[green]ok[/]"
            if size.ok
            else f"[red]{size.outcome}[/]" + (f" ({size.stage})" if size.stage else "")
        )
        losses = size.losses
        table.add_row(
            str(size.micro_batch_size),
            outcome,
            _fmt(size.tokens_per_second, ",.0f"),
            _fmt(size.tokens_per_second_per_rank, ",.0f"),
            _fmt(size.mfu, ".1%"),
            format_duration(size.step_s) if size.step_s else "-",
            _bytes(size.peak_allocated_bytes),
            _bytes(size.peak_reserved_bytes),
            f"{losses[0]:.3f} → {losses[-1]:.3f}" if losses else "-",
        )
    colour = "green" if result.outcome == "ok" else "red"
    timing = ", ".join(
        f"{name} {format_duration(value)}"
        for name, value in (
            ("start-up", result.startup_s),
            ("build", result.build_s),
            ("wall", result.wall_s),
        )
        if value is not None
    )
    footer = (
        f"outcome [{colour}]{result.outcome}[/]"
        + (f" at {result.stage}" if result.stage else "")
        + (f": {result.message}" if result.message else "")
        + f" · {timing}"
    )
    parts: list[RenderableType] = [header, table, footer]
    if result.device == "cpu" and not result.gpu_name:
        parts.append("[dim]CPU probe: no MFU; memory is live tensor bytes on the host[/]")
    parts.append(f"[dim]probe folder {result.probe_dir}[/]")
    return Group(*parts)


def plan_table(
    rows: list[PlanRow], *, title: str, top: int = 0, seconds: float | None = None
) -> RenderableType:
    """The planner's rows, fastest fitting first; a footer with how many fit."""
    shown = rows if top <= 0 else rows[:top]
    table = Table(
        "#", "configuration", "mbs", "accum", "peak memory", "host", "fits", "tokens/s", "MFU",
        "peak at", header_style="bold", title=title,
    )  # fmt: skip
    for index, row in enumerate(shown, 1):
        fits = "yes" if row.fits else f"[red]no, {row.miss}[/]"
        table.add_row(
            str(index),
            row.config.label(),
            str(row.micro_batch_size),
            str(row.grad_accum),
            format_bytes(row.memory.device_bytes),
            format_bytes(row.host.node_bytes) if row.host else "-",
            fits,
            _fmt(row.time.tokens_per_second if row.time else None, ",.0f"),
            _fmt(row.time.mfu if row.time else None, ".1%"),
            row.memory.phase,
        )
    fitting = sum(row.fits for row in rows)
    usable = format_bytes(rows[0].capacity_bytes) if rows else "-"
    host = rows[0].host_capacity_bytes if rows else None
    on_host = f" and {format_bytes(host)} of host memory per node" if host is not None else ""
    took = f" in {seconds * 1000:.0f} ms" if seconds is not None else ""
    footer = (
        f"[dim]{len(rows)} configurations ({fitting} fit in {usable} usable per GPU{on_host})"
        f"{took}[/]"
    )
    return Group(table, footer)


def rlhf_plan_table(
    rows: list[RLHFRow], *, title: str, top: int = 0, seconds: float | None = None
) -> RenderableType:
    """The RLHF planner's layouts, most samples a second first; each phase's peak per GPU; a
    footer with how many fit."""
    shown = rows if top <= 0 else rows[:top]
    table = Table(
        "#", "trainer", "share", "sleep", "frozen", "mbs", "accum", "rollout", "scoring",
        "training", "seqs at once", "fits", "samples/s", "iteration", header_style="bold",
        title=title,
    )  # fmt: skip
    for index, row in enumerate(shown, 1):
        phases = row.phases
        table.add_row(
            str(index),
            row.config.label(),
            f"{row.share:.0%}",
            "yes" if row.sleep else "no",
            row.frozen.value,
            str(row.micro_batch_size),
            str(row.grad_accum),
            *(format_bytes(phases[p]) for p in ("rollout", "scoring", "training")),
            str(row.engine.sequences),
            "yes" if row.fits else f"[red]no, {row.miss}[/]",
            _fmt(row.samples_per_second if row.fits else None, ",.2f"),
            format_duration(row.iteration_s) if row.fits else "-",
        )
    fitting = sum(row.fits for row in rows)
    usable = format_bytes(rows[0].capacity_bytes) if rows else "-"
    took = f" in {seconds * 1000:.0f} ms" if seconds is not None else ""
    footer = (
        f"[dim]{len(rows)} layouts ({fitting} fit in {usable} usable per GPU){took}; the "
        "rollout's speed rests on assumed efficiencies (docs/rlhf.md)[/]"
    )
    return Group(table, footer)


def ranking_table(
    measurements: Iterable[Measurement], capacity_bytes: int, *, top: int = 5
) -> Table:
    """The best feasible size of each configuration of a run, fastest first."""
    per_config: dict[object, Measurement] = {}
    for m in pooled(measurements):
        if m.value:
            held = per_config.get(m.config)
            if held is None or (held.value or 0) < m.value:
                per_config[m.config] = m
    ranked = sorted(per_config.values(), key=lambda m: -(m.value or 0))[:top]
    table = Table(title="best configurations", title_justify="left")
    for name in ("", "configuration", "micro-batch", "accum", "tokens/s", "MFU", "peak"):
        table.add_column(name, justify="left" if name == "configuration" else "right")
    for i, m in enumerate(ranked, 1):
        peak = m.peak_bytes or 0
        table.add_row(
            str(i),
            m.config.label(),
            str(m.micro_batch_size),
            str(m.grad_accum or ""),
            f"{m.tokens_per_second or 0:,.0f}" + pooled_note(m.repeats),
            _fmt(m.mfu, ".1%"),
            f"{format_bytes(peak)} ({peak / capacity_bytes:.0%})" if capacity_bytes else "-",
        )
    return table


def best_table(studies: Iterable[tuple[str, Measurement | None, int]]) -> Table:
    """The best configuration of each study: (study name, best measurement, trials)."""
    table = Table(
        Column("study", overflow="fold"),  # whole: its name is what --study takes
        "configuration", "mbs", "accum", "tokens/s", "MFU", "peak", "trials",
        header_style="bold",
    )  # fmt: skip
    for name, m, count in studies:
        if m is None:
            table.add_row(name, "[red]nothing fits yet[/]", "-", "-", "-", "-", "-", str(count))
            continue
        table.add_row(
            name,
            m.config.label(),
            str(m.micro_batch_size),
            str(m.grad_accum or "-"),
            _fmt(m.tokens_per_second, ",.0f") + pooled_note(m.repeats),
            _fmt(m.mfu, ".1%"),
            _bytes(m.peak_bytes),
            str(count),
        )
    return table


def jobs_table(results: Iterable[JobResult]) -> Table:
    """What became of each workload of a job file: tuned, skipped (and why), failed."""
    table = Table(title="workloads", title_justify="left", header_style="bold")
    for name in ("", "workload", "status", "why", "best", "tokens/s", "probes", "time"):
        table.add_column(
            name, justify="right" if name in ("", "tokens/s", "probes", "time") else "left"
        )
    colours = {"tuned": "green", "skipped": "cyan", "failed": "red", "no fit": "red"}
    for r in results:
        best = r.best
        run = r.summary
        status = r.status
        colour = colours.get(status)
        table.add_row(
            str(r.job.index),
            r.job.label(),
            f"[{colour}]{status}[/]" if colour else status,
            Text(printable(r.why)),
            "-" if best is None else f"{best.config.label()} mbs {best.micro_batch_size}",
            _fmt(None if best is None else best.tokens_per_second, ",.0f"),
            "-" if run is None else str(run.probes),
            "-" if run is None else format_duration(run.elapsed_s),
        )
    return table


def printable(text: str) -> str:
    """``text`` as a terminal may show it: each control character but a line break and a tab
    (an escape sequence that clears the screen or sets the window's title, a carriage
    return, a bell) written out as Python writes it in a string (``\\x1b``), the rest as is.
    Names from outside (a model's folder, a study's, a probe's message) reach the terminal
    only through this (the files autotune writes escape them by their own formats)."""
    if text.isprintable():
        return text
    return "".join(
        ch
        if ch in "\n\t" or unicodedata.category(ch) != "Cc"
        else ch.encode("unicode_escape").decode("ascii")
        for ch in text
    )


def trials_table(
    study_name: str, measurements: Sequence[Measurement], *, total: int | None = None
) -> Table:
    """The trials of one study: configuration, size, outcome, speed, memory, folder; with
    ``total`` above the rows given, a caption says how many are not shown."""
    caption = None
    if total is not None and total > len(measurements):
        caption = f"the last {len(measurements)} of {total:,} trials: --last N or --all for more"
    table = Table(
        "#", "configuration", "mbs", "outcome", "tokens/s", "MFU", "peak", "probe folder",
        header_style="bold", title=study_name, caption=caption,
    )  # fmt: skip
    for m in measurements:
        outcome = m.outcome or m.state.lower()
        if m.state == "COMPLETE" and not m.feasible:
            outcome = f"[red]{outcome}[/]"
        if m.repeat:
            outcome += f" (re-measure {m.repeat})"
        table.add_row(
            str(m.number),
            m.config.label(),
            str(m.micro_batch_size),
            outcome,
            _fmt(m.tokens_per_second, ",.0f"),
            _fmt(m.mfu, ".1%"),
            _bytes(m.peak_bytes),
            Text(printable(m.probe_dir or "-")),
        )
    return table


def _count(n: int) -> str:
    """6.74 B, 124.4 M, 0.2 M: parameter counts the way papers write them."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def models_table(specs: Iterable[ModelSpec], seq_len: int = 2048) -> Table:
    """The model presets with their shapes, parameter counts and FLOPs per token."""
    table = Table(
        "model", "params", "layers", "hidden", "heads", "kv heads", "vocab",
        f"GFLOP/token @{seq_len // 1024}k", header_style="bold",
    )  # fmt: skip
    for spec in specs:
        table.add_row(
            spec.name,
            _count(spec.num_params),
            str(spec.num_layers),
            str(spec.hidden_size),
            str(spec.num_attention_heads),
            str(spec.num_key_value_heads),
            str(spec.vocab_size),
            f"{spec.flops_per_token(seq_len) / 1e9:.2f}",
        )
    return table
