"""``autotune report``: one study as a self-contained HTML page that works offline.

The page holds four charts (plotly, its JavaScript inlined once) and two tables:

- memory per GPU of each configuration probed: the estimator's predicted breakdown as a
  stacked bar beside the measured peak, the usable memory of the card as a line;
- tokens/s and MFU against micro-batch, a line per configuration, OOMs marked where they hit;
- the search's path: each probe's objective over time (or trial number), the best so far and
  the budget, when given;
- the best configuration with its launch in every format that can express it, and every
  probe with a link to its folder.

Every text that comes from the study (labels, messages, paths, the study's name) is escaped:
``html.escape`` in the page, plotly's JSON encoding (``<`` as ``\\u003c``) in the charts.
Plotly is imported inside :func:`render_html`: the rest of autotune never loads it.
"""

from __future__ import annotations

import datetime as dt
import html
import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.estimator.memory import CATEGORIES, estimate_memory
from autotune.models import ModelSpec
from autotune.study.fingerprint import Fingerprint
from autotune.study.measurement import (
    Measurement,
    StudyResult,
    best_point,
    measured_workload,
    parse_time,
    prediction_gap,
)
from autotune.study.schema import sqlite_path
from autotune.tuned.script import ScriptJob
from autotune.units import format_bytes, format_duration

__all__ = ["TrialTimes", "read_trial_times", "render_html"]

GIB = float(1 << 30)
FAILED = ("oom", "host_oom")
"""Outcomes drawn as an out-of-memory mark."""


@dataclass(frozen=True)
class TrialTimes:
    """When a trial started and ended (Optuna's ``datetime_start``/``datetime_complete``)."""

    start: dt.datetime | None
    complete: dt.datetime | None


_TIMES_QUERY = (
    "SELECT t.number, t.datetime_start, t.datetime_complete FROM trials t "
    "JOIN studies s ON s.study_id = t.study_id WHERE s.study_name = {name}"
)


def read_trial_times(storage: str, study_name: str) -> dict[int, TrialTimes]:
    """Start and end of each trial of a study, read from Optuna's ``trials`` table (empty
    where the storage cannot tell: the search's chart then goes by trial number)."""
    rows: Sequence[Sequence[Any]] = []
    path = sqlite_path(storage)
    try:
        if path is not None and "?" not in storage:
            connection = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)
            try:
                rows = connection.execute(_TIMES_QUERY.format(name="?"), (study_name,)).fetchall()
            finally:
                connection.close()
        else:
            import sqlalchemy

            engine = sqlalchemy.create_engine(storage)
            try:
                with engine.connect() as link:
                    query = sqlalchemy.text(_TIMES_QUERY.format(name=":name"))
                    rows = [tuple(r) for r in link.execute(query, {"name": study_name})]
            finally:
                engine.dispose()
    except Exception:  # the times only choose the chart's axis
        return {}
    return {int(n): TrialTimes(parse_time(s), parse_time(c)) for n, s, c in rows}


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _latest_per_point(measurements: Sequence[Measurement]) -> list[Measurement]:
    """The latest trial of each (configuration, micro-batch), in the order first probed."""
    points: dict[tuple[Any, int], Measurement] = {}
    for m in sorted(measurements, key=lambda m: m.number):
        points[m.key] = m
    return list(points.values())


def _memory_figure(
    study: StudyResult, model: ModelSpec, go: Any, capacity_bytes: int, cuda: bool
) -> Any:
    fp = study.fingerprint
    points = _latest_per_point(study.measurements)
    names = [f"{m.config.label()} · mb {m.micro_batch_size}" for m in points]
    workload = measured_workload(fp.workload, study.measurements)
    estimates = [
        estimate_memory(
            model,
            workload.as_trained(m.config),
            micro_batch_size=m.micro_batch_size,
            seq_len=fp.seq_len,
            world_size=fp.gpus,
            cuda_allocator=cuda,
            grad_accum=workload.grad_accum(m.micro_batch_size),
            loss_dtype=workload.loss_dtype,
        )
        for m in points
    ]
    shown = {"buffers": "temporaries (buffers)"}
    fig = go.Figure()
    for category in CATEGORIES:
        fig.add_trace(
            go.Bar(
                x=names,
                y=[e.breakdown.get(category, 0) / GIB for e in estimates],
                name=f"predicted: {shown.get(category, category)}",
                offsetgroup="predicted",
                legendgroup="predicted",
            )
        )
    fig.add_trace(
        go.Bar(
            x=names,
            y=[e.allocator_bytes / GIB for e in estimates],
            name="predicted: allocator",
            offsetgroup="predicted",
            legendgroup="predicted",
        )
    )
    fig.add_trace(
        go.Bar(
            x=names,
            y=[(m.peak_bytes or 0) / GIB for m in points],
            name="measured peak",
            offsetgroup="measured",
            marker={"color": "#333333"},
            customdata=[m.outcome or m.state for m in points],
            hovertemplate="%{x}<br>measured %{y:.2f} GiB (%{customdata})<extra></extra>",
        )
    )
    fig.add_hline(
        y=capacity_bytes / GIB,
        line={"color": "red", "dash": "dash"},
        annotation_text=f"usable {format_bytes(capacity_bytes)} per GPU",
    )
    fig.update_layout(
        barmode="stack",
        yaxis_title="GiB per GPU",
        height=520,
        margin={"b": 160},
        legend={"orientation": "h", "y": 1.12},
    )
    return fig


def _speed_figure(study: StudyResult, go: Any, which: str) -> Any:
    """Tokens/s (``which="tokens"``) or MFU against micro-batch, a line per configuration."""
    fig = go.Figure()
    by_config: dict[str, list[Measurement]] = {}
    for m in _latest_per_point(study.measurements):
        by_config.setdefault(m.config.label(), []).append(m)
    for label, group in by_config.items():
        group.sort(key=lambda m: m.micro_batch_size)
        ok = [m for m in group if m.feasible]
        value = (lambda m: m.tokens_per_second) if which == "tokens" else (lambda m: m.mfu)
        fig.add_trace(
            go.Scatter(
                x=[m.micro_batch_size for m in ok],
                y=[value(m) for m in ok],
                mode="lines+markers",
                name=label,
                legendgroup=label,
            )
        )
        failed = [
            m for m in group if m.outcome in FAILED or (m.state == "COMPLETE" and not m.feasible)
        ]
        if failed:
            fig.add_trace(
                go.Scatter(
                    x=[m.micro_batch_size for m in failed],
                    y=[0.0 for _ in failed],
                    mode="markers",
                    marker={"symbol": "x", "size": 12, "color": "red"},
                    name=f"{label}: did not fit",
                    legendgroup=label,
                    customdata=[m.outcome or m.state for m in failed],
                    hovertemplate=f"{label}<br>micro-batch %{{x}}: %{{customdata}}<extra></extra>",
                )
            )
    fig.update_layout(
        xaxis={"title": "micro-batch size", "type": "log", "dtick": 0.30103},
        yaxis_title="tokens/s (all GPUs)" if which == "tokens" else "MFU",
        yaxis_tickformat=",.0f" if which == "tokens" else ".0%",
        height=420,
    )
    return fig


def _search_clock(
    trials: Sequence[Measurement], times: Mapping[int, TrialTimes]
) -> tuple[list[float], str]:
    """Where each trial (by number) stands on the search's chart, and the axis's title.

    The budget's own clock where every trial recorded its probe's wall time: the probes'
    times summed, each probe counted once (one probe measures several sizes), so a simulated
    search shows the time it charged. Otherwise the trials' start and end times, and the
    trial number where those are missing too.
    """
    walls = [m.attrs.get("probe_wall_s") for m in trials]
    if trials and all(isinstance(w, int | float) for w in walls):
        spent = 0.0
        seen: dict[str, float] = {}
        xs = []
        for m, wall in zip(trials, walls, strict=True):
            probe = m.probe_dir or f"trial {m.number}"
            if probe not in seen:
                spent += float(wall)  # type: ignore[arg-type]
                seen[probe] = spent
            xs.append(seen[probe])
        return xs, "probe time spent (s), as the budget counts it"
    starts = [times.get(m.number, TrialTimes(None, None)).start for m in trials]
    first = min((s for s in starts if s is not None), default=None)
    if first is None or any(s is None for s in starts):
        return [float(m.number) for m in trials], "trial number"
    xs = []
    for m, start in zip(trials, starts, strict=True):
        end = times[m.number].complete or start
        xs.append(((end or first) - first).total_seconds())
    return xs, "seconds since the first probe started"


def _best_value(measurements: list[Measurement]) -> float | None:
    found = best_point(measurements)
    return None if found is None else found.value


def _search_figure(
    study: StudyResult, go: Any, times: Mapping[int, TrialTimes], budget_s: float | None
) -> Any:
    trials = sorted(study.measurements, key=lambda m: m.number)
    xs, x_title = _search_clock(trials, times)
    by_time = x_title != "trial number"
    goal = study.fingerprint.objective.value
    fig = go.Figure()
    ok = [i for i, m in enumerate(trials) if m.feasible and m.value]
    fig.add_trace(
        go.Scatter(
            x=[xs[i] for i in ok],
            y=[trials[i].value for i in ok],
            mode="markers",
            name="probe that fit",
            customdata=[
                [trials[i].number, trials[i].config.label(), trials[i].micro_batch_size] for i in ok
            ],
            hovertemplate="trial %{customdata[0]}: %{customdata[1]} · mb %{customdata[2]}"
            "<br>%{y:,.4g}<extra></extra>",
        )
    )
    bad = [i for i, m in enumerate(trials) if i not in set(ok)]
    if bad:
        fig.add_trace(
            go.Scatter(
                x=[xs[i] for i in bad],
                y=[0.0 for _ in bad],
                mode="markers",
                marker={"symbol": "x", "size": 11, "color": "red"},
                name="did not fit / failed",
                customdata=[
                    [
                        trials[i].number,
                        trials[i].config.label(),
                        trials[i].micro_batch_size,
                        trials[i].outcome or trials[i].state,
                    ]
                    for i in bad
                ],
                hovertemplate="trial %{customdata[0]}: %{customdata[1]} · mb %{customdata[2]}"
                "<br>%{customdata[3]}<extra></extra>",
            )
        )
    # The best as the search read it after each probe: a point's mean over its repeats (a
    # lucky single measurement that its repeats brought down is not the best).
    best = [_best_value(trials[: i + 1]) for i in range(len(trials))]
    fig.add_trace(go.Scatter(x=xs, y=best, mode="lines", line={"shape": "hv"}, name="best so far"))
    if budget_s is not None and by_time:
        fig.add_vline(
            x=budget_s,
            line={"color": "red", "dash": "dash"},
            annotation_text=f"budget {format_duration(budget_s)}",
        )
    fig.update_layout(
        xaxis_title=x_title,
        yaxis_title=f"objective ({goal})",
        height=420,
    )
    return fig


def _best_section(best: Measurement | None, launches: Mapping[str, str]) -> str:
    if best is None:
        return "<p>No configuration fits yet.</p>"
    parts = [
        f"<p class='best'><b>{_e(best.config.label())}</b> at micro-batch "
        f"{best.micro_batch_size}, grad-accum {_e(best.grad_accum or '-')}: "
        f"{_fmt(best.tokens_per_second, ',.0f')} tokens/s, MFU {_fmt(best.mfu, '.1%')}, "
        f"peak {_e(format_bytes(best.peak_bytes) if best.peak_bytes else '-')} per GPU "
        f"(trial {best.number}{f', mean of {best.repeats}' if best.repeats > 1 else ''})</p>"
    ]
    for fmt, text in launches.items():
        parts.append(
            f"<details><summary>autotune export --format {_e(fmt)}</summary>"
            f"<pre>{_e(text)}</pre></details>"
        )
    return "\n".join(parts)


def _probe_table(measurements: Sequence[Measurement]) -> str:
    head = (
        "<tr><th>#</th><th>configuration</th><th>micro-batch</th><th>state</th>"
        "<th>outcome</th><th>tokens/s</th><th>MFU</th><th>peak/GPU</th><th>probe folder</th>"
        "<th>message</th></tr>"
    )
    rows = []
    for m in sorted(measurements, key=lambda m: m.number):
        folder = "-"
        if m.probe_dir:
            uri = Path(m.probe_dir).absolute().as_uri()
            folder = f"<a href='{_e(uri)}'>{_e(m.probe_dir)}</a>"
        rows.append(
            f"<tr class='{'ok' if m.feasible else 'miss'}'><td>{m.number}</td>"
            f"<td>{_e(m.config.label())}</td><td>{m.micro_batch_size}</td>"
            f"<td>{_e(m.state)}</td><td>{_e(m.outcome or '-')}</td>"
            f"<td>{_fmt(m.tokens_per_second, ',.0f')}</td><td>{_fmt(m.mfu, '.1%')}</td>"
            f"<td>{_e(format_bytes(m.peak_bytes) if m.peak_bytes else '-')}</td>"
            f"<td>{folder}</td><td class='msg'>{_e(m.message or '')}</td></tr>"
        )
    return f"<table class='probes'>{head}{''.join(rows)}</table>"


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
.meta td { padding: 0 1em 0 0; }
table.probes { border-collapse: collapse; font-size: 0.85em; width: 100%; }
table.probes td, table.probes th {
  border-bottom: 1px solid #ddd; padding: 3px 6px; text-align: left;
}
tr.miss { color: #a33; } td.msg { max-width: 28em; overflow-wrap: anywhere; }
pre { background: #f5f5f5; padding: 0.8em; overflow-x: auto; }
.chart { min-height: 420px; }
"""


def _device_row(fp: Fingerprint, capacity: int) -> tuple[str, str]:
    """What the study ran on: GPUs (real or simulated), or CPU ranks under an emulated cap."""
    if fp.device == "cpu":
        ranks = f"{fp.gpus} CPU rank{'s' if fp.gpus > 1 else ''}"
        return "device", f"{ranks}, each under an emulated {format_bytes(capacity)} device"
    return "GPU", f"{fp.gpus} × {fp.gpu} ({fp.device}), usable {format_bytes(capacity)} each"


def render_html(
    study: StudyResult,
    *,
    model: ModelSpec,
    launches: Mapping[str, str],
    times: Mapping[int, TrialTimes] | None = None,
    budget_s: float | None = None,
) -> str:
    """The report of one study (read with every trial) as one HTML document.

    Args:
        study: The study, its measurements and best.
        model: The shape of the study's model (for the estimator's breakdown).
        launches: The best configuration's launch text per export format that expresses it.
        times: Start and end of each trial (:func:`read_trial_times`); without them the
            search's chart goes by trial number.
        budget_s: The search's budget, drawn on the search's chart when its axis is time.
    """
    import plotly.graph_objects as go
    import plotly.offline

    fp = study.fingerprint
    capacity = fp.gpu_memory_bytes
    figures = {
        "memory": (
            "Memory per GPU: predicted breakdown and measured peak",
            _memory_figure(study, model, go, capacity, cuda=fp.device not in ("cpu",)),
        ),
        "tokens": ("Tokens/s against micro-batch", _speed_figure(study, go, "tokens")),
    }
    if any(m.mfu for m in study.measurements):  # a CPU study has no peak FLOP/s: no MFU
        figures["mfu"] = ("MFU against micro-batch", _speed_figure(study, go, "mfu"))
    figures["search"] = (
        "The search, probe by probe",
        _search_figure(study, go, times or {}, budget_s),
    )
    charts = []
    for key, (title, fig) in figures.items():
        fig.update_layout(template="plotly_white")
        div = fig.to_html(
            full_html=False, include_plotlyjs=False, div_id=f"chart-{key}", validate=True
        )
        charts.append(f"<h2>{_e(title)}</h2><div class='chart'>{div}</div>")
    meta = [
        ("study", fp.study_name),
        ("model", fp.model),
        _device_row(fp, capacity),
        ("workload", f"seq_len {fp.seq_len}, global batch {fp.global_batch}"),
        ("objective", fp.objective.value),
        ("trials", str(study.trial_count)),
        ("software", ", ".join(f"{k} {v}" for k, v in sorted(fp.software.items()))),
    ]
    if fp.script is not None:
        job = ScriptJob.from_dict(fp.script)
        meta.append(("job", f"{job.path} ({job.framework.value}) {' '.join(job.args)}"))
        gap = prediction_gap(study.measurements)
        if gap is not None:
            meta.append(("your job", f"{gap.text()} for autotune's stand-in{gap.loss_note()}"))
    if budget_s is not None:
        meta.append(("budget", format_duration(budget_s)))
    meta_rows = "".join(f"<tr><td>{_e(k)}</td><td>{_e(v)}</td></tr>" for k, v in meta)
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>autotune report: {_e(fp.study_name)}</title><style>{_STYLE}</style>"
        f"<script type='text/javascript'>{plotly.offline.get_plotlyjs()}</script></head><body>"
        f"<h1>autotune report: {_e(fp.model)}</h1><table class='meta'>{meta_rows}</table>"
        f"<h2>Best configuration</h2>{_best_section(study.best, launches)}"
        f"{''.join(charts)}"
        f"<h2>Probes</h2>{_probe_table(study.measurements)}"
        "</body></html>\n"
    )
