"""One training step of a real model shape under fake tensors: the peak device memory of a rank.

The trace is the ground truth the analytic memory model is checked against. It builds the model
through the probe's own engine code (:func:`autotune.probe.engines.build_trainee`), runs one
warm-up step and then one traced step of forward, backward and optimizer, all under
:class:`~torch._subclasses.fake_tensor.FakeTensorMode`: tensors have shapes, dtypes and storages
of the right size, but no memory behind them, so a 7B model traces on a CPU in seconds. torch's
:class:`~torch.distributed._tools.mem_tracker.MemTracker` (``FSDPMemTracker`` for FSDP2, with a
fake process group of ``world_size`` ranks) counts the live storages of the traced rank after
every operation and sorts them into parameters, gradients, optimizer state, activations and the
rest.

What is traced is what a probe runs on its device, with three differences, each confined to the
trace:

- The model is built directly under fake tensors instead of on the meta device and then
  materialized (meta parameters cannot be turned into fake ones in place); its tensors are the
  same, only their values are not computed.
- transformers treats fake tensors as a sign of graph tracing and then refuses to read the
  position ids to rule out packed sequences, which makes it materialize a full causal mask and
  hand it to SDPA. The probe's batches are never packed (one sequence per row, positions
  ``0..T-1``), so inside the trace that check answers "not packed", as it does in a real step:
  SDPA runs with ``is_causal`` and no mask.
- Everything lives on the CPU and autocast is CPU autocast (a CUDA device cannot be faked on a
  CPU build). The CPU's autocast and SDPA kernels keep the same tensors as CUDA's for the
  supported models; allocator rounding and fragmentation are not modelled.

Deep models are not traced at full depth. The memory at any moment of a step is linear in the
number of decoder blocks before and after the block that is running, so each region of the step
(before the blocks, the first few blocks, the last few blocks, the optimizer step) has a peak
that is exactly linear in the depth. Two shallow copies of the model, whose depths differ by one
activation-checkpointing period, give every region's slope; each is extrapolated to the real
depth and the largest wins (:func:`trace_peak`).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._pytree import tree_flatten

from autotune.config import Engine, Offload, TrainConfig
from autotune.models import ModelSpec, resolve_model
from autotune.probe import modeling
from autotune.probe.data import synthetic_batch
from autotune.probe.engines import EngineContext, build_trainee
from autotune.probe.engines.base import TorchTrainee

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["CATEGORIES", "TRACEABLE_ENGINES", "TracedPeak", "trace_peak"]

CATEGORIES: tuple[str, ...] = ("parameters", "gradients", "optimizer", "activations", "other")
"""The categories of :attr:`TracedPeak.by_category`, which sum to the peak."""

TRACEABLE_ENGINES: tuple[Engine, ...] = (Engine.SINGLE, Engine.FSDP)
"""Engines :func:`trace_peak` can run under fake tensors."""

# The trackers' own labels (MemTracker's and FSDPMemTracker's reference types) by category.
# "Temp" is what the backward allocates besides gradients (gradients of activations and the
# like); all-gather and reduce-scatter buffers are FSDP2's communication temporaries.
_CATEGORY_OF: dict[str, str] = {
    "Parameter": "parameters",
    "Sharded Param": "parameters",
    "Unsharded Param": "parameters",
    "Gradient": "gradients",
    "Sharded Grad": "gradients",
    "Unsharded Grad": "gradients",
    "Optstate": "optimizer",
    "OptState": "optimizer",
    "Activation": "activations",
    "Buffer": "other",
    "Temp": "other",
    "Other": "other",
    "All Gather": "other",
    "Reduce Scatter": "other",
    "Inputs": "other",
}
_TOTAL = "Total"

# How many neighbouring blocks a block's own memory depends on: FSDP2 prefetches the next
# block's parameters during a block's backward, and a block receives its output gradient from
# the one after it. The blocks at both ends of the stack lack such neighbours, so the traced
# copies keep this many blocks beyond one checkpointing period at each end.
_NEIGHBOR_REACH = 1

# The probe's defaults (ProbeSpec): memory does not depend on them.
_LR = 1e-4
_SEED = 0

_Snapshot = dict[str, int]
"""Live bytes by tracker label, plus ``"Total"``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TracedPeak:
    """The peak live device memory of one rank over a steady-state training step."""

    model: str
    """Name of the model spec."""
    config: TrainConfig
    """The traced configuration."""
    micro_batch_size: int
    """Sequences per rank per micro-step."""
    seq_len: int
    """Tokens per sequence."""
    world_size: int
    """Ranks of the (fake) process group; 1 for the single engine."""
    grad_accum: int
    """Micro-steps per optimizer step."""
    num_layers: int
    """Decoder blocks of the model the numbers are for."""
    peak_bytes: int
    """Peak live bytes of one rank over one step after a warm-up step (forward, backward and
    optimizer step, gradients of the previous step already freed)."""
    by_category: dict[str, int]
    """The live bytes at the peak moment by :data:`CATEGORIES`; they sum to ``peak_bytes``."""
    detail: dict[str, int]
    """The live bytes at the peak moment by the memory tracker's own labels (``Temp``,
    ``Buffer``, ``Unsharded Param``, ``All Gather``...)."""
    peak_at: str
    """Where in the step the peak falls, e.g. ``backward, decoder block 31 of 32``."""
    state_bytes: int
    """Live bytes between steps: parameters, optimizer state, buffers and the batch."""
    traced_layers: tuple[int, ...]
    """Depths actually traced: one (exact) or two (linearly extrapolated to ``num_layers``)."""
    wall_s: float
    """Seconds the trace took."""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (the configuration as :meth:`TrainConfig.to_dict`)."""
        return {
            "model": self.model,
            "config": self.config.to_dict(),
            "micro_batch_size": self.micro_batch_size,
            "seq_len": self.seq_len,
            "world_size": self.world_size,
            "grad_accum": self.grad_accum,
            "num_layers": self.num_layers,
            "peak_bytes": self.peak_bytes,
            "by_category": dict(self.by_category),
            "detail": dict(self.detail),
            "peak_at": self.peak_at,
            "state_bytes": self.state_bytes,
            "traced_layers": list(self.traced_layers),
            "wall_s": self.wall_s,
        }


def trace_peak(
    model: ModelSpec | str,
    config: TrainConfig,
    *,
    micro_batch_size: int,
    seq_len: int,
    world_size: int = 1,
    layers: int | None = None,
    grad_accum: int = 1,
) -> TracedPeak:
    """Trace one steady-state training step of ``model`` under fake tensors.

    Args:
        model: A :class:`ModelSpec` or a name for :func:`resolve_model`.
        config: The configuration; its engine must be in :data:`TRACEABLE_ENGINES`, without
            offload.
        micro_batch_size: Sequences per rank per micro-step.
        seq_len: Tokens per sequence.
        world_size: Ranks of the fake process group (FSDP); must be 1 for the single engine.
        layers: Trace exactly this many decoder blocks. None: the model's real depth, traced
            at full depth when it is shallow, else extrapolated from two shallow copies whose
            depths differ by one checkpointing period and match the real depth modulo it.
        grad_accum: Micro-steps per optimizer step (later micro-steps hold the gradients of the
            earlier ones through their forward).

    Returns:
        The peak, its breakdown and the state between steps of the traced rank.

    Raises:
        ValueError: For an engine that cannot be traced (ddp, deepspeed), offload, or sizes
            that are not positive.
        RuntimeError: When a torch.distributed process group is already initialized in this
            process (the trace needs its own fake one).
    """
    started = time.perf_counter()
    spec = resolve_model(model) if isinstance(model, str) else model
    _check_traceable(config, world_size=world_size)
    for name, value in (
        ("micro_batch_size", micro_batch_size),
        ("seq_len", seq_len),
        ("grad_accum", grad_accum),
    ):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, not {value}")
    if layers is not None and layers < 1:
        raise ValueError(f"layers must be at least 1, not {layers}")
    if seq_len > spec.max_position_embeddings:
        raise ValueError(
            f"seq_len {seq_len} exceeds the {spec.max_position_embeddings} positions of {spec.name}"
        )

    depths = _depths(spec.num_layers, config.ac_every, layers)
    window = max(config.ac_every, 1) + _NEIGHBOR_REACH
    traces = [
        _trace_once(
            spec.with_layers(depth),
            config,
            micro_batch_size=micro_batch_size,
            seq_len=seq_len,
            world_size=world_size,
            grad_accum=grad_accum,
            window=window,
        )
        for depth in depths
    ]
    target = depths[0] if layers is not None else spec.num_layers
    if len(traces) == 1:
        region, peak = traces[0].highest()
        state = traces[0].state
    else:
        region, peak, state = _extrapolate(traces[0], traces[1], target)
    by_category = dict.fromkeys(CATEGORIES, 0)
    for label, nbytes in peak.items():
        if label != _TOTAL:
            by_category[_CATEGORY_OF.get(label, "other")] += nbytes
    return TracedPeak(
        model=spec.name,
        config=config,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        world_size=world_size,
        grad_accum=grad_accum,
        num_layers=target,
        peak_bytes=peak[_TOTAL],
        by_category=by_category,
        detail={label: n for label, n in peak.items() if label != _TOTAL},
        peak_at=region.describe(target, grad_accum),
        state_bytes=state[_TOTAL],
        traced_layers=tuple(depths),
        wall_s=time.perf_counter() - started,
    )


def _check_traceable(config: TrainConfig, *, world_size: int) -> None:
    """Reject what cannot be traced under fake tensors, saying why and what can."""
    engines = ", ".join(e.value for e in TRACEABLE_ENGINES)
    if config.engine is Engine.DEEPSPEED:
        raise ValueError(
            "deepspeed cannot be traced under fake tensors (its engine allocates and reads its "
            f"flat buffers outside torch's dispatch): traceable engines are {engines}"
        )
    if config.engine is Engine.DDP:
        raise ValueError(
            "ddp cannot be traced under fake tensors (DistributedDataParallel reads parameter "
            "data to verify them across ranks): trace engine single, whose step is DDP's less "
            f"the gradient buckets (a second copy of the gradients); traceable engines are "
            f"{engines}"
        )
    if config.offload is not Offload.NONE:
        raise ValueError(
            f"offload {config.offload.value} cannot be traced: the trace counts one device's "
            "memory and has no host side"
        )
    if config.torch_compile:
        raise ValueError(
            "compiled blocks cannot be traced: torch.compile does not trace under the trace's "
            "fake tensors; probe it on the CPU (autotune probe --device cpu --compile), whose "
            "tensor counter runs the partitioned graphs"
        )
    if config.act_offload:
        raise ValueError(
            "activation offload cannot be traced: the trace counts one device's memory and has "
            "no host side; probe it on the CPU (autotune probe --device cpu --act-offload), "
            "whose tensor counter and emulated host pool check the estimator's terms"
        )
    if config.is_lora:
        raise ValueError(
            "LoRA cannot be traced: peft moves its adapters to the base layer's device with "
            "module.to(), which fake parameters refuse; probe it on the CPU (autotune probe "
            "--device cpu --lora-rank R), whose tensor counter checks the estimator's LoRA terms"
        )
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, not {world_size}")
    if config.engine is Engine.SINGLE and world_size != 1:
        raise ValueError(f"engine single runs one process, not {world_size}")


def _depths(num_layers: int, ac_every: int, layers: int | None) -> tuple[int, ...]:
    """The depths to trace: ``(layers,)``, the full depth, or two shallow copies.

    Regions are told apart by their distance from either end of the block stack, counted in
    blocks up to ``period + _NEIGHBOR_REACH``; the shallower copy has exactly two such windows,
    and both copies are congruent to the real depth modulo the checkpointing period, so every
    region of the real model is a region of both copies.
    """
    if layers is not None:
        return (layers,)
    period = max(ac_every, 1)
    window = period + _NEIGHBOR_REACH
    first = 2 * window + (num_layers - 2 * window) % period
    second = first + period
    if second >= num_layers:
        return (num_layers,)
    return (first, second)


@dataclass(frozen=True, slots=True, order=True)
class _Region:
    """A stretch of a step whose memory is linear in the depth.

    ``anchor`` is ``pre`` before the first decoder block of a phase (the whole optimizer step
    is one ``pre`` region), ``start`` / ``end`` for the block ``index`` blocks from the first /
    last one, and ``middle`` for the blocks in between. A block's region lasts until the next
    block begins, so the final norm, head and loss belong to the last block's forward region
    and the embedding's backward to the first block's backward region.
    """

    micro: int
    phase: str
    anchor: str
    index: int = 0

    def describe(self, num_layers: int, grad_accum: int) -> str:
        """Human-readable place in a step of a ``num_layers``-deep model."""
        prefix = f"micro-step {self.micro + 1} of {grad_accum}, " if grad_accum > 1 else ""
        if self.phase == "optimizer":
            return f"{prefix}optimizer step"
        if self.anchor == "pre":
            where = (
                "embeddings, before the first decoder block"
                if self.phase == "forward"
                else "loss and head, before the last decoder block"
            )
        elif self.anchor == "middle":
            where = "a middle decoder block"
        else:
            block = self.index if self.anchor == "start" else num_layers - 1 - self.index
            where = f"decoder block {block} of {num_layers}"
        return f"{prefix}{self.phase}, {where}"


@dataclass(frozen=True, kw_only=True, slots=True)
class _Trace:
    """The outcome of tracing one depth."""

    layers: int
    state: _Snapshot
    peaks: dict[_Region, _Snapshot]

    def highest(self) -> tuple[_Region, _Snapshot]:
        region = max(self.peaks, key=lambda r: (self.peaks[r][_TOTAL], r))
        return region, self.peaks[region]


def _extrapolate(
    shallow: _Trace, deep: _Trace, target: int
) -> tuple[_Region, _Snapshot, _Snapshot]:
    """Every region's peak and the state, extended linearly to ``target`` blocks."""
    period = deep.layers - shallow.layers
    steps = (target - shallow.layers) // period
    if shallow.layers + steps * period != target:
        raise AssertionError(f"depth {target} is not {shallow.layers} plus whole periods")

    def extend(a: _Snapshot, b: _Snapshot) -> _Snapshot:
        return {k: a.get(k, 0) + steps * (b.get(k, 0) - a.get(k, 0)) for k in a.keys() | b.keys()}

    best: tuple[_Region, _Snapshot] | None = None
    for region in sorted(shallow.peaks.keys() & deep.peaks.keys()):
        if region.anchor == "middle":
            continue
        peak = extend(shallow.peaks[region], deep.peaks[region])
        if best is None or peak[_TOTAL] > best[1][_TOTAL]:
            best = region, peak
    if best is None:
        raise AssertionError("the two traces share no region")
    return best[0], best[1], extend(shallow.state, deep.state)


def _flatten(snapshot: dict[torch.device, dict[Any, int]]) -> _Snapshot:
    """A tracker snapshot summed over devices, keyed by plain label strings."""
    flat: _Snapshot = {_TOTAL: 0}
    for per_device in snapshot.values():
        for key, nbytes in per_device.items():
            label = str(getattr(key, "value", key))
            flat[label] = flat.get(label, 0) + nbytes
    return flat


class _RegionRecorder:
    """Peak live bytes per :class:`_Region`, fed by a tracker after every operation.

    Hooks on the decoder blocks say which block runs: a forward pre-hook in the forward, and in
    the backward a hook on the block's output, which fires when the block's backward begins.
    """

    def __init__(self, blocks: nn.ModuleList, window: int) -> None:
        self._blocks = blocks
        self._window = window
        self._micro = 0
        self._phase = "forward"
        self._block: int | None = None
        self.peaks: dict[_Region, _Snapshot] = {}

    def begin(self, phase: str, micro: int) -> None:
        """Mark the start of a phase (forward, backward, optimizer) of micro-step ``micro``."""
        self._phase, self._micro, self._block = phase, micro, None

    @contextlib.contextmanager
    def hooked(self) -> Iterator[None]:
        """Hooks on the blocks for the duration of the traced step."""
        handles = []
        for index, block in enumerate(self._blocks):
            handles.append(block.register_forward_pre_hook(functools.partial(self._enter, index)))
            handles.append(block.register_forward_hook(functools.partial(self._leave, index)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def record(self, live: dict[torch.device, dict[Any, int]]) -> None:
        """Keep ``live`` (a tracker's current bytes per device) if it is its region's peak."""
        total = sum(per_device[_TOTAL] for per_device in live.values())
        region = self._region()
        best = self.peaks.get(region)
        if best is None or total > best[_TOTAL]:
            self.peaks[region] = _flatten(live)

    def _enter(self, index: int, module: nn.Module, args: Any) -> None:
        if self._phase == "forward":
            self._block = index

    def _leave(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        if self._phase != "forward":
            return  # a checkpointed block recomputed in the backward
        for leaf in tree_flatten(output)[0]:
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(functools.partial(self._enter_backward, index))
                return

    def _enter_backward(self, index: int, grad: torch.Tensor) -> None:
        self._block = index

    def _region(self) -> _Region:
        if self._block is None:
            return _Region(self._micro, self._phase, "pre")
        last = len(self._blocks) - 1
        if self._block < self._window:
            return _Region(self._micro, self._phase, "start", self._block)
        if last - self._block < self._window:
            return _Region(self._micro, self._phase, "end", last - self._block)
        return _Region(self._micro, self._phase, "middle")


def _record_regions(self: _RegionMemTracker | _RegionFSDPMemTracker, peak_state: Any) -> None:
    # Replaces the trackers' per-operation update of their global and per-module peak
    # snapshots (unused here, and linear in the number of modules per operation).
    if self.recorder is not None:
        self.recorder.record(self._curr_mem_snap)


class _RegionMemTracker(MemTracker):
    """MemTracker that reports its live bytes after every operation to a recorder."""

    recorder: _RegionRecorder | None = None
    _update_peak_stats = _record_regions


class _RegionFSDPMemTracker(FSDPMemTracker):
    """FSDPMemTracker that reports its live bytes after every operation to a recorder."""

    recorder: _RegionRecorder | None = None
    _update_peak_stats = _record_regions


def _trace_once(
    spec: ModelSpec,
    config: TrainConfig,
    *,
    micro_batch_size: int,
    seq_len: int,
    world_size: int,
    grad_accum: int,
    window: int,
) -> _Trace:
    """Build, warm up and trace one step of ``spec`` at its own depth."""
    ctx = EngineContext(
        model=spec,
        config=config,
        device=torch.device("cpu"),
        rank=0,
        world_size=world_size,
        micro_batch_size=micro_batch_size,
        grad_accum=grad_accum,
        lr=_LR,
        seed=_SEED,
    )
    with contextlib.ExitStack() as stack:
        mesh = (
            stack.enter_context(_fake_process_group(world_size)) if config.is_distributed else None
        )
        stack.enter_context(FakeTensorMode())
        stack.enter_context(_fake_engine_build(config.engine, mesh))
        stack.enter_context(_unpacked_positions())
        trainee = build_trainee(ctx)
        if not isinstance(trainee, TorchTrainee):
            raise AssertionError(f"engine {config.engine.value} built a {type(trainee)}")
        batch = synthetic_batch(spec, micro_batch_size, seq_len, seed=_SEED)
        # The first step creates the optimizer's state lazily; the traced step is the next one.
        _step(trainee, batch, grad_accum)
        recorder = _RegionRecorder(modeling.decoder_blocks(trainee.model), window)
        tracker = _tracker(trainee, batch, config, recorder)
        with tracker:
            state = _flatten(tracker.get_tracker_snapshot())
            with recorder.hooked():
                _step(trainee, batch, grad_accum, recorder=recorder, tracker=tracker)
    if not recorder.peaks:
        raise RuntimeError(
            "the memory tracker reported no operation: this torch's MemTracker is not the one "
            "the trace was written for (torch 2.11-2.14)"
        )
    return _Trace(layers=spec.num_layers, state=state, peaks=recorder.peaks)


def _step(
    trainee: TorchTrainee,
    batch: torch.Tensor,
    grad_accum: int,
    *,
    recorder: _RegionRecorder | None = None,
    tracker: MemTracker | None = None,
) -> None:
    """One optimizer step, as the probe's step loop runs it."""
    loss = None
    for micro in range(grad_accum):
        sync = micro == grad_accum - 1
        if tracker is not None and micro:
            # The tracker refuses a second forward of the root module without this.
            tracker.reset_mod_stats()
        if recorder is not None:
            recorder.begin("forward", micro)
        loss = trainee.forward(batch, sync=sync)
        if recorder is not None:
            recorder.begin("backward", micro)
        trainee.backward(loss, sync=sync)
    if recorder is not None:
        recorder.begin("optimizer", grad_accum - 1)
    trainee.optimizer_step()
    del loss


def _tracker(
    trainee: TorchTrainee, batch: torch.Tensor, config: TrainConfig, recorder: _RegionRecorder
) -> MemTracker:
    """A memory tracker that knows the state built before it was entered."""
    tracker: _RegionMemTracker | _RegionFSDPMemTracker
    if config.engine is Engine.FSDP:
        tracker = _RegionFSDPMemTracker(trainee.model, trainee.optimizer)
        tracker.track_inputs((batch,))
    else:
        tracker = _RegionMemTracker()
        # fp16's loss scaler keeps its scale and growth counter as tensors between steps.
        scaler_state = (
            [v for v in vars(trainee.scaler).values() if isinstance(v, torch.Tensor)]
            if trainee.scaler is not None
            else []
        )
        tracker.track_external(trainee.model, trainee.optimizer, batch, *scaler_state)
    tracker.recorder = recorder
    return tracker


@contextlib.contextmanager
def _fake_process_group(world_size: int) -> Iterator[DeviceMesh]:
    """A fake process group of ``world_size`` ranks (this one is rank 0) and its CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "a torch.distributed process group is already initialized in this process: "
            "trace in a process without one"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        # Made here, outside fake mode: a device mesh reads its rank layout back as numbers,
        # which a fake tensor cannot give (FSDP2 would otherwise make one inside the build).
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


def _build_under_fake(
    spec: ModelSpec, config: TrainConfig, *, meta: bool = True, checkpointing: bool = True
) -> nn.Module:
    """The probe's model built straight into fake tensors (see the module docstring)."""
    if active_fake_mode() is None:
        raise RuntimeError("the traced build runs under FakeTensorMode only")
    model = modeling.build_model(spec, config, meta=False, checkpointing=checkpointing)
    # Module.to swaps fake parameters in place, which torch refuses for tensors with weak
    # references, and fake parameters always have one: the engines' model.to(dtype) goes here.
    setattr(model, "to", functools.partial(_to_dtype_under_fake, model))  # noqa: B010
    return model


def _to_dtype_under_fake(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model.to(dtype)`` for a fake model: floating-point parameters and buffers converted.

    Parameters are replaced by new ones of the new dtype; a parameter shared by several modules
    (a tied head) stays shared.
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"the traced model converts to a dtype only, not {dtype!r}")
    converted: dict[int, torch.Tensor] = {}

    def convert(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in converted:
            new = tensor.to(dtype)
            if isinstance(tensor, nn.Parameter):
                new = nn.Parameter(new, requires_grad=tensor.requires_grad)
            converted[id(tensor)] = new
        return converted[id(tensor)]

    with torch.no_grad():
        for module in model.modules():
            for tensors in (module._parameters, module._buffers):
                for name, tensor in tensors.items():
                    if tensor is not None and tensor.is_floating_point():
                        tensors[name] = convert(tensor)  # type: ignore[assignment]
    return model


def _materialize_under_fake(model: nn.Module, device: torch.device, *, seed: int) -> None:
    """What materializing leaves to do for a model built under fake tensors: tie its weights."""
    tie_weights = getattr(model, "tie_weights", None)
    if callable(tie_weights):
        tie_weights()


@contextlib.contextmanager
def _fake_engine_build(engine: Engine, mesh: DeviceMesh | None) -> Iterator[None]:
    """Let the engine's own build function run under fake tensors."""
    from autotune.probe.engines import ddp as ddp_engine
    from autotune.probe.engines import fsdp as fsdp_engine

    module = fsdp_engine if engine is Engine.FSDP else ddp_engine
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(module, "build_model", _build_under_fake))
        stack.enter_context(mock.patch.object(module, "materialize", _materialize_under_fake))
        if engine is Engine.FSDP:
            assert mesh is not None
            shard = functools.partial(fsdp_engine.fully_shard, mesh=mesh)
            stack.enter_context(mock.patch.object(fsdp_engine, "fully_shard", shard))
        yield


@contextlib.contextmanager
def _unpacked_positions() -> Iterator[None]:
    """Tell transformers' mask code that fake position ids hold no packed sequences."""
    from transformers import masking_utils

    original: Callable[[torch.Tensor], torch.Tensor | None] | None = getattr(
        masking_utils, "find_packed_sequence_indices", None
    )
    if original is None:  # transformers without packed-sequence detection
        yield
        return

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
        if isinstance(position_ids, FakeTensor):
            return None
        return original(position_ids)

    with mock.patch.object(
        masking_utils, "find_packed_sequence_indices", find_packed_sequence_indices
    ):
        yield
