"""Where a probe's time goes, and what the two start-up levers save.

First, start-up through ``autotune run`` itself: a short real run, with warm probe workers
(the default) and with ``--no-warm``, and each probe's start-up (spawn to ready to build the
model: imports, CUDA, the process group and the engine included), beside the goal: under
0.5 s on the CPU, under 2 s on a GPU node. Then, for single probes through the launcher:
seconds spent starting, building the model, warming up and in the timed window, and the
launcher's own overhead, for fresh interpreters and forks of the fork server; and the wall
time of measuring N micro-batch sizes in one process against one process per size. With a
GPU the probes' default shape is qwen2.5-1.5b (the runs use the tiny model, whose start-up is
the same), without one the tiny model on the CPU.

    python bench/probe_overhead.py [--model M] [--engine E] [--sizes 1,2,4,8] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
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


GOAL_S = {"cpu": 0.5, "cuda": 2.0}
"""Start-up goals per probe, through `autotune run`."""


def run_startups(gpu: bool, root: Path, *, warm: bool) -> dict[str, Any]:
    """A short real `autotune run` (the README's CPU run, or the tiny model on this node's
    GPUs); each probe's start-up, and the run's set-up steps and wall time."""
    if gpu:
        shape = ["--model", "tiny", "--seq-len", "128", "--budget", "3m"]
    else:
        shape = [
            "--model", "tiny", "--device", "cpu", "--gpus", "2", "--device-memory", "4MiB",
            "--seq-len", "128", "--global-batch", "32", "--budget", "3m",
        ]  # fmt: skip
    folder = root / ("warm" if warm else "fresh")
    folder.mkdir(parents=True)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "autotune.cli", "run", *shape, "--json",
         "--storage", f"sqlite:///{folder}/t.db", "--trials-dir", str(folder / "trials"),
         "--warm" if warm else "--no-warm"],
        capture_output=True, text=True, check=False, cwd=folder,
    )  # fmt: skip
    wall = time.monotonic() - started
    if not done.stdout.strip():
        raise SystemExit(f"autotune run failed (exit {done.returncode}): {done.stderr[-2000:]}")
    summary = json.loads(done.stdout)
    probes = [
        json.loads(path.read_text())
        for path in sorted(folder.glob("trials/*/*/result.json"), key=lambda p: int(p.parent.name))
    ]
    startups = [p["startup_s"] for p in probes if p.get("startup_s") is not None]
    return {
        "spawn": sorted({p.get("spawn") for p in probes}),
        "probes": len(probes),
        "startup_s": startups,
        "startup_median_s": statistics.median(startups) if startups else None,
        "startup_max_s": max(startups) if startups else None,
        "setup": [(s["label"], round(s["seconds"], 2)) for s in summary["setup"]],
        "wall_s": wall,
    }


def phases(result: ProbeResult) -> dict[str, float]:
    """Seconds per phase of a single-size probe."""
    size = result.sizes[0]
    known = (
        (result.startup_s or 0)
        + (result.build_s or 0)
        + (size.warmup_s or 0.0)
        + (size.timed_s or 0.0)
    )
    return {
        "start_s": result.startup_s or 0.0,
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
        runs = {
            "warm": run_startups(gpu, root / "runs", warm=True),
            "fresh": run_startups(gpu, root / "runs", warm=False),
        }
        fresh = single(SubprocessSpawner(), root / "fresh")
        sweep_wall, separate_wall, outcomes = timed_sweep(SubprocessSpawner(), root / "fresh")
        started = time.monotonic()
        with ForkServer() as server:
            server_start = time.monotonic() - started
            forked = single(server, root / "forked")
            fork_sweep_wall, fork_separate_wall, fork_outcomes = timed_sweep(
                server, root / "forked"
            )
    kind = "cuda" if gpu else "cpu"
    report = {
        "machine": machine(),
        "autotune_run": {**runs, "goal_s": GOAL_S[kind], "device": kind},
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
    goal = GOAL_S[kind]
    print(
        "start-up per probe through `autotune run` (spawn to model build: imports, "
        f"{'CUDA, ' if gpu else ''}process group, engine), seconds:"
    )
    print(f"  {'ranks':<22} {'probes':>6} {'median':>7} {'max':>6}  goal")
    for name, label in (("warm", "warm workers (forked)"), ("fresh", "fresh interpreters")):
        run = runs[name]
        median, most = run["startup_median_s"], run["startup_max_s"]
        verdict = ""
        if name == "warm" and most is not None:
            verdict = f"< {goal} s ({kind}) {'ok' if most < goal else 'MISSED'}"
        print(f"  {label:<22} {run['probes']:>6} {median:7.2f} {most:6.2f}  {verdict}")
    for name in ("warm", "fresh"):
        steps = ", ".join(f"{label} {seconds:.1f} s" for label, seconds in runs[name]["setup"])
        print(f"  {name} run: {runs[name]['wall_s']:.1f} s wall; set-up: {steps or 'none'}")
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
