"""The live view of `autotune run` and its final table, fed by a real (simulated) search."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from autotune.estimator.plan import plan
from autotune.estimator.simulate import SimulatedDevice
from autotune.models import resolve_model
from autotune.probe import ProbeSpec
from autotune.report.live import RunView, best_table
from autotune.search.controller import Controller
from autotune.space import Workload
from autotune.study import Fingerprint, TrialStore


def test_the_view_follows_the_search_and_the_table_ranks_what_fits(tmp_path: Path) -> None:
    device = SimulatedDevice.named("a100-40gb", seed=2)
    model, work = resolve_model("llama-13b"), Workload(seq_len=2048, global_batch=256, world_size=8)
    fingerprint = Fingerprint(
        model="llama-13b", seq_len=2048, global_batch=256, gpu="a100-40gb",
        gpu_memory_bytes=device.gpu.memory_bytes, gpus=8, device="simulated",
    )  # fmt: skip
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120, color_system=None)
    view = RunView(console, budget_s=1800.0, simulated=True, live=True)
    frames: list[str] = []
    capacity = device.capacity(ProbeSpec(model="llama-13b"))

    def watch(event: object) -> None:
        view(event)  # type: ignore[arg-type]
        frame = Console(file=io.StringIO(), width=120, color_system=None)
        frame.print(view)
        frames.append(frame.file.getvalue())  # type: ignore[attr-defined]

    controller = Controller(
        model=model, model_ref="llama-13b", workload=work,
        store=TrialStore(fingerprint, work, storage=f"sqlite:///{tmp_path}/t.db"),
        rows=plan(model, device.gpu, work), runner=device.launch_probe, budget_s=1800.0,
        trials_dir=tmp_path / "trials", device="cuda", device_memory_bytes=None,
        capacity_bytes=capacity, simulated=True, on_event=watch,
    )  # fmt: skip
    with view:
        summary = controller.run()
    assert summary.best is not None and summary.probes >= 2
    # While probing: what runs, and the budget; after a result: its outcome and the best.
    first_probe = frames[0]
    assert "probing" in first_probe and "micro-batch" in first_probe
    assert "30m00s of 30m00s left" in first_probe
    after = frames[1]
    assert "last" in after and ("ok" in after or "oom" in after)
    best_line = next(line for line in frames[-2].splitlines() if line.startswith("best"))
    assert summary.best.config.label() in best_line
    # The log lines are printed above the live panel, one per probe and one per result.
    log = out.getvalue()
    assert log.count("probe ") >= summary.probes
    # Re-measurements (one size each) say so.
    remeasured = [m for m in summary.measurements if m.repeat]
    assert log.count(": a near-tie with the best") == len(remeasured)
    assert any("re-measure 1" in frame for frame in frames) == bool(remeasured)
    # The table: each configuration's best feasible size, fastest first, peaks within capacity.
    table = best_table(summary, capacity)
    cells = table.columns[4]._cells
    values = [float(v.split()[0].replace(",", "")) for v in cells]
    assert values == sorted(values, reverse=True)
    assert values[0] == round(summary.best.value or 0)
    repeats = summary.best.attrs["repeats"] if summary.best else 1
    assert ("(mean of" in cells[0]) == (repeats > 1)
    labels = table.columns[1]._cells
    assert len(labels) == len(set(labels))
    assert all(
        "%" in p and int(p.split("(")[1].rstrip("%)")) <= 100 for p in table.columns[6]._cells
    )
