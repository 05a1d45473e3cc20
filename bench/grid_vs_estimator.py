"""The estimator against a recorded grid: predicted vs measured memory and time, every point.

For each recorded grid (``bench/data/<node>/<workload>/``, or the folders given), every
recorded size of every configuration: the predicted peak device memory (what must fit:
live tensors and, on a GPU, the caching allocator's share) beside the measured peak, whether
the fit verdict was right, the largest micro-batch predicted to fit beside the largest that
did, and the predicted step time beside the measured one. The summary per grid: verdicts
right, the median and largest memory error on sizes that ran, largest fitting sizes
predicted exactly or off by one size, and the measured/predicted step-time ratio per family
(engine x offload), which is what the search calibrates.

    python bench/grid_vs_estimator.py [FOLDER ...] [--rows]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from autotune.devices.replay import Grid
from autotune.estimator.memory import estimate_memory
from autotune.estimator.plan import caching_allocator, usable_bytes
from autotune.estimator.timing import predict_step_time
from autotune.models import resolve_model
from autotune.units import format_bytes

DATA = Path(__file__).parent / "data"


def compare(folder: Path) -> dict[str, Any]:
    """Every recorded size of the grid in ``folder`` against the estimator."""
    grid = Grid.from_folder(folder)
    key = grid.key
    model = resolve_model(key.model)
    world = key.num_processes * key.nodes
    on_gpu = grid.device == "cuda"
    capacity = key.device_memory_bytes or usable_bytes(grid.gpu)
    rows = []
    for (_, mbs), found in sorted(
        grid.points.items(), key=lambda p: (p[1][0].probe.spec.config.label(), p[0][1])
    ):
        size, probe = found[0].size, found[0].probe
        config = probe.spec.config
        memory = estimate_memory(
            model, config, micro_batch_size=mbs, seq_len=key.seq_len, world_size=world,
            cuda_allocator=caching_allocator(grid.gpu) if on_gpu else False,
        )  # fmt: skip
        predicted_step = None
        if size.ok:
            predicted_step = predict_step_time(
                model, config, grid.gpu, micro_batch_size=mbs, seq_len=key.seq_len,
                grad_accum=probe.spec.grad_accum, world_size=world,
            ).step_s  # fmt: skip
        rows.append(
            {
                "config": config.label(),
                "family": f"{config.engine.value} {config.offload.value}",
                "mbs": mbs,
                "outcome": size.outcome.value,
                "predicted_bytes": memory.device_bytes,
                "measured_bytes": size.peak_bytes,
                "verdict_right": (memory.device_bytes <= capacity) == size.ok,
                "predicted_step_s": predicted_step,
                "measured_step_s": size.step_s,
            }
        )
    largest: dict[str, tuple[int, int]] = {}
    for config in grid.configs():
        label = config.label()
        mine = [r for r in rows if r["config"] == label]
        ran = [r["mbs"] for r in mine if r["outcome"] == "ok"]
        fits = [r["mbs"] for r in mine if r["predicted_bytes"] <= capacity]
        if mine:
            largest[label] = (max(fits, default=0), max(ran, default=0))
    shown = folder.resolve()
    if shown.is_relative_to(Path.cwd()):
        shown = shown.relative_to(Path.cwd())
    return {"grid": str(shown), "key": key, "gpu": grid.gpu.key, "capacity": capacity,
            "rows": rows, "largest": largest}  # fmt: skip


def summary(found: dict[str, Any]) -> None:
    rows = found["rows"]
    ran = [r for r in rows if r["outcome"] == "ok" and r["measured_bytes"]]
    errors = [abs(r["predicted_bytes"] / r["measured_bytes"] - 1) for r in ran]
    exact = sum(p == m for p, m in found["largest"].values())
    sizes_off = sum(p != m for p, m in found["largest"].values())
    print(f"\n## {found['grid']} ({found['gpu']}, capacity {format_bytes(found['capacity'])})")
    print(f"- fit verdicts right: {sum(r['verdict_right'] for r in rows)}/{len(rows)} sizes")
    if errors:
        print(
            f"- peak memory on sizes that ran: median |error| {statistics.median(errors):.1%}, "
            f"largest {max(errors):.1%} ({len(errors)} sizes)"
        )
    print(
        f"- largest fitting micro-batch predicted exactly for {exact}/{len(found['largest'])} "
        f"configurations ({sizes_off} off)"
    )
    families: dict[str, list[float]] = {}
    for r in rows:
        if r["predicted_step_s"] and r["measured_step_s"]:
            ratio = r["measured_step_s"] / r["predicted_step_s"]
            families.setdefault(r["family"], []).append(ratio)
    print("\n| family | sizes | step time measured / predicted, median | range |")
    print("| --- | ---: | ---: | --- |")
    for family, ratios in sorted(families.items()):
        print(
            f"| {family} | {len(ratios)} | {statistics.median(ratios):.2f} | "
            f"{min(ratios):.2f}-{max(ratios):.2f} |"
        )


def table(found: dict[str, Any]) -> None:
    print("\n| configuration | mbs | outcome | predicted peak | measured peak | verdict | "
          "step predicted | step measured |")  # fmt: skip
    print("| --- | ---: | --- | ---: | ---: | --- | ---: | ---: |")
    for r in found["rows"]:
        measured = format_bytes(r["measured_bytes"]) if r["measured_bytes"] else "-"
        predicted_step = f"{r['predicted_step_s'] * 1e3:.1f} ms" if r["predicted_step_s"] else "-"
        measured_step = f"{r['measured_step_s'] * 1e3:.1f} ms" if r["measured_step_s"] else "-"
        print(
            f"| {r['config']} | {r['mbs']} | {r['outcome']} | "
            f"{format_bytes(r['predicted_bytes'])} | {measured} | "
            f"{'right' if r['verdict_right'] else 'WRONG'} | {predicted_step} | {measured_step} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="*", type=Path)
    parser.add_argument("--rows", action="store_true", help="every point, not only the summary")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    folders = args.folders or sorted(p.parent for p in DATA.glob("*/*/node.json"))
    found = [compare(folder) for folder in folders]
    if args.json:
        print(json.dumps(found, indent=2, default=str))
        return
    for grid in found:
        summary(grid)
        if args.rows:
            table(grid)


if __name__ == "__main__":
    main()
