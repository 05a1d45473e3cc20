"""Where a probe's time goes, and what the two start-up levers save.

Prints, for real probes on this machine: seconds spent starting (imports), building the
model, warming up and in the timed window, and the launcher's own overhead, for ranks started
as fresh interpreters and as forks of the fork server; then the wall time of measuring N
micro-batch sizes in one process against one process per size. With a GPU the default shape
is qwen2.5-1.5b, without one the tiny model on the CPU.

    python bench/probe_overhead.py [--model M] [--engine E] [--sizes 1,2,4,8] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from autotune.config import TrainConfig
from autotune.hardware import detect_gpus
from autotune.probe import ProbeResult, ProbeSpec, launch_probe
from autotune.probe.forkserver import ForkServer
from autotune.probe.launcher import Spawner, SubprocessSpawner


def machine() -> dict[str, Any]:
    gpus = detect_gpus()
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "gpu": f"{gpus.count} x {gpus.name}" if gpus else None,
    }


def phases(result: ProbeResult) -> dict[str, float]:
    """Seconds per phase of a single-size probe."""
    size = result.sizes[0]
    known = (
        (result.import_s or 0)
        + (result.build_s or 0)
        + (size.warmup_s or 0.0)
        + (size.timed_s or 0.0)
    )
    return {
        "start_s": result.import_s or 0.0,
        "build_s": result.build_s or 0.0,
        "warmup_s": (size.warmup_s or 0.0),
        "timed_s": (size.timed_s or 0.0),
        "launcher_and_exit_s": result.wall_s - known,
        "wall_s": result.wall_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gpu = detect_gpus() is not None
    parser.add_argument("--model", default="qwen2.5-1.5b" if gpu else "tiny")
    parser.add_argument("--engine", default="single")
    parser.add_argument("--seq-len", type=int, default=2048 if gpu else 128)
    parser.add_argument("--sizes", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=3, help="single-size probes to average")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sizes = tuple(int(s) for s in args.sizes.split(","))
    base = {
        "model": args.model,
        "config": TrainConfig(engine=args.engine, zero_stage=3 if args.engine == "fsdp" else 0),
        "seq_len": args.seq_len,
        "device": "cuda" if gpu else "cpu",
        "warmup_steps": 2,
        "timed_steps": 3,
    }

    def single(spawner: Spawner, root: Path) -> dict[str, float]:
        runs = [
            phases(
                launch_probe(
                    ProbeSpec(**base, micro_batch_sizes=(sizes[0],)),
                    root / f"s{i}",
                    spawner=spawner,
                )
            )
            for i in range(args.repeats)
        ]
        return {key: statistics.median(run[key] for run in runs) for key in runs[0]}

    def timed_sweep(spawner: Spawner, root: Path) -> tuple[float, float, list[str]]:
        started = time.monotonic()
        swept = launch_probe(
            ProbeSpec(**base, micro_batch_sizes=sizes), root / "sweep", spawner=spawner
        )
        one_process = time.monotonic() - started
        started = time.monotonic()
        separate = [
            launch_probe(
                ProbeSpec(**base, micro_batch_sizes=(m,)), root / f"one{m}", spawner=spawner
            )
            for m in sizes
        ]
        per_size = time.monotonic() - started
        outcomes = [s.outcome.value for s in swept.sizes] + [r.outcome.value for r in separate]
        return one_process, per_size, outcomes

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        fresh = single(SubprocessSpawner(), root / "fresh")
        sweep_wall, separate_wall, outcomes = timed_sweep(SubprocessSpawner(), root / "fresh")
        started = time.monotonic()
        with ForkServer() as server:
            server_start = time.monotonic() - started
            forked = single(server, root / "forked")
            fork_sweep_wall, fork_separate_wall, fork_outcomes = timed_sweep(
                server, root / "forked"
            )
    report = {
        "machine": machine(),
        "model": args.model,
        "engine": args.engine,
        "seq_len": args.seq_len,
        "single_probe_median_s": {"fresh_interpreter": fresh, "fork_server": forked},
        "fork_server_start_s": server_start,
        "sweep": {
            "sizes": list(sizes),
            "fresh_interpreter": {
                "one_process_s": sweep_wall,
                "one_process_per_size_s": separate_wall,
            },
            "fork_server": {
                "one_process_s": fork_sweep_wall,
                "one_process_per_size_s": fork_separate_wall,
            },
            "outcomes": outcomes + fork_outcomes,
        },
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    info = report["machine"]
    print(
        f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}, "
        f"GPU: {info['gpu'] or 'none'}"
    )
    print(
        f"probe of {args.model}, engine {args.engine}, seq {args.seq_len}, one size, "
        f"median of {args.repeats} (seconds):"
    )
    print(f"  {'phase':<20} {'fresh interpreter':>18} {'fork server':>12}")
    for key in fresh:
        print(f"  {key.removesuffix('_s'):<20} {fresh[key]:18.2f} {forked[key]:12.2f}")
    print(f"  (fork server start, once: {server_start:.2f} s)")
    print(f"sweep of micro-batch {args.sizes} (seconds):")
    print(f"  {'':<24} {'fresh interpreter':>18} {'fork server':>12}")
    print(f"  {'one process':<24} {sweep_wall:18.2f} {fork_sweep_wall:12.2f}")
    print(f"  {'one process per size':<24} {separate_wall:18.2f} {fork_separate_wall:12.2f}")
    print(
        f"  {'saved by the sweep':<24} {100 * (1 - sweep_wall / separate_wall):17.1f}% "
        f"{100 * (1 - fork_sweep_wall / fork_separate_wall):11.1f}%"
    )


if __name__ == "__main__":
    main()
