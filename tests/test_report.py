"""The live view of `autotune run` and its final table, fed by a real (simulated) search."""

from __future__ import annotations

import io
import re
from pathlib import Path

from rich.console import Console

from autotune.api import prepare
from autotune.devices import SimulatedDevice
from autotune.report.live import RunView
from autotune.report.tables import ranking_table


def test_the_view_follows_the_search_and_the_table_ranks_what_fits(tmp_path: Path) -> None:
    tuning = prepare(
        "llama-13b", budget="30m", seq_len=2048, global_batch=256, gpus=8,
        device=SimulatedDevice.named("a100-40gb", seed=2),
        storage=f"sqlite:///{tmp_path}/t.db", trials_dir=tmp_path / "trials",
    )  # fmt: skip
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120, color_system=None)
    view = RunView(console, budget_s=1800.0, simulated=True, live=True)
    frames: list[str] = []

    def watch(event: object) -> None:
        view(event)  # type: ignore[arg-type]
        frame = Console(file=io.StringIO(), width=120, color_system=None)
        frame.print(view)
        frames.append(frame.file.getvalue())  # type: ignore[attr-defined]

    with view:
        summary = tuning.run(watch)
    assert summary.best is not None and summary.probes >= 2
    # While probing: what runs, and the budget; after a result: its outcome and the best.
    first_probe = frames[0]
    assert "probing" in first_probe and "micro-batch" in first_probe
    assert "30m00s of 30m00s left" in first_probe
    after = frames[1]
    # The last probe's sizes as "2: ok 10,803 tok/s, 4: oom" (not "tok/s" alone).
    last = next(line for line in after.splitlines() if line.lstrip("│ ").startswith("last"))
    assert re.search(r"\b\d+: (ok|oom)\b", last), last
    best_line = next(line for line in frames[-2].splitlines() if line.startswith("best"))
    assert summary.best.config.label() in best_line
    # The log lines are printed above the live panel, one per probe and one per result.
    log = out.getvalue()
    assert log.count("probe ") >= summary.probes
    # Re-measurements say so: a point's alone, or the best's beside new sizes of its
    # configuration (one per probe either way).
    remeasured = [m for m in summary.measurements if m.repeat]
    alone = log.count(": the best or within the noise of it")
    riding = len(re.findall(r"; \d+ re-measures the best\)", log))
    assert alone + riding == len(remeasured)
    shown = any("re-measure" in frame for frame in frames)
    assert shown == bool(remeasured)
    # The table: each configuration's best feasible size, fastest first, peaks within capacity.
    table = ranking_table(summary.measurements, tuning.capacity_bytes)
    cells = table.columns[4]._cells
    values = [float(v.split()[0].replace(",", "")) for v in cells]
    assert values == sorted(values, reverse=True)
    assert values[0] == round(summary.best.value or 0)
    repeats = summary.best.repeats if summary.best else 1
    assert ("(mean of" in cells[0]) == (repeats > 1)
    labels = table.columns[1]._cells
    assert len(labels) == len(set(labels))
    assert all(
        "%" in p and int(p.split("(")[1].rstrip("%)")) <= 100 for p in table.columns[6]._cells
    )


def test_the_view_says_when_it_waits_for_other_workers() -> None:
    """A worker with nothing left to propose while others' probes run says so, once in the
    log and in the panel, with the budget still counting down."""
    from autotune.search.controller import Event

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120, color_system=None)
    view = RunView(console, budget_s=600.0, simulated=True, live=False)
    message = "waiting for 2 trial(s) that other workers are probing"
    view(Event(kind="wait", probes=3, budget_left_s=420.0, message=message))
    assert out.getvalue().count(message) == 1
    frame = Console(file=io.StringIO(), width=120, color_system=None)
    frame.print(view)
    panel = frame.file.getvalue()  # type: ignore[attr-defined]
    assert "waiting" in panel and message in panel and "7m00s of 10m00s left" in panel
