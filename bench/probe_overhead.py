"""Where a probe's time goes, and what the in-process micro-batch sweep saves.

Prints, for real probes on this machine: seconds spent importing (torch, transformers, the
engine), building the model, warming up and in the timed window, and the launcher's own
overhead; then the wall time of measuring N micro-batch sizes in one process against one
process per size. With a GPU the default shape is qwen2.5-1.5b, without one the tiny model
on the CPU.

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
    known = (result.import_s or 0) + (result.build_s or 0) + size["warmup_s"] + size["timed_s"]
    return {
        "import_s": result.import_s or 0.0,
        "build_s": result.build_s or 0.0,
        "warmup_s": size["warmup_s"],
        "timed_s": size["timed_s"],
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
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        single = [
            phases(launch_probe(ProbeSpec(**base, micro_batch_sizes=(sizes[0],)), root / f"s{i}"))
            for i in range(args.repeats)
        ]
        started = time.monotonic()
        swept = launch_probe(ProbeSpec(**base, micro_batch_sizes=sizes), root / "sweep")
        sweep_wall = time.monotonic() - started
        started = time.monotonic()
        separate = [
            launch_probe(ProbeSpec(**base, micro_batch_sizes=(m,)), root / f"one{m}") for m in sizes
        ]
        separate_wall = time.monotonic() - started
    median = {key: statistics.median(p[key] for p in single) for key in single[0]}
    report = {
        "machine": machine(),
        "model": args.model,
        "engine": args.engine,
        "seq_len": args.seq_len,
        "single_probe_median_s": median,
        "sweep": {
            "sizes": list(sizes),
            "one_process_s": sweep_wall,
            "one_process_per_size_s": separate_wall,
            "saved_fraction": 1 - sweep_wall / separate_wall,
            "outcomes": [s["outcome"] for s in swept.sizes] + [r.outcome.value for r in separate],
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
        f"probe of {args.model}, engine {args.engine}, seq {args.seq_len}, "
        f"median of {args.repeats}:"
    )
    for key, value in median.items():
        print(f"  {key.removesuffix('_s'):<20} {value:8.2f} s")
    print(f"sweep of micro-batch {args.sizes}:")
    print(f"  one process          {sweep_wall:8.2f} s")
    print(f"  one process per size {separate_wall:8.2f} s")
    print(f"  saved                {100 * report['sweep']['saved_fraction']:8.1f} %")


if __name__ == "__main__":
    main()
