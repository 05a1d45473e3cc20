"""A replayed GPU: probes answered from a grid recorded on a real one, behind :class:`Device`.

A recorded grid is a folder of probes' own ``result.json`` files (any depth; other JSON files
are skipped), measured on one node for one workload: the model, the sequence length, the
ranks and any emulated device cap (:class:`GridKey`). :meth:`ReplayDevice.launch` answers a
probe of that workload size by size from what was measured:

- a size recorded ``ok`` or ``oom``: its recorded memory and outcome, and its throughput
  recomputed at the probe's accumulation count from the recorded micro-step and optimizer
  step times (as a real probe reports it); a re-measurement (``spec.seed`` n) takes the
  n-th recording of the point where there are several, so replayed repeats scatter as the
  real ones did;
- a size above one recorded ``oom`` of the same configuration: ``oom`` (memory only grows with
  the micro-batch), said so in its message;
- a size at or above one recorded ``oom`` of a configuration that differs only in
  checkpointing more blocks (a superset of this one's): ``oom`` (recomputing more blocks only
  frees activations), said so in its message;
- a configuration recorded as killed by the host's OOM killer: ``host_oom`` at every size
  (its states are built before the first step); on a GPU, so is every configuration that
  differs from it only in checkpointing (activations live on the device: the host holds the
  same offloaded states);
- a configuration recorded out of device memory while it was built (its states do not fit,
  before any step): ``oom`` while building, and so is every configuration that differs from
  it only in checkpointing (no activation exists yet);
- anything else was not recorded: the probe is an ``error`` that names the point. Nothing is
  guessed.

The cross-checkpointing rules (:meth:`Grid.failed_building`, :meth:`Grid.oom_from`) are what
lets ``bench/record_grid.py`` skip the points they decide, so a grid costs fewer GPU minutes;
a grid recorded with ``--complete`` measures those points too, and the replay then answers
them as measured.

Each replayed probe charges the budget what the recorded probes took (:class:`ProbeClock`):
the start-up and build of the configuration's recording, and each size's recorded warm-up and
timed steps scaled to the probe's step counts. A probe answered with an error charges the
median start-up of the grid's probes. Every result says ``replay:<gpu>`` and keeps the
recording's file in each size's ``extra`` (``recorded``).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.config import ConfigError, Knobs, Loss, Optimizer, TrainConfig
from autotune.devices.base import AnsweredDevice
from autotune.hardware import GpuSpec, cpu_device_spec
from autotune.hardware.lookup import driver_spec
from autotune.models import resolve_model
from autotune.probe.metrics import probe_throughput
from autotune.probe.outcome import Outcome, Stage
from autotune.probe.result import ProbeResult, SizeResult
from autotune.probe.spec import ProbeSpec
from autotune.space import oom_rules_out

__all__ = [
    "REPLAYED",
    "Grid",
    "GridKey",
    "Recording",
    "ReplayDevice",
    "checkpoints_all_of",
    "without_checkpointing",
]

REPLAYED = (Outcome.OK, Outcome.OOM, Outcome.HOST_OOM)
"""Outcomes a recording stands for; an error, crash or timeout says more about the node's
software that day than about the configuration, so it is not replayed."""


@dataclass(frozen=True, slots=True)
class GridKey:
    """The workload a recorded probe measured (a grid holds one)."""

    model: str
    seq_len: int
    num_processes: int
    nodes: int
    device_memory_bytes: int | None

    @classmethod
    def of(cls, spec: ProbeSpec) -> GridKey:
        return cls(
            spec.model, spec.seq_len, spec.num_processes, spec.nodes, spec.device_memory_bytes
        )


def _config_key(config: TrainConfig) -> str:
    return json.dumps(config.to_dict(), sort_keys=True)


def without_checkpointing(config: TrainConfig) -> TrainConfig:
    """A configuration but for its checkpointing: what its siblings across ``ac_every`` share."""
    return dataclasses.replace(config, ac_every=0)


def checkpoints_all_of(more: int, fewer: int) -> bool:
    """Whether checkpointing every ``more``-th block recomputes every block that checkpointing
    every ``fewer``-th does (blocks 0, k, 2k, ...: off is none, 1 is all, and every-4's
    blocks are every-2's too), so its activations can only take less device memory."""
    return fewer == 0 or (more > 0 and fewer % more == 0)


@dataclass(frozen=True, kw_only=True)
class Recording:
    """One recorded probe: its result and the file it was read from."""

    path: Path
    probe: ProbeResult


@dataclass(frozen=True, kw_only=True)
class _Recorded:
    size: SizeResult
    probe: ProbeResult
    path: Path


@dataclass(kw_only=True)
class Grid:
    """The recorded probes of one workload, indexed by configuration and micro-batch size."""

    key: GridKey
    gpu: GpuSpec
    """The recordings' GPU, from the name the driver gave."""
    recordings: list[Recording]
    points: dict[tuple[str, int], list[_Recorded]] = field(default_factory=dict)
    failed_builds: dict[str, ProbeResult] = field(default_factory=dict)
    """Configurations recorded killed by the host's OOM killer or out of device memory while
    being built (no size ran)."""

    def __post_init__(self) -> None:
        for recording in self.recordings:
            probe = recording.probe
            config = _config_key(probe.spec.config)
            if probe.outcome in (Outcome.HOST_OOM, Outcome.OOM) and not probe.sizes:
                self.failed_builds.setdefault(config, probe)
            for size in probe.sizes:
                if size.outcome in (Outcome.OK, Outcome.OOM):
                    point = (config, size.micro_batch_size)
                    found = _Recorded(size=size, probe=probe, path=recording.path)
                    self.points.setdefault(point, []).append(found)

    @property
    def probes(self) -> list[ProbeResult]:
        return [r.probe for r in self.recordings]

    @property
    def knobs(self) -> Knobs:
        """The knobs beyond the ladder the grid's configurations were recorded with (a search
        over the grid tries only those: any other point was not recorded)."""
        configs = [r.probe.spec.config for r in self.recordings]
        losses = {c.loss for c in configs}
        optimizers = {c.optimizer for c in configs}
        return Knobs(
            losses=tuple(x for x in Loss if x in losses) or (Loss.FULL,),
            op_checkpointing=any(c.ac_ops for c in configs),
            optimizers=tuple(x for x in Optimizer if x in optimizers) or (Optimizer.ADAMW,),
            activation_offload=any(c.act_offload for c in configs),
        )

    @classmethod
    def from_folder(cls, folder: Path, key: GridKey | None = None) -> Grid:
        """The recorded grid in ``folder``: every probe result of ``key``'s workload (default:
        the workload of most recordings there).

        Raises:
            ConfigError: No probe result in the folder, or none of that workload, or
                recordings from several GPUs.
        """
        found: list[Recording] = []
        for path in sorted(folder.rglob("*.json")):
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if not isinstance(data, dict) or "spec" not in data or "outcome" not in data:
                continue  # a plan, a node description: not a probe
            probe = ProbeResult.from_dict(data, path.parent)
            if probe.outcome in REPLAYED and (probe.gpu_name or probe.spec.device == "cpu"):
                found.append(Recording(path=path, probe=probe))
        if not found:
            raise ConfigError(f"{folder} holds no recorded probe (result.json) to replay")
        if key is None:
            keys = [GridKey.of(r.probe.spec) for r in found]
            key = max(set(keys), key=lambda k: (keys.count(k), k.model))
        chosen = [r for r in found if GridKey.of(r.probe.spec) == key]
        if not chosen:
            raise ConfigError(f"{folder} holds no recorded probe of {key}")
        names = {r.probe.gpu_name if r.probe.spec.device != "cpu" else "cpu" for r in chosen}
        if len(names) > 1:
            raise ConfigError(f"{folder} mixes recordings of {sorted(map(str, names))}")
        name = str(names.pop())
        if name == "cpu":  # real CPU probes under an emulated device cap
            if key.device_memory_bytes is None:
                raise ConfigError(f"{folder}: CPU probes without an emulated device cap")
            return cls(key=key, gpu=cpu_device_spec(key.device_memory_bytes), recordings=chosen)
        gpu = driver_spec(name)
        if gpu is None:
            raise ConfigError(f"the recordings' GPU {name!r} is not in the GPU catalogue")
        return cls(key=key, gpu=gpu, recordings=chosen)

    @property
    def device(self) -> str:
        """Where the recordings ran: ``cuda``, or ``cpu`` (under an emulated cap)."""
        return "cpu" if self.gpu.key == "cpu" else "cuda"

    def recorded(self, config: TrainConfig, micro_batch_size: int) -> list[_Recorded]:
        """The recordings of one point, oldest file first."""
        return self.points.get((_config_key(config), micro_batch_size), [])

    def failed_building(self, config: TrainConfig) -> ProbeResult | None:
        """The recorded probe that says ``config`` fails while its model and states are built
        (host OOM, or out of device memory before any step): its own, or one of a
        configuration that differs only in checkpointing (for a host OOM, on a GPU only: on
        the CPU the device's tensors are host memory too). None: none says so."""
        own = self.failed_builds.get(_config_key(config))
        if own is not None:
            return own
        family = without_checkpointing(config)
        return next(
            (
                probe
                for _, probe in sorted(self.failed_builds.items())
                if without_checkpointing(probe.spec.config) == family
                and (probe.outcome is Outcome.OOM or self.device == "cuda")
            ),
            None,
        )

    def oom_from(self, config: TrainConfig) -> tuple[int, _Recorded] | None:
        """The smallest micro-batch size from which ``config`` runs out of device memory by
        the recordings, and the recording that says so: an ``oom`` of its own (sizes above it
        follow), or one of a configuration that differs only in checkpointing a superset of
        its blocks (that size and those above follow). None: no recording bounds it."""
        family, own = without_checkpointing(config), _config_key(config)
        found: list[tuple[int, int, _Recorded]] = []
        for (key, mbs), recordings in self.points.items():
            oom = next((r for r in recordings if r.size.outcome is Outcome.OOM), None)
            if oom is None:
                continue
            other = oom.probe.spec.config
            if key == own:
                found.append((mbs, 0, oom))
            elif without_checkpointing(other) == family and checkpoints_all_of(
                other.ac_every, config.ac_every
            ):
                found.append((mbs, 1, oom))
        if not found:
            return None
        mbs, _, first = min(found, key=lambda f: (f[0], f[1], str(f[2].path)))
        return mbs, first

    def configs(self) -> list[TrainConfig]:
        """Every configuration the grid recorded (a size, or a failed build)."""
        keys = {c for c, _ in self.points} | set(self.failed_builds)
        return [TrainConfig.from_dict(json.loads(k)) for k in sorted(keys)]

    def value(self, config: TrainConfig, micro_batch_size: int, global_batch: int) -> float:
        """Recorded tokens/s of a point at ``global_batch`` (sequences per optimizer step), at
        the accumulation that reaches it, from its first recording's step times; 0 for a
        point recorded out of memory, not recorded, or whose size does not divide it."""
        world = self.key.num_processes * self.key.nodes
        found = self.recorded(config, micro_batch_size)
        if not found or global_batch % (micro_batch_size * world):
            return 0.0
        size, probe = found[0].size, found[0].probe
        if not size.ok or size.micro_step_s is None or size.optimizer_step_s is None:
            return 0.0
        spec = dataclasses.replace(
            probe.spec, grad_accum=global_batch // (micro_batch_size * world)
        )
        speed = probe_throughput(
            spec,
            resolve_model(self.key.model),
            micro_batch_size,
            micro_step_s=size.micro_step_s,
            optimizer_step_s=size.optimizer_step_s,
            peak_flops=None,
        )
        return speed.tokens_per_second

    def best(self, global_batch: int) -> tuple[TrainConfig, int, float] | None:
        """The fastest recorded point at ``global_batch``: configuration, micro-batch size and
        :meth:`value` (None when no recorded size fits and divides it)."""
        best: tuple[TrainConfig, int, float] | None = None
        for config_key, mbs in sorted(self.points):
            config = TrainConfig.from_dict(json.loads(config_key))
            value = self.value(config, mbs, global_batch)
            if value > 0 and (best is None or value > best[2]):
                best = (config, mbs, value)
        return best

    def start_s(self) -> float:
        """The median start-up of the recorded probes (spawn to the model build)."""
        values = [p.startup_s or p.import_s or 0.0 for p in self.probes]
        return statistics.median(values) if values else 0.0


def _overhead_s(probe: ProbeResult) -> float:
    """What a recorded probe spent outside its build and its sizes' steps: start-up,
    teardown and reaping."""
    steps = sum((s.warmup_s or 0.0) + (s.timed_s or 0.0) for s in probe.sizes)
    return max(0.0, probe.wall_s - (probe.build_s or 0.0) - steps)


@dataclass(kw_only=True)
class ReplayDevice(AnsweredDevice):
    """A real GPU's recorded grid, replayed (named as such in every result).

    Args:
        grid: What was measured.
        host_memory_bytes: The recording node's host memory (what the plan may assume).
    """

    grid: Grid
    host_memory_bytes: int | None = None

    @classmethod
    def from_folder(
        cls, folder: str | Path, *, host_memory_bytes: int | None = None, key: GridKey | None = None
    ) -> ReplayDevice:
        return cls(grid=Grid.from_folder(Path(folder), key), host_memory_bytes=host_memory_bytes)

    @property
    def kind(self) -> str:
        return "replay"

    @property
    def gpu(self) -> GpuSpec:
        return self.grid.gpu

    @property
    def label(self) -> str:
        return f"replay:{self.grid.gpu.key}"

    def launch(
        self,
        spec: ProbeSpec,
        probe_dir: Path,
        *,
        on_poll: Callable[[float], None] | None = None,
    ) -> ProbeResult:
        """Answer one probe from the recordings (the :class:`Device` contract)."""
        if on_poll is not None:
            on_poll(0.0)
        if GridKey.of(spec) != self.grid.key:
            raise ConfigError(
                f"this grid recorded {self.grid.key}, not the probe's workload {GridKey.of(spec)}"
            )
        probe_dir.mkdir(parents=True, exist_ok=True)
        (probe_dir / "config.json").write_text(json.dumps(spec.to_dict(), indent=2))
        killed = self.grid.failed_building(spec.config)
        result = (
            self._replay(spec, probe_dir)
            if killed is None
            else self._answer(
                spec,
                probe_dir,
                outcome=killed.outcome,
                stage=killed.stage or Stage.BUILD,
                message=f"replayed: {killed.message}"
                + (
                    ""
                    if killed.spec.config == spec.config
                    else f" (recorded for {killed.spec.config.label()}: its build does not "
                    "depend on checkpointing)"
                ),
                sizes=[],
                wall_s=killed.wall_s,
                build_s=killed.build_s,
            )
        )
        result.write()
        return result

    def _answer(self, spec: ProbeSpec, probe_dir: Path, **fields: Any) -> ProbeResult:
        return ProbeResult(
            spec=spec,
            probe_dir=probe_dir,
            failed_rank=0 if fields["outcome"] is not Outcome.OK else None,
            import_s=self.grid.start_s(),
            device=self.label,
            gpu_name=f"{self.gpu.name} (replayed)",
            peak_flops=self.gpu.peak(spec.config.precision.compute_dtype),
            **fields,
        )

    def _replay(self, spec: ProbeSpec, probe_dir: Path) -> ProbeResult:
        model = resolve_model(spec.model)
        peak_flops = self.gpu.peak(spec.config.precision.compute_dtype)
        sizes: list[SizeResult] = []
        recordings: list[ProbeResult] = []
        step_time = 0.0
        failed: int | None = None
        steps = spec.warmup_steps + spec.timed_steps
        for mbs in spec.micro_batch_sizes:
            if failed is not None and oom_rules_out(failed, mbs, spec.accumulation):
                continue  # as the worker: a larger size cannot fit either
            samples = self.grid.recorded(spec.config, mbs)
            if not samples:
                bound = self.grid.oom_from(spec.config)
                if bound is None or bound[0] > mbs:
                    return self._answer(
                        spec,
                        probe_dir,
                        outcome=Outcome.ERROR,
                        stage=Stage.STARTUP,
                        message=(
                            f"not recorded in the grid: {spec.config.label()} at micro-batch "
                            f"{mbs} (a replayed probe answers only what was measured)"
                        ),
                        sizes=sizes,
                        wall_s=self.grid.start_s(),
                    )
                failed = mbs
                other = bound[1].probe.spec.config
                sizes.append(
                    SizeResult(
                        micro_batch_size=mbs,
                        outcome=Outcome.OOM,
                        stage=Stage.FORWARD,
                        message=f"replayed: out of memory, as recorded at micro-batch "
                        f"{bound[0]}" + ("" if other == spec.config else f" for {other.label()}"),
                        ooms=1,
                        extra={"recorded": str(bound[1].path)},
                    )
                )
                if spec.world_size > 1:
                    break
                continue
            chosen = samples[spec.seed % len(samples)]
            recordings.append(chosen.probe)
            size = chosen.size
            extra = {**size.extra, "recorded": str(chosen.path)}
            if size.outcome is Outcome.OOM:
                failed = mbs
                sizes.append(_with(size, extra=extra, message=f"replayed: {size.message}"))
                if spec.world_size > 1:
                    break
                continue
            if size.micro_step_s is None or size.optimizer_step_s is None:
                raise ConfigError(f"{chosen.path}: a size recorded ok has no step times")
            speed = probe_throughput(
                spec,
                model,
                mbs,
                micro_step_s=size.micro_step_s,
                optimizer_step_s=size.optimizer_step_s,
                peak_flops=peak_flops,
            )
            recorded_steps = chosen.probe.spec.warmup_steps + chosen.probe.spec.timed_steps
            per_step = ((size.warmup_s or 0.0) + (size.timed_s or 0.0)) / max(1, recorded_steps)
            step_time += per_step * steps
            sizes.append(
                _with(
                    size,
                    extra=extra,
                    warmup_s=per_step * spec.warmup_steps,
                    timed_s=per_step * spec.timed_steps,
                    **speed.to_dict(),
                )
            )
        first = recordings[0] if recordings else None
        build_s = first.build_s if first is not None else None
        overhead = _overhead_s(first) if first is not None else self.grid.start_s()
        return self._answer(
            spec,
            probe_dir,
            outcome=Outcome.OOM if failed is not None else Outcome.OK,
            stage=next((s.stage for s in sizes if s.outcome is Outcome.OOM), None),
            message=next((s.message for s in sizes if s.outcome is Outcome.OOM), ""),
            sizes=sizes,
            wall_s=overhead + (build_s or 0.0) + step_time,
            build_s=build_s,
        )

    def __repr__(self) -> str:
        return f"ReplayDevice({self.label}, {len(self.grid.probes)} recorded probes)"


def _with(size: SizeResult, **changes: Any) -> SizeResult:
    return dataclasses.replace(size, **changes)
