"""Record a complete grid: every configuration of a workload's space at every micro-batch
size up to its first OOM, one real probe per configuration, kept as replayable data.

Each configuration is one probe sweeping the sizes that reach the global batch in ascending
order (a probe stops at its first OOM: the sizes above it cannot fit), run through the same
local device as ``autotune run`` (warm probe workers, DeepSpeed ops built as a set-up step,
outside the probe's timeout). Each probe's own ``result.json`` is copied to
``OUT/NNN.json`` (NNN: the configuration's place in the space; its logs stay in the probe
folder under ``--trials-dir``), and ``OUT/node.json`` says where and with what it was
measured. ``autotune.devices.ReplayDevice`` replays the folder.

GPU time is scarce, so by default the points the replay device decides from other
recordings are not measured (``--complete`` measures them too). Of the configurations that
differ only in activation checkpointing, the one that checkpoints most is recorded first;
then a host OOM there is a host OOM for all of them (the host holds the same offloaded
states), and a size that ran out of device memory there does so wherever fewer blocks are
checkpointed. ``node.json`` lists the configurations skipped (``implied``) and those whose
sweep stopped short of a size decided so (``trimmed``), and why.

A recording can span several sessions: ``--stop-after 8m`` starts no configuration that is
predicted to end past 8 minutes (the estimator's probe cost, scaled by how long this node's
recorded probes took against theirs), and ``--resume`` goes on where the folder stops (on the
same kind of node and software: it refuses another). ``--simulate h100-80gb`` records against
the simulated GPU instead (a fake, named so in every result): what a grid will cost, and which
points it will skip, before a GPU is at hand.

    python bench/record_grid.py --model qwen2.5-1.5b --seq-len 2048 --global-batch 64 \\
        --out bench/data/h100/qwen2.5-1.5b --resume --stop-after 8m
    python bench/record_grid.py --model mistral-7b --seq-len 2048 --global-batch 16 \\
        --simulate h100-80gb --host-memory 125GiB --out /tmp/plan   # the cost, no GPU
    python bench/record_grid.py --model tiny --device cpu --device-memory 4MiB --gpus 2 \\
        --seq-len 128 --global-batch 32 --out /tmp/grid          # no GPU: emulated device
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune import api
from autotune.config import (
    ConfigError,
    Engine,
    Knobs,
    TrainConfig,
    parse_losses,
    parse_optimizers,
)
from autotune.devices import Device, LocalDevice, SimulatedDevice
from autotune.devices.replay import REPLAYED, Grid, GridKey, without_checkpointing
from autotune.hardware import cpu_device_spec, detect_gpus, host_memory_bytes
from autotune.models import resolve_model
from autotune.probe import Outcome
from autotune.probe.spec import ProbeSpec
from autotune.space import Workload, configurations, micro_batch_options
from autotune.study.fingerprint import software_versions
from autotune.units import format_duration, parse_duration, parse_size

SAME_NODE = ("gpu", "gpus", "software")
"""What a resumed recording must share with the folder's first: the GPU and the software
(host memory too, within ``HOST_TOLERANCE``): one grid is one node's truth."""
HOST_TOLERANCE = 0.02


def node_facts(device: Device, host_bytes: int | None) -> dict[str, Any]:
    """The node a grid is recorded on (the replay reads the probes; this is for people, and
    for refusing to resume a grid on another kind of node)."""
    gpus = detect_gpus() if device.kind == "cuda" else None
    simulated = isinstance(device, SimulatedDevice)
    return {
        "date": time.strftime("%Y-%m-%d"),
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "host_memory_bytes": host_bytes if simulated else host_memory_bytes(),
        "gpu": device.gpu.name + " (simulated)" if simulated else gpus.name if gpus else None,
        "gpus": gpus.count if gpus else (1 if simulated else 0),
        "driver": gpus.driver if gpus else None,
        "software": software_versions(),
        "python": platform.python_version(),
    }


def check_same_node(before: dict[str, Any], now: dict[str, Any]) -> None:
    """Refuse to resume a grid on another kind of node or software (one line, exit 2)."""
    for name in SAME_NODE:
        if before.get(name) != now.get(name):
            raise ConfigError(
                f"this grid was recorded with {name} {before.get(name)!r}, this node has "
                f"{now.get(name)!r}: record into another --out"
            )
    was, is_ = before.get("host_memory_bytes") or 0, now.get("host_memory_bytes") or 0
    if abs(was - is_) > HOST_TOLERANCE * max(was, is_, 1):
        raise ConfigError(
            f"this grid was recorded on a node with {was} bytes of host memory, this one has "
            f"{is_}: host OOMs would not replay; record into another --out"
        )


def recording_order(space: list[TrainConfig]) -> list[int]:
    """The order to record ``space`` in (indices): configurations that differ only in
    checkpointing stay together, in the order the space first names them, most checkpointed
    first (its outcomes decide the others' where the replay rules allow)."""
    first: dict[TrainConfig, int] = {}
    for index, config in enumerate(space):
        first.setdefault(without_checkpointing(config), index)

    def rank(index: int) -> tuple[int, int, int]:
        ac = space[index].ac_every
        return (first[without_checkpointing(space[index])], 0 if ac else 1, ac)

    return sorted(range(len(space)), key=rank)


def replayable(out: Path) -> dict[str, dict[str, Any]]:
    """The probes recorded in ``out`` that the replay stands for, by name (``007``); an error
    or a timeout is probed again."""
    found = {}
    for path in sorted(out.glob("[0-9]*.json")):
        data = json.loads(path.read_text())
        if Outcome(data["outcome"]) in REPLAYED:
            found[path.stem] = data
    return found


@dataclass(frozen=True, slots=True)
class Decision:
    """What the recordings so far decide of one configuration: the sizes left to measure
    (none: the whole configuration follows) and why the others need no probe."""

    sizes: tuple[int, ...]
    reason: str


def decide(grid: Grid | None, config: TrainConfig, sizes: list[int]) -> Decision:
    """The sizes of ``config`` the grid does not decide yet (the replay device's rules)."""
    if grid is None:
        return Decision(tuple(sizes), "")
    killed = grid.failed_building(config)
    if killed is not None:
        what = killed.outcome.value
        return Decision((), f"{what} while building, as recorded for {killed.spec.config.label()}")
    bound = grid.oom_from(config)
    if bound is None:
        return Decision(tuple(sizes), "")
    mbs, recorded = bound
    other = recorded.probe.spec.config
    left = tuple(s for s in sizes if s < mbs)
    return Decision(left, f"oom from micro-batch {mbs}, as recorded for {other.label()}")


def load_grid(out: Path, key: GridKey) -> Grid | None:
    """The recordings already in ``out`` (None: none the replay stands for yet)."""
    return Grid.from_folder(out, key) if replayable(out) else None


def predicted_s(spec: ProbeSpec, simulated: SimulatedDevice) -> float:
    """The estimator's wall time of one probe (what the simulated device charges)."""
    with tempfile.TemporaryDirectory() as folder:
        return simulated.launch(spec, Path(folder)).wall_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--device-memory", default=None, help="emulated cap, e.g. 4MiB")
    parser.add_argument("--simulate", metavar="GPU", help="record the simulated GPU (a fake)")
    parser.add_argument("--host-memory", default=None, help="the simulated node's, e.g. 125GiB")
    parser.add_argument("--engine", default=None, help="only these engines: fsdp,deepspeed")
    parser.add_argument(
        "--loss", default="full", help="the losses to record: full (default), chunked or both"
    )
    parser.add_argument(
        "--ac-ops", action="store_true", help="record op-level selective checkpointing too"
    )
    parser.add_argument(
        "--act-offload", action="store_true", help="record activation offload too (GPUs)"
    )
    parser.add_argument(
        "--optimizer",
        default="adamw",
        help="the optimizers to record: adamw (default), adamw-8bit or both",
    )
    parser.add_argument("--timeout", default="15m", help="per probe")
    parser.add_argument("--stop-after", default=None, help="start nothing predicted to end later")
    parser.add_argument("--complete", action="store_true", help="also points the rules decide")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--trials-dir", type=Path, default=Path("trials"))
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    try:
        record(args)
    except (ConfigError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def record(args: argparse.Namespace) -> None:
    model = resolve_model(args.model)
    workload = Workload(seq_len=args.seq_len, global_batch=args.global_batch, world_size=args.gpus)
    engines = [Engine(e) for e in args.engine.split(",")] if args.engine else None
    on_gpu = args.device == "cuda"
    space = configurations(
        world_size=args.gpus,
        num_layers=model.num_layers,
        engines=engines,
        offload=on_gpu,  # an emulated device has no host to offload to
        knobs=Knobs(
            losses=parse_losses(args.loss) or (),
            op_checkpointing=args.ac_ops,
            optimizers=parse_optimizers(args.optimizer) or (),
            activation_offload=args.act_offload,
        ),
    )
    sizes = micro_batch_options(workload)
    stop_after = parse_duration(args.stop_after) if args.stop_after else None
    host_bytes = parse_size(args.host_memory) if args.host_memory else None
    cap = parse_size(args.device_memory) if args.device_memory else None
    if args.simulate:
        device: Device = SimulatedDevice.named(
            args.simulate, noise=0.0, gpus_per_node=args.gpus, host_memory_bytes=host_bytes
        )
    else:
        device = LocalDevice(args.device)
    if isinstance(device, SimulatedDevice):
        costs = device
    else:  # the estimator's costs on this node, to stop in time
        found = detect_gpus() if on_gpu else None
        if on_gpu and (found is None or found.spec is None):
            raise ConfigError("--device cuda needs a GPU in the catalogue (docs/gpus.md)")
        gpu = found.spec if found is not None and found.spec else cpu_device_spec(cap or 0)
        costs = SimulatedDevice(
            gpu=gpu, noise=0.0, gpus_per_node=args.gpus, host_memory_bytes=host_memory_bytes()
        )
    if args.out.exists() and any(args.out.glob("[0-9]*.json")) and not args.resume:
        raise ConfigError(f"{args.out} already holds a grid: --resume to go on, or another --out")
    args.out.mkdir(parents=True, exist_ok=True)
    facts_path = args.out / "node.json"
    facts = node_facts(device, host_bytes)
    previous = json.loads(facts_path.read_text()) if facts_path.exists() else None
    if previous is not None and args.resume:
        check_same_node(previous, facts)
    sessions = (previous or {}).get("sessions", []) if args.resume else []
    implied = dict((previous or {}).get("implied", {})) if args.resume else {}
    trimmed = dict((previous or {}).get("trimmed", {})) if args.resume else {}
    session: dict[str, Any] = {
        "date": facts["date"],
        "host": facts["host"],
        "recorded": [],
        "implied": [],
    }
    command = [Path(sys.executable).name, *sys.argv]

    def save(state: str) -> None:
        body = {
            **facts,
            "workload": {
                "model": model.name,
                "seq_len": args.seq_len,
                "global_batch": args.global_batch,
                "gpus": args.gpus,
                "device_memory": args.device_memory,
            },
            "command": command,
            "configurations": len(space),
            "state": state,
            "implied": dict(sorted(implied.items())),
            "trimmed": dict(sorted(trimmed.items())),
            "sessions": sessions + ([session] if session["recorded"] or session["implied"] else []),
        }
        facts_path.write_text(json.dumps(body, indent=2) + "\n")

    key = GridKey(args.model, args.seq_len, args.gpus, 1, cap)  # as the probes' specs say
    done = {
        json.dumps(data["spec"]["config"], sort_keys=True) for data in replayable(args.out).values()
    }
    started = time.monotonic()
    measured: list[tuple[float, float]] = []  # (predicted, measured) seconds this session
    state = "complete"
    try:
        for index in recording_order(space):
            config = space[index]
            name = f"{index:03d}"
            if json.dumps(config.to_dict(), sort_keys=True) in done or name in implied:
                continue
            decision = (
                decide(None, config, sizes)
                if args.complete
                else decide(load_grid(args.out, key), config, sizes)
            )
            note = f"{config.label()}: {decision.reason}"
            if decision.reason and not decision.sizes:
                implied[name] = note
                session["implied"].append(name)
                print(f"[{name}] skipped, decided by the grid: {note}", flush=True)
                save("recording")
                continue
            spec = ProbeSpec(
                model=args.model,
                config=config,
                micro_batch_sizes=decision.sizes,
                seq_len=args.seq_len,
                num_processes=1 if config.engine is Engine.SINGLE and args.gpus == 1 else args.gpus,
                device=args.device,
                device_memory_bytes=cap,
            )
            predicted = predicted_s(spec, costs)
            scale = sum(m for _, m in measured) / sum(p for p, _ in measured) if measured else 1.0
            # a simulated probe takes no time here: count what it charges, as a budget does
            simulated = isinstance(device, SimulatedDevice)
            elapsed = sum(m for _, m in measured) if simulated else time.monotonic() - started
            if stop_after is not None and not measured and predicted * scale > stop_after:
                raise ConfigError(
                    f"{config.label()} is predicted to take {format_duration(predicted * scale)}, "
                    f"more than --stop-after {format_duration(stop_after)}: give it more time"
                )
            if stop_after is not None and elapsed + predicted * scale > stop_after:
                state = "incomplete"
                ahead = format_duration(predicted * scale)
                left_s = format_duration(max(0.0, stop_after - elapsed))
                print(
                    f"stopped before {config.label()} (predicted {ahead}, {left_s} left of "
                    "--stop-after): --resume goes on",
                    flush=True,
                )
                break
            result = api.probe(
                args.model,
                config,
                micro_batch_sizes=decision.sizes,
                seq_len=args.seq_len,
                gpus=args.gpus,
                device=device,
                device_memory=args.device_memory,
                timeout=args.timeout,
                trials_dir=args.trials_dir,
                folder=f"grid-{model.name}",
            )
            measured.append((predicted, result.wall_s))
            if decision.reason and result.outcome is Outcome.OK:  # it stopped short of one
                trimmed[name] = note
            (args.out / f"{name}.json").write_text((result.probe_dir / "result.json").read_text())
            session["recorded"].append(name)
            sweep = ", ".join(f"{s.micro_batch_size}: {s.outcome.value}" for s in result.sizes)
            print(
                f"[{name}] {config.label()}: {result.outcome.value} "
                f"({sweep or result.message[:80]}) in {result.wall_s:.1f} s "
                f"(predicted {predicted:.0f} s)",
                flush=True,
            )
            save("recording")
    finally:
        device.close()
        session["wall_s"] = round(time.monotonic() - started, 1)
        recorded_names = replayable(args.out)
        left = [
            f"{i:03d}"
            for i in range(len(space))
            if f"{i:03d}" not in implied and f"{i:03d}" not in recorded_names
        ]
        final = "complete" if state == "complete" and not left else "incomplete"
        # a call that did nothing leaves node.json as it was
        if session["recorded"] or session["implied"] or (previous or {}).get("state") != final:
            save(final)
    recorded = len(space) - len(left) - len(implied)
    spent = (
        f"{sum(m for _, m in measured):.0f} s charged by the simulated GPU"
        if isinstance(device, SimulatedDevice)
        else f"{time.monotonic() - started:.0f} s"
    )
    print(
        f"{args.out}: {recorded} configurations recorded, {len(implied)} decided by the grid, "
        f"{len(left)} left of {len(space)} ({spent} this session)"
    )


if __name__ == "__main__":
    main()
