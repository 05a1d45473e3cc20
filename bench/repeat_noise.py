"""How far one point's measurement moves between repeated probes, and within one probe.

The search re-measures a point it might answer with and stops on what the repeats say: its
residual model's noise prior (``residuals.NOISE``, 2 % of tokens/s) is the spread it assumes
before it has repeats of its own. This bench measures that spread: it probes the same
configurations at the same micro-batch sizes round after round (every point once a round, a
new data seed each round as the search's re-measurements take, through warm workers as
``autotune run`` probes), and prints for each point the median tokens/s, the spread between
repeats (coefficient of variation, and the largest over the smallest), and the spread of the
step times inside each probe (their coefficient of variation, and what it makes of one probe's
median: the within-probe spread over the square root of its timed steps), beside the prior.

With a GPU the points are qwen2.5-1.5b's at sequence length 2048 and global batch 64 (one
GPU: single ac:off at 1, 2, 4; single ac:every at 4, 8; FSDP ZeRO-3 at 2, 4); without one, the
tiny model's on the CPU. ``--stop-after`` ends the rounds in time (no probe starts that the
last round's time says would end later); the probe folders stay in ``--out`` and ``--read``
summarizes them again.

    python bench/repeat_noise.py [--rounds 4] [--steps 10] [--stop-after 5m] [--out DIR] [--json]
    python bench/repeat_noise.py --read DIR [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from autotune.config import TrainConfig
from autotune.hardware import detect_gpus
from autotune.probe import ProbeResult, ProbeSpec, launch_probe
from autotune.probe.forkserver import WarmWorkers
from autotune.search.residuals import NOISE
from autotune.units import parse_duration

GPU_POINTS: tuple[tuple[dict[str, Any], tuple[int, ...]], ...] = (
    ({"engine": "single"}, (1, 2, 4)),
    ({"engine": "single", "ac_every": 1}, (4, 8)),
    ({"engine": "fsdp", "zero_stage": 3}, (2, 4)),
)
CPU_POINTS: tuple[tuple[dict[str, Any], tuple[int, ...]], ...] = (
    ({"engine": "single"}, (1, 2)),
    ({"engine": "single", "ac_every": 1}, (2,)),
)


def _cv(values: list[float]) -> float | None:
    """Sample coefficient of variation; None under two values."""
    if len(values) < 2:
        return None
    return statistics.stdev(values) / statistics.fmean(values)


def probe_rounds(args: argparse.Namespace, out: Path) -> None:
    """Probe every point once a round, until the rounds or the time run out."""
    gpu = detect_gpus() is not None
    points = GPU_POINTS if gpu else CPU_POINTS
    model = args.model or ("qwen2.5-1.5b" if gpu else "tiny")
    seq_len = args.seq_len or (2048 if gpu else 128)
    deadline = time.monotonic() + parse_duration(args.stop_after)
    slowest = 0.0
    workers = WarmWorkers()
    print(f"warm workers: {workers.start()}", flush=True)
    try:
        for round_ in range(args.rounds):
            for index, (fields, sizes) in enumerate(points):
                if time.monotonic() + slowest > deadline:
                    print(f"stopped before round {round_} point {index}: out of time", flush=True)
                    return
                spec = ProbeSpec(
                    model=model,
                    config=TrainConfig(**fields),
                    micro_batch_sizes=sizes,
                    seq_len=seq_len,
                    global_batch=args.global_batch,
                    device="cuda" if gpu else "cpu",
                    warmup_steps=2,
                    timed_steps=args.steps,
                    seed=round_,
                    timeout_s=300.0,
                )
                started = time.monotonic()
                result = launch_probe(spec, out / f"p{index}-r{round_}", spawner=workers.spawner)
                slowest = max(slowest, time.monotonic() - started)
                speeds = ", ".join(
                    f"{s.micro_batch_size}: {s.tokens_per_second:,.0f}"
                    if s.ok and s.tokens_per_second
                    else f"{s.micro_batch_size}: {s.outcome.value}"
                    for s in result.sizes
                )
                print(
                    f"round {round_} {spec.config.label()}: {result.outcome.value} "
                    f"in {result.wall_s:.1f} s (tokens/s {speeds})",
                    flush=True,
                )
    finally:
        workers.close()


def summarize(out: Path) -> dict[str, Any]:
    """Every point's repeats, read back from the probe folders under ``out`` (at any depth:
    the folders of several runs together)."""
    by_point: dict[tuple[str, int], list[tuple[float, list[float]]]] = {}
    device = None
    for path in sorted(out.rglob("p*-r*/result.json")):
        result = ProbeResult.read(path.parent)
        device = result.gpu_name or result.device
        for size in result.sizes:
            if size.ok and size.tokens_per_second:
                key = (result.spec.config.label(), size.micro_batch_size)
                by_point.setdefault(key, []).append((size.tokens_per_second, list(size.step_times)))
    rows = []
    for (label, mbs), repeats in sorted(by_point.items()):
        speeds = [speed for speed, _ in repeats]
        within = [cv for _, times in repeats if (cv := _cv(times)) is not None]
        steps = min((len(times) for _, times in repeats), default=0)
        within_cv = statistics.median(within) if within else None
        rows.append(
            {
                "configuration": label,
                "micro_batch_size": mbs,
                "repeats": len(speeds),
                "tokens_per_second": statistics.median(speeds),
                "between_cv": _cv(speeds),
                "max_over_min": max(speeds) / min(speeds),
                "within_step_cv": within_cv,
                "within_median_se": (
                    within_cv / math.sqrt(steps) if within_cv is not None and steps else None
                ),
            }
        )
    between = [r["between_cv"] for r in rows if r["between_cv"] is not None]
    return {
        "device": device,
        "host": platform.node(),
        "noise_prior": NOISE,
        "points": rows,
        "median_between_cv": statistics.median(between) if between else None,
        "largest_max_over_min": max((r["max_over_min"] for r in rows), default=None),
    }


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f} %"


def print_table(report: dict[str, Any]) -> None:
    print(f"repeat noise on {report['device']} (the search's prior: {_pct(report['noise_prior'])})")
    header = (
        f"{'configuration':<28} {'mbs':>4} {'n':>3} {'tokens/s':>10} {'between cv':>11} "
        f"{'max/min':>8} {'step cv':>9} {'median se':>10}"
    )
    print(header)
    for row in report["points"]:
        print(
            f"{row['configuration']:<28} {row['micro_batch_size']:>4} {row['repeats']:>3} "
            f"{row['tokens_per_second']:>10,.0f} {_pct(row['between_cv']):>11} "
            f"{row['max_over_min']:>8.4f} {_pct(row['within_step_cv']):>9} "
            f"{_pct(row['within_median_se']):>10}"
        )
    print(
        f"median between-repeat cv {_pct(report['median_between_cv'])} "
        f"(goal: within the prior, {_pct(report['noise_prior'])}); largest max/min "
        f"{report['largest_max_over_min'] or 0:.4f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10, help="timed steps a probe")
    parser.add_argument("--stop-after", default="5m", help="start no probe ending later")
    parser.add_argument("--out", type=Path, default=Path("runs/repeat-noise"))
    parser.add_argument("--read", type=Path, default=None, help="only summarize this folder")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = args.read or args.out
    if args.read is None:
        if out.exists() and any(out.iterdir()):
            print(f"{out} is not empty: pass another --out, or --read it", file=sys.stderr)
            return 2
        out.mkdir(parents=True, exist_ok=True)
        probe_rounds(args, out)
    report = summarize(out)
    (out / "summary.json").write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
