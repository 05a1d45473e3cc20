"""A simulated GPU: probes answered by the estimator, behind the :class:`Device` interface.

:meth:`SimulatedDevice.launch` takes a :class:`~autotune.probe.ProbeSpec` and a probe folder
and returns a :class:`~autotune.probe.ProbeResult`, as the local device does, so the search,
the tests and the benchmarks run the whole tuning loop on machines without a GPU. Peak memory
comes from the memory model, step times from the time model, with seeded multiplicative noise
(a real probe's timings scatter by a few percent) and the device's own error terms
(:class:`ErrorTerm`: how far, and shared by which configurations, its truth departs from the
estimator; none by default); a micro-batch whose predicted peak exceeds
the GPU's usable memory (or the spec's ``device_memory_bytes``) ends in an out-of-memory
outcome, as on the device, and a probe whose offloaded states need more host memory than the
simulated node has (``host_memory_bytes``) is killed while it builds them (``host_oom``, after
the build time it would have spent), as the kernel's OOM killer did on the H100 run. The
result's ``device`` reads ``simulated:<gpu>``, every size is marked ``simulated``, and
``wall_s`` is the time the probe would have taken on the GPU, not the microseconds it did
(the budget is charged that: :class:`~autotune.devices.ProbeClock`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.config import KNOB_OFF, Offload, TrainConfig
from autotune.devices.base import AnsweredDevice
from autotune.estimator.cost import (
    HOST_BUILD_BYTES_PER_S,
    START_S,
    build_seconds,
    probe_seconds,
)
from autotune.estimator.host import estimate_host, usable_host_bytes
from autotune.estimator.parallel import estimate_rank_memory, predict_rank_time
from autotune.estimator.plan import DEVICE_RESERVE_BYTES, caching_allocator, usable_bytes
from autotune.hardware import GpuSpec, gpu_spec
from autotune.models import ModelSpec, resolve_model
from autotune.probe.metrics import probe_throughput
from autotune.probe.outcome import Outcome, Stage
from autotune.probe.result import ProbeResult, SizeResult
from autotune.probe.spec import ProbeSpec
from autotune.space import oom_rules_out
from autotune.units import format_bytes

__all__ = ["ErrorTerm", "SimulatedDevice"]


FEATURES = (
    "engine",
    "zero_stage",
    "precision",
    "ac_every",
    "ac_ops",
    "offload",
    "attention",
    "loss",
    "optimizer",
)
"""The configuration fields an error term may be shared by (``config``: each its own)."""
KNOB_ERROR = ((0.98, 1.02), (1.0, 1.03))
"""(peak memory, step time) ranges of a knob's own error on top of its twin's. Memory: the
knob terms matched the byte-exact trace within 1.2 % and the probe's counter within 1.4 %
(docs/estimator.md). Time: a knob adds work to its twin's step (the chunked loss's recomputed
output layer, op-level checkpointing's recomputed memory-bound ops: 1-15 % of a step; 8-bit
AdamW's quantizing step), so its step is its twin's and that work, up to 3 % of the step more
than predicted; never less than its twin's, which no knob can make faster."""


def _fields(config: TrainConfig, *, knobs: bool = False) -> dict[str, Any]:
    """A configuration's fields as the simulator keys its draws. Without ``knobs``, those of
    its twin with the knobs beyond the ladder off: a configuration with the chunked loss,
    op-level checkpointing or 8-bit AdamW draws what its twin draws (the same kernels run,
    the knob changes the head, what is kept or the moments' bytes: ``KNOB_ERROR`` adds its
    own error), and one without them draws what it drew before they existed. With
    ``knobs``, its own (a probe's timing noise)."""
    return {
        name: value
        for name, value in config.to_dict().items()
        if name not in KNOB_OFF or (knobs and value != KNOB_OFF[name])
    }


def _draw(*key: object) -> random.Random:
    return random.Random(hashlib.sha256(json.dumps(key, default=str).encode()).digest())


@dataclass(frozen=True, kw_only=True, slots=True)
class ErrorTerm:
    """One way a simulated GPU disagrees with the estimator: seeded factors drawn once per
    group of configurations that agree on ``by``, uniform in each range (1 is no error).

    A time factor above 1 is slower than predicted; a memory factor above 1 needs more than
    predicted. ``memory_per_doubling`` makes the memory error grow with the micro-batch (the
    factor ``(1 + g) ** log2(mbs)``, g drawn in the range: fragmentation that grows with the
    activations); ``cliff`` slows every micro-batch from a size drawn in ``cliff_from`` up
    (a kernel or allocator cliff, so throughput need not grow with the micro-batch).
    ``tail_share`` of the groups are outliers: their time factor is multiplied or divided
    (a coin) by a factor drawn in ``tail`` (a configuration that hits a fast kernel or a slow
    path: heavy tails rather than one spread for all). ``only`` limits the term to
    configurations with (``offload``) or without (``no-offload``) offload. The host factor
    ignores checkpointing (the offloaded states do not depend on it, nor on op-level
    checkpointing and the loss)."""

    by: tuple[str, ...] = ("config",)
    time: tuple[float, float] = (1.0, 1.0)
    memory: tuple[float, float] = (1.0, 1.0)
    host: tuple[float, float] = (1.0, 1.0)
    memory_per_doubling: tuple[float, float] = (0.0, 0.0)
    cliff: tuple[float, float] = (1.0, 1.0)
    cliff_from: tuple[int, int] = (1, 1)
    tail: tuple[float, float] = (1.0, 1.0)
    tail_share: float = 0.0
    only: str | None = None

    def __post_init__(self) -> None:
        unknown = set(self.by) - {*FEATURES, "config"}
        if unknown:
            raise ValueError(f"error term by {sorted(unknown)}: use {', '.join(FEATURES)}, config")
        if self.only not in (None, "offload", "no-offload"):
            raise ValueError(f"error term only {self.only!r}: use offload or no-offload")
        if not 0.0 <= self.tail_share <= 1.0:
            raise ValueError(f"error term tail_share {self.tail_share}: use a share in 0..1")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ErrorTerm:
        """A term from its JSON form (lists for the tuples)."""
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"error term fields {sorted(unknown)} are not known")
        fields: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in data.items()
        }
        return cls(**fields)

    def _group(self, config: TrainConfig, *, host: bool = False) -> list[Any]:
        fields = _fields(config)
        if host:  # the offloaded states and the processes: not the activations, nor the loss
            for name in ("ac_every", *KNOB_OFF):
                fields.pop(name, None)
        if "config" in self.by:
            return sorted(fields.items())
        return [fields[name] for name in self.by if name in fields]

    def _applies(self, config: TrainConfig) -> bool:
        offload = config.offload is not Offload.NONE
        return self.only is None or (self.only == "offload") == offload

    def factors(
        self, seed: int, index: int, model: str, config: TrainConfig, micro_batch_size: int
    ) -> tuple[float, float]:
        """(peak memory, step time) factors at ``micro_batch_size``."""
        if not self._applies(config):
            return 1.0, 1.0
        rng = _draw("term", seed, index, model, self._group(config))
        memory, time = rng.uniform(*self.memory), rng.uniform(*self.time)
        growth = rng.uniform(*self.memory_per_doubling)
        memory *= (1 + growth) ** math.log2(max(1, micro_batch_size))
        low, high = (int(math.log2(max(1, size))) for size in self.cliff_from)
        if micro_batch_size >= 2 ** rng.randint(low, high):
            time *= rng.uniform(*self.cliff)
        if self.tail_share and rng.random() < self.tail_share:  # drawn after the others
            outlier = rng.uniform(*self.tail)
            time *= outlier if rng.random() < 0.5 else 1 / outlier
        return memory, time

    def host_factor(self, seed: int, index: int, model: str, config: TrainConfig) -> float:
        if not self._applies(config) or self.host == (1.0, 1.0):
            return 1.0
        return _draw("host", seed, index, model, self._group(config, host=True)).uniform(*self.host)


@dataclass(frozen=True, kw_only=True)
class SimulatedDevice(AnsweredDevice):
    """A GPU model answered by the estimator (fake hardware: named as such in every result)."""

    gpu: GpuSpec
    seed: int = 0
    """Seed of the timing noise; one seed gives the same measurements for the same probe."""
    noise: float = 0.02
    """Relative standard deviation of simulated step times (0 for exact predictions)."""
    gpus_per_node: int = 8
    reserve: int = DEVICE_RESERVE_BYTES
    """Device bytes tensors cannot use (CUDA context, allocator); see the planner."""
    errors: tuple[ErrorTerm, ...] = ()
    """How this simulated GPU disagrees with the estimator: each term a seeded factor on peak
    memory, step time or host memory, shared by the configurations its ``by`` groups together
    (none: the estimator's predictions are the truth). Which structure a run uses is the
    caller's choice (bench/search-sets.json holds the benchmark's)."""
    host_memory_bytes: int | None = None
    """Host memory of the simulated node (None: not limited)."""
    host_cores: int | None = None
    """CPU cores of the simulated node, which host Adam under offload runs on (None: 16 per
    GPU, the estimator's default)."""

    @classmethod
    def named(cls, gpu: str, **kwargs: Any) -> SimulatedDevice:
        """A simulated device for a catalogue key, alias or GPU file (``h100-80gb``)."""
        return cls(gpu=gpu_spec(gpu), **kwargs)

    @property
    def kind(self) -> str:
        return "simulated"

    @property
    def label(self) -> str:
        return f"simulated:{self.gpu.key}"

    def capacity(self, spec: ProbeSpec) -> int:
        """Usable bytes per rank: the emulated cap when the spec sets one, else the GPU's."""
        if spec.device_memory_bytes is not None:
            return spec.device_memory_bytes
        return usable_bytes(self.gpu, reserve=self.reserve)

    def _jitter(self, spec: ProbeSpec, mbs: int) -> float:
        point = [self.seed, spec.model, _fields(spec.config, knobs=True), mbs, spec.seq_len]
        # A probe with another seed (a re-measurement) draws its own noise.
        rng = _draw(*point, spec.seed) if spec.seed else _draw(*point)
        return max(0.5, rng.gauss(1.0, self.noise)) if self.noise else 1.0

    def bias(self, model: str, config: TrainConfig, micro_batch_size: int) -> tuple[float, float]:
        """The (peak memory, step time) factors this device applies to ``config``'s estimate at
        ``micro_batch_size``: the product of its error terms'."""
        memory = time = 1.0
        for index, term in enumerate(self.errors):
            m, t = term.factors(self.seed, index, model, config, micro_batch_size)
            memory, time = memory * m, time * t
        if any(getattr(config, name) != off for name, off in KNOB_OFF.items()):
            rng = _draw("knob", self.seed, model, sorted(_fields(config, knobs=True).items()))
            memory *= rng.uniform(*KNOB_ERROR[0])
            time *= rng.uniform(*KNOB_ERROR[1])
        return memory, time

    def host_factor(self, model: str, config: TrainConfig) -> float:
        """The factor this device applies to ``config``'s predicted host memory."""
        factor = 1.0
        for index, term in enumerate(self.errors):
            factor *= term.host_factor(self.seed, index, model, config)
        return factor

    def launch(
        self,
        spec: ProbeSpec,
        probe_dir: Path,
        *,
        on_poll: Callable[[float], None] | None = None,
    ) -> ProbeResult:
        """Answer one probe from the estimator (the :class:`Device` contract); it returns at
        once, so ``on_poll`` is called once."""
        if on_poll is not None:
            on_poll(0.0)
        probe_dir.mkdir(parents=True, exist_ok=True)
        (probe_dir / "config.json").write_text(json.dumps(spec.to_dict(), indent=2))
        model = resolve_model(spec.model)
        capacity = self.capacity(spec)
        peak_flops = self.gpu.peak(spec.config.precision.compute_dtype)
        killed = self._host_oom(model, spec, probe_dir)
        if killed is not None:
            killed.write()
            return killed
        sizes: list[SizeResult] = []
        stepped: list[float | None] = []  # each size's step time, None for an OOM
        failed: int | None = None
        outcome, stage, message = Outcome.OK, None, ""
        for mbs in spec.micro_batch_sizes:
            if failed is not None and oom_rules_out(failed, mbs, spec.accumulation):
                continue  # as the worker: a larger size cannot fit either
            memory = estimate_rank_memory(
                model,
                spec.config,
                micro_batch_size=mbs,
                seq_len=spec.seq_len,
                world_size=spec.world_size,
                cuda_allocator=caching_allocator(self.gpu),
                grad_accum=spec.accumulation(mbs),
            )
            memory_factor, time_factor = self.bias(spec.model, spec.config, mbs)
            # Reserved: the live tensors and the allocator's unusable blocks (what must fit).
            peak = int(memory.device_bytes * memory_factor)
            reading: dict[str, Any] = {
                "peak_allocated_bytes": int(memory.peak_bytes * memory_factor),
                "peak_reserved_bytes": peak,
                "alloc_retries": 0,
                "memory_source": "simulated",
                "emulated_limit_bytes": spec.device_memory_bytes,
                "simulated": True,
            }
            if peak > capacity:
                failed = mbs
                outcome = Outcome.OOM
                stage = Stage.FORWARD if memory.phase == "loss" else Stage(memory.phase)
                message = (
                    f"simulated out of memory: peak {format_bytes(peak)} at the "
                    f"{memory.phase} exceeds {format_bytes(capacity)} usable"
                )
                sizes.append(
                    SizeResult(
                        micro_batch_size=mbs,
                        outcome=Outcome.OOM,
                        stage=stage,
                        message=message,
                        ooms=1,
                        **reading,
                    )
                )
                stepped.append(None)
                if spec.world_size > 1:
                    break  # a multi-rank probe stops at its first OOM, as the real one
                continue
            step = predict_rank_time(
                model,
                spec.config,
                self.gpu,
                micro_batch_size=mbs,
                seq_len=spec.seq_len,
                grad_accum=spec.grad_accum,
                world_size=spec.world_size,
                gpus_per_node=self.gpus_per_node,
                host_cores=self.host_cores,
            )
            jitter = self._jitter(spec, mbs) * time_factor
            speed = probe_throughput(
                spec,
                model,
                mbs,
                micro_step_s=step.micro_step_s * jitter,
                optimizer_step_s=step.optimizer_step_s * jitter,
                peak_flops=peak_flops,
            )
            timed = speed.step_s * spec.timed_steps
            stepped.append(speed.step_s)
            sizes.append(
                SizeResult(
                    micro_batch_size=mbs,
                    outcome=Outcome.OK,
                    loss_finite=True,
                    warmup_s=speed.step_s * spec.warmup_steps,
                    timed_s=timed,
                    ooms=0,
                    **speed.to_dict(),
                    **reading,
                )
            )
        build_s = build_seconds(
            model,
            spec.config,
            world_size=spec.world_size,
            ranks_per_node=min(spec.num_processes, self.gpus_per_node),
        )
        wall = probe_seconds(
            build_s=build_s, step_seconds=stepped, steps=spec.warmup_steps + spec.timed_steps
        )
        result = ProbeResult(
            spec=spec,
            probe_dir=probe_dir,
            outcome=outcome if failed is not None else Outcome.OK,
            stage=stage,
            message=message,
            failed_rank=0 if failed is not None else None,
            sizes=sizes,
            wall_s=wall,
            import_s=START_S,
            build_s=build_s,
            device=self.label,
            gpu_name=f"{self.gpu.name} (simulated)",
            peak_flops=peak_flops,
            num_params=model.num_params,
        )
        result.write()
        return result

    def _host_oom(self, model: ModelSpec, spec: ProbeSpec, probe_dir: Path) -> ProbeResult | None:
        """The probe killed by the host's OOM killer while building its states, if it would
        be (the states are built before the first step, so no size runs)."""
        if self.host_memory_bytes is None:
            return None
        host = estimate_host(
            model,
            spec.config,
            world_size=spec.world_size,
            ranks_per_node=min(spec.num_processes, self.gpus_per_node),
        )
        needed = int(host.node_bytes * self.host_factor(spec.model, spec.config))
        limit = usable_host_bytes(self.host_memory_bytes)
        if needed <= limit:
            return None
        # Killed once the node's memory is spent: the states built until then.
        build_s = limit / HOST_BUILD_BYTES_PER_S
        return ProbeResult(
            spec=spec,
            probe_dir=probe_dir,
            outcome=Outcome.HOST_OOM,
            stage=Stage.BUILD,
            message=(
                f"simulated host out of memory: the node's ranks need {format_bytes(needed)} "
                f"of {format_bytes(limit)} usable host memory"
            ),
            failed_rank=0,
            sizes=[],
            wall_s=probe_seconds(build_s=build_s, step_seconds=(), steps=0),
            import_s=START_S,
            build_s=build_s,
            device=self.label,
            gpu_name=f"{self.gpu.name} (simulated)",
            num_params=model.num_params,
        )
