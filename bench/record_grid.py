"""Record a complete grid: every configuration of a workload's space at every micro-batch
size up to its first OOM, one real probe per configuration, kept as replayable data.

Each configuration is one probe sweeping the sizes that reach the global batch in ascending
order (a probe stops at its first OOM: the sizes above it cannot fit), run through the same
local device as ``autotune run`` (warm probe workers, DeepSpeed ops built as a set-up step,
outside the probe's timeout). Each probe's own ``result.json`` is copied to
``OUT/NNN.json`` (its logs stay in the probe folder under ``--trials-dir``), and
``OUT/node.json`` says where and with what it was measured. ``autotune.devices.ReplayDevice``
replays the folder, and ``--resume`` skips configurations already recorded there.

    python bench/record_grid.py --model qwen2.5-1.5b --seq-len 2048 --global-batch 64 \\
        --out bench/data/h100/qwen2.5-1.5b
    python bench/record_grid.py --model tiny --device cpu --device-memory 4MiB \\
        --seq-len 64 --global-batch 16 --out /tmp/grid          # no GPU: emulated device
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from autotune import api
from autotune.config import Engine
from autotune.devices import LocalDevice
from autotune.hardware import detect_gpus, host_memory_bytes
from autotune.models import resolve_model
from autotune.space import Workload, configurations, micro_batch_options
from autotune.study.fingerprint import software_versions


def node_facts(device: str) -> dict[str, Any]:
    """The node a grid was recorded on (the replay reads the probes; this is for people)."""
    gpus = detect_gpus() if device == "cuda" else None
    return {
        "date": time.strftime("%Y-%m-%d"),
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "host_memory_bytes": host_memory_bytes(),
        "gpu": gpus.name if gpus else None,
        "gpus": gpus.count if gpus else 0,
        "driver": gpus.driver if gpus else None,
        "software": software_versions(),
        "python": platform.python_version(),
        "command": [sys.executable, *sys.argv],
    }


def recorded_configs(out: Path) -> set[str]:
    """The configurations whose probe is already in ``out`` (for ``--resume``)."""
    found = set()
    for path in out.glob("[0-9]*.json"):
        data = json.loads(path.read_text())
        found.add(json.dumps(data["spec"]["config"], sort_keys=True))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--device-memory", default=None, help="emulated cap, e.g. 4MiB")
    parser.add_argument("--engine", default=None, help="only these engines: fsdp,deepspeed")
    parser.add_argument("--timeout", default="15m", help="per probe")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--trials-dir", type=Path, default=Path("trials"))
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    model = resolve_model(args.model)
    workload = Workload(seq_len=args.seq_len, global_batch=args.global_batch, world_size=args.gpus)
    engines = [Engine(e) for e in args.engine.split(",")] if args.engine else None
    space = configurations(
        world_size=args.gpus,
        num_layers=model.num_layers,
        engines=engines,
        offload=args.device == "cuda",  # an emulated device has no host to offload to
    )
    sizes = micro_batch_options(workload)
    args.out.mkdir(parents=True, exist_ok=True)
    done = recorded_configs(args.out) if args.resume else set()
    if not args.resume and any(args.out.glob("[0-9]*.json")):
        raise SystemExit(f"{args.out} already holds a grid: --resume to go on, or another --out")
    facts = {
        **node_facts(args.device),
        "workload": {
            "model": model.name,
            "seq_len": args.seq_len,
            "global_batch": args.global_batch,
            "gpus": args.gpus,
            "device_memory": args.device_memory,
        },
    }
    (args.out / "node.json").write_text(json.dumps(facts, indent=2) + "\n")
    device = LocalDevice(args.device)
    started = time.monotonic()
    try:
        for index, config in enumerate(space):
            if json.dumps(config.to_dict(), sort_keys=True) in done:
                continue
            result = api.probe(
                args.model,
                config,
                micro_batch_sizes=sizes,
                seq_len=args.seq_len,
                gpus=args.gpus,
                device=device,
                device_memory=args.device_memory,
                timeout=args.timeout,
                trials_dir=args.trials_dir,
                folder=f"grid-{model.name}",
            )
            target = args.out / f"{index:03d}.json"
            target.write_text((result.probe_dir / "result.json").read_text())
            measured = ", ".join(f"{s.micro_batch_size}: {s.outcome.value}" for s in result.sizes)
            print(
                f"[{index + 1}/{len(space)}] {config.label()}: {result.outcome.value} "
                f"({measured or result.message[:80]}) in {result.wall_s:.1f} s",
                flush=True,
            )
    finally:
        device.close()
    print(f"grid of {len(space)} configurations in {args.out} ({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
