"""``run``: prepare a search (the device, the study, the checks), run it, and run job files."""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.api._script import user_script_job, user_script_model
from autotune.config import (
    DEVICES,
    Attention,
    ConfigError,
    Engine,
    Knobs,
    Loss,
    NothingFits,
    Optimizer,
    Precision,
    Schedule,
    TrainConfig,
    parse_choice,
    parse_losses,
    parse_optimizers,
)
from autotune.devices import Device, LocalDevice, ReplayDevice, SimulatedDevice
from autotune.estimator.plan import DEVICE_RESERVE_BYTES, PlanRow, point_estimates, usable_bytes
from autotune.estimator.plan import plan as plan_rows
from autotune.hardware import GpuSpec, cpu_device_spec, detect_gpus, host_memory_bytes
from autotune.jobs import JobResult
from autotune.layouts import LayoutOptions, check_layout, layout_engine_refusal, layout_flags
from autotune.models import ModelSpec, resolve_model
from autotune.probe.nodes import Nodes
from autotune.probe.spec import ProbeTemplate, layout_refusal
from autotune.space import Workload
from autotune.study.fingerprint import DEFAULT_STORAGE, Fingerprint, Objective, software_versions
from autotune.study.measurement import measured_workload
from autotune.tuned.script import FRAMEWORK_ENGINES, Framework, ScriptJob, check_engines
from autotune.units import format_bytes
from autotune.values import (
    api_arguments,
    check_attention,
    check_trials_dir,
    count_value,
    fraction_value,
    knobs_for,
    nodes_for,
    objective_value,
    per_node_count,
    positive_seconds,
    size_bytes,
    target_gpu,
    workload_for,
)

if TYPE_CHECKING:
    from autotune.jobs import Freshness, Job
    from autotune.search.controller import Controller, Event, RunSummary
    from autotune.study.store import TrialStore


@dataclass(frozen=True, kw_only=True)
class Tuning:
    """A tuning run, assembled: the study, the predictions, the device and the budget."""

    model: ModelSpec
    gpu: GpuSpec
    """The GPU the estimator plans for (on the CPU: a stand-in with the emulated cap)."""
    device: Device
    store: TrialStore
    rows: list[PlanRow]
    template: ProbeTemplate
    budget_s: float
    trials_dir: Path
    storage: str
    """The storage URL, as given."""
    replan: Callable[[Workload], list[PlanRow]] | None = None
    """The planner's predictions for another workload (a user's job, once its probes have
    measured it otherwise than assumed: ``measured_workload``); None: the rows stand."""
    climbed: str | None = None
    """Why the run searches under a layout no one named (no data-parallel configuration
    fits, and the plan's best layout does); None where it does not."""

    @property
    def fingerprint(self) -> Fingerprint:
        return self.store.fingerprint

    @property
    def workload(self) -> Workload:
        return self.store.workload

    @property
    def capacity_bytes(self) -> int:
        return self.store.capacity_bytes

    def controller(self, on_event: Callable[[Event], None] | None = None) -> Controller:
        """The search loop of this run (a fresh budget clock)."""
        # Imported here: reading a study back (`best`, `trials`) needs no search.
        from autotune.search.controller import Controller

        return Controller(
            store=self.store,
            rows=self.rows,
            device=self.device,
            template=self.template,
            budget_s=self.budget_s,
            trials_dir=self.trials_dir,
            on_event=on_event,
            replan=self.replan,
        )

    def run(self, on_event: Callable[[Event], None] | None = None) -> RunSummary:
        """Search until done, the budget is spent, or Ctrl-C (then: the best so far). The
        device's warm workers stop with the run."""
        try:
            return self.controller(on_event).run()
        finally:
            self.device.close()


def _device(
    device: str | Device,
    simulate: str | None,
    seed: int,
    cap: int | None,
    host: int | None,
    *,
    warm: bool,
    nodes: Nodes | None = None,
    cores: int | None = None,
) -> tuple[Device, GpuSpec, int]:
    """The device that answers probes, the GPU to plan for and the GPUs here (on each node)."""
    if isinstance(device, str) and device not in DEVICES:
        raise ConfigError(f"unknown device {device!r}: use {', '.join(DEVICES)}")
    if simulate is not None:
        simulated = SimulatedDevice.named(
            simulate, seed=seed, host_memory_bytes=host, host_cores=cores
        )
        return simulated, simulated.gpu, 8
    if isinstance(device, SimulatedDevice):
        return device, device.gpu, 8
    if isinstance(device, ReplayDevice):
        return device, device.gpu, device.grid.key.num_processes  # the recordings' CPU or GPU
    if isinstance(device, str):
        if device == "auto":
            if detect_gpus() is None:
                raise ConfigError(
                    "no GPU found: use --device cpu --device-memory 64MiB (real CPU probes) "
                    "or --simulate h100-80gb (the estimator's simulated GPU)"
                )
            device = "cuda"
        device = LocalDevice(device, warm=warm, nodes=nodes)
    if device.kind == "cpu":
        if cap is None:
            raise ConfigError("--device cpu needs --device-memory, e.g. 64MiB, to emulate a GPU")
        return device, cpu_device_spec(cap), 1
    gpu, here = target_gpu(None)
    return device, gpu, here


def _host_for(device: Device, given: int | None) -> int | None:
    """The host memory a run plans for: as given, the simulated or recorded node's, or this
    node's."""
    if isinstance(device, SimulatedDevice | ReplayDevice):
        return device.host_memory_bytes if device.host_memory_bytes is not None else given
    return given if given is not None else host_memory_bytes()


def _cores_for(device: Device, given: int | None) -> int | None:
    """The host cores a run plans for: as given, the simulated node's, or this node's (None
    for a recorded grid: 16 per GPU)."""
    if isinstance(device, SimulatedDevice):
        return device.host_cores
    if isinstance(device, ReplayDevice):
        return given
    return given if given is not None else os.cpu_count()


def prepare(model: str | None, **options: Any) -> Tuning:
    """Assemble a tuning run without starting it (see :func:`tune` for the arguments).

    Opens (or creates) the study, so a bad storage URL fails here.
    """
    tuning = _prepare(model, **options)
    if tuning is None:
        raise AssertionError("only a check_only preparation stops before its tuning")
    return tuning


def _check(model: str | None, **options: Any) -> None:
    """Check a run's options as :func:`prepare` does (every check in its one home), opening,
    creating and starting nothing: the storage is checked by its URL and, for a SQLite file,
    by what the file holds (never created); the trials folder by what is in its way.

    Raises:
        ConfigError: What :func:`prepare` would refuse. Whether anything fits is not asked
            (:class:`~autotune.config.NothingFits` is a run's answer, not bad input).
    """
    _prepare(model, check_only=True, **options)


def _prepare(
    model: str | None,
    *,
    budget: str | float = "30m",
    seq_len: int | None = None,
    global_batch: int | None = None,
    gpus: int | None = None,
    engines: Iterable[Engine] | None = None,
    precision: Precision | str | None = None,
    attention: Attention | str = Attention.SDPA,
    device: str | Device = "auto",
    simulate: str | None = None,
    device_memory: str | int | None = None,
    headroom: str | float = 0.0,
    host_memory: str | int | None = None,
    host_cores: int | None = None,
    objective: Objective | str = Objective.TOKENS,
    storage: str = DEFAULT_STORAGE,
    trials_dir: str | Path = "trials",
    seed: int = 0,
    warmup_steps: int = 2,
    timed_steps: int = 3,
    warm: bool = True,
    nodes: int | None = None,
    hosts: str | Sequence[str] | None = None,
    script: str | Path | None = None,
    framework: str | None = None,
    script_args: Sequence[str] = (),
    batch_flag: str | None = None,
    accum_flag: str | None = None,
    checkpointing_flag: str | None = None,
    losses: str | Iterable[Loss | str] | None = None,
    op_checkpointing: bool = False,
    optimizers: str | Iterable[Optimizer | str] | None = None,
    lora_rank: int | None = None,
    activation_offload: bool = False,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    pp_schedule: Schedule | str | None = None,
    pp_virtual: int = 1,
    check_only: bool = False,
) -> Tuning | None:
    """:func:`prepare`, or with ``check_only`` :func:`_check` (None)."""
    job = user_script_job(
        script,
        framework,
        script_args,
        (batch_flag, accum_flag, checkpointing_flag),
        simulate=simulate,
        device=device,
    )
    asked = (parse_losses(losses), op_checkpointing, parse_optimizers(optimizers))
    # A script's own loss and optimizer, before anything opens.
    knobs_for(job, *asked, "simulated", lora_rank=lora_rank, activation_offload=activation_offload)
    if job is not None:
        model = model or user_script_model(job)
        named_engines = None if engines is None else list(engines)
        engines = _job_engines(job, named_engines)
        if (nodes or 1) > 1 or hosts:
            raise ConfigError("--script runs on one node: leave out --nodes and --hosts")
    if model is None:
        raise ConfigError("give --model: a preset name or the path of a config.json")
    spec = resolve_model(model)
    budget_s = positive_seconds(budget, "the budget")
    cap = size_bytes(device_memory, "--device-memory")
    host = size_bytes(host_memory, "--host-memory")
    cores = count_value(host_cores, "--host-cores")
    layout = nodes_for(nodes, hosts, simulated=simulate is not None or not isinstance(device, str))
    count = layout.count if layout is not None else (nodes or 1)
    if isinstance(device, ReplayDevice) and cap is None:
        cap = device.grid.key.device_memory_bytes  # the cap the grid was recorded under
    chosen, gpu, here = _device(
        device, simulate, seed, cap, host, warm=warm, nodes=layout, cores=cores
    )
    per_node = per_node_count(gpus, count, here)
    world = per_node * count
    fixed = _fixed_layout(tp, pp, cp, pp_schedule, pp_virtual)
    if fixed is not None and job is not None:
        raise ConfigError("--tp, --pp and --cp tune autotune's stand-in: leave out --script")

    def kept(fixed: TrainConfig | None) -> Workload:
        """The workload of a run that keeps ``fixed``'s layout (None: data parallelism)."""
        workload = workload_for(spec, seq_len, global_batch, world, layouts=fixed is not None)
        if fixed is None:
            return workload
        check_layout(fixed, spec, world_size=world, gpus_per_node=per_node,
                     seq_len=workload.seq_len)  # fmt: skip
        engine_refusal = layout_engine_refusal(fixed.tp, fixed.pp, fixed.cp, world, engines)
        if engine_refusal is not None:
            raise ConfigError(engine_refusal)
        refusal = layout_refusal(fixed, world)
        if refusal is not None:  # before a study is made for probes that cannot run
            raise ConfigError(refusal)
        workload = dataclasses.replace(workload, model_parallel=fixed.model_parallel)
        workload.check_splits()
        return workload

    workload = kept(fixed)
    goal = objective_value(objective)
    # Real CPU probes, or their recordings replayed: an emulated device, no host to offload to.
    on_cpu = chosen.kind == "cpu" or (
        isinstance(chosen, ReplayDevice) and chosen.grid.device == "cpu"
    )
    if goal is Objective.MFU and on_cpu:
        raise ConfigError(
            "--objective mfu needs a GPU's peak FLOP/s: use --objective tokens on the CPU"
        )
    _check_ranks(chosen, per_node, here)
    if job is not None and on_cpu and job.framework is Framework.ACCELERATE:
        engines = _accelerate_on_cpu(named_engines, list(engines or ()))
    knobs = knobs_for(
        job,
        *asked,
        "cpu" if on_cpu else chosen.kind,
        lora_rank=lora_rank,
        activation_offload=activation_offload,
    )
    if isinstance(chosen, ReplayDevice):
        knobs = _recorded_knobs(knobs, chosen.grid.knobs)
    if cap is not None and not on_cpu and cap > gpu.memory_bytes:
        raise ConfigError(
            f"--device-memory {format_bytes(cap)} is more than the {gpu.key}'s "
            f"{format_bytes(gpu.memory_bytes)}: leave it out to use the whole card, or cap it lower"
        )
    capacity = cap if cap is not None else usable_bytes(gpu)
    chosen_precision = parse_choice(Precision, precision, "precision")
    chosen_attention = parse_choice(Attention, attention, "attention") or Attention.SDPA
    check_attention(chosen_attention, "cpu" if on_cpu else chosen.kind, chosen_precision)
    share = fraction_value(headroom, "headroom")
    capped_gpu = gpu if cap is None or on_cpu else dataclasses.replace(gpu, memory_bytes=cap)
    reserve = 0 if on_cpu or cap is not None else DEVICE_RESERVE_BYTES

    def laid_out(workload: Workload, layouts: LayoutOptions) -> list[PlanRow]:
        """The plan's rows of the layouts ``layouts`` names (a layout probes no offload)."""
        return plan_rows(
            spec,
            capped_gpu,
            workload,
            engines=engines,
            precision=chosen_precision,
            attention=chosen_attention,
            reserve=reserve,
            gpus_per_node=per_node,
            device="cpu" if on_cpu else "cuda",
            layouts=layouts,
        )

    def planned(workload: Workload) -> list[PlanRow]:
        if fixed is not None:
            return _kept_layout_rows(
                fixed,
                laid_out(workload, LayoutOptions(tp=(fixed.tp,), pp=(fixed.pp,), cp=(fixed.cp,))),
                world,
            )
        return plan_rows(
            spec,
            capped_gpu,  # a cap is what the allocator may hold: the plan's capacity, no reserve
            workload,
            engines=engines,
            precision=chosen_precision,
            attention=chosen_attention,
            reserve=reserve,
            offload=not on_cpu,  # a CPU emulating a device has no host to offload to
            host_memory_bytes=_host_for(chosen, host),
            host_cores=_cores_for(chosen, cores),
            device="cpu" if on_cpu else "cuda",
            gpus_per_node=per_node if count > 1 else 8,  # one node: its links, up to 8 GPUs
            knobs=knobs,
            planned_out=True,  # the search revives a knob whose twin's prediction fails
        )

    rows = planned(workload)
    climbed = None
    if fixed is None and job is None and rows and not any(row.fits for row in rows):
        ranks = f"{world} CPU ranks" if on_cpu else f"{world} x {gpu.key}"
        whole = workload_for(spec, seq_len, global_batch, world, layouts=True)
        top = climb(laid_out(whole, LayoutOptions()), world, f"{spec.name} on {ranks}")
        if top is not None:
            fixed = _fixed_layout(top.tp, top.pp, top.cp, top.pp_schedule, top.pp_virtual)
            workload = kept(fixed)
            rows = planned(workload)
            climbed = (
                f"{_unfit(f'{spec.name} on {ranks}')}: searching under the plan's best layout "
                f"that fits, {_degrees(top)}"
            )
    fingerprint = Fingerprint(
        model=spec.name,
        seq_len=workload.seq_len,
        global_batch=workload.global_batch,
        gpu=gpu.key,
        gpu_memory_bytes=capacity,
        gpus=world,
        device=chosen.kind,
        objective=goal,
        software=_software(chosen.kind),
        capped=cap is not None,
        nodes=count,
        precision=None if chosen_precision is None else chosen_precision.value,
        attention=None if chosen_attention is Attention.SDPA else chosen_attention.value,
        script=None if job is None else job.to_dict(),
        model_parallel=workload.model_parallel,
    )
    if check_only:
        from autotune.study.schema import check_storage

        check_storage(storage)
        check_trials_dir(Path(trials_dir))
        chosen.close()
        return None
    _check_something_fits(rows, spec, world, capacity, on_cpu=on_cpu)
    from autotune.study.store import TrialStore

    store = TrialStore(fingerprint, storage=storage, headroom=share)
    if job is not None:
        # What an earlier run's probes measured of the job (the stand-in trains as asked).
        seen = measured_workload(workload, store.measurements())
        if seen != workload:
            store.workload = workload = seen
            rows = planned(workload)
        if not rows and workload.job_engines is not None:
            raise ConfigError(
                workload.job_engines_unsearched(
                    f"its probes in study {fingerprint.study_name} found"
                )
            )
    store.estimates = point_estimates(rows, workload)
    template = ProbeTemplate(
        model=model,
        seq_len=workload.seq_len,
        num_processes=per_node,
        nodes=count,
        device="cpu" if on_cpu else "cuda",
        device_memory_bytes=cap,
        warmup_steps=warmup_steps,
        timed_steps=timed_steps,
        script=job,
        global_batch=workload.global_batch,
    )
    return Tuning(
        model=spec,
        gpu=gpu,
        device=chosen,
        store=store,
        rows=rows,
        template=template,
        budget_s=budget_s,
        trials_dir=Path(trials_dir),
        storage=storage,
        replan=None if job is None else planned,
        climbed=climbed,
    )


def _fixed_layout(
    tp: int, pp: int, cp: int, schedule: Schedule | str | None, virtual: int
) -> TrainConfig | None:
    """The layout a run keeps (its degrees on a data-parallel configuration, checked as a
    configuration's), or None for data parallelism."""
    degrees = {"--tp": tp, "--pp": pp, "--cp": cp, "--pp-virtual": virtual}
    for option, value in degrees.items():
        count_value(value, option)
    chosen = parse_choice(Schedule, schedule, "pipeline schedule")
    if tp * pp * cp == 1:
        if chosen is not None or virtual > 1:
            raise ConfigError(
                "--pp-schedule and --pp-virtual shape a pipeline: give --pp 2 or more"
            )
        return None
    return TrainConfig(
        engine=Engine.FSDP,
        zero_stage=3,
        tp=tp,
        pp=pp,
        cp=cp,
        pp_schedule=chosen or TrainConfig().pp_schedule,
        pp_virtual=virtual,
    )


def climb(rows: list[PlanRow], world: int, what: str) -> TrainConfig | None:
    """The layout a run climbs to where none of its data-parallel configurations fits: the
    configuration of the first of the plan's ``rows`` (ranked) that is a layout, fits, and a
    probe of ``world`` ranks can run (:func:`autotune.probe.spec.layout_refusal`); the run
    keeps its degrees and schedule and searches the rest. None where no layout fits.

    Raises:
        NothingFits: Layouts fit, but none a probe can run yet (one line: the best and why).
    """
    fitting = [row.config for row in rows if row.config.is_layout and row.fits]
    runnable = [config for config in fitting if layout_refusal(config, world) is None]
    if fitting and not runnable:
        raise NothingFits(
            f"{_unfit(what)}, and the best layout that fits, {_degrees(fitting[0])}, cannot be "
            f"probed yet: {layout_refusal(fitting[0], world)} (autotune plan ranks the layouts)"
        )
    return runnable[0] if runnable else None


def _unfit(what: str) -> str:
    """Why a run climbs, the first words of its line (and of its refusal)."""
    return f"none of the data-parallel configurations this run searches fits {what}"


def _degrees(config: TrainConfig) -> str:
    """A layout's degrees as ``run`` names them (``--tp 2 --pp 2``)."""
    return " ".join(layout_flags(config))


def _kept_layout_rows(fixed: TrainConfig, rows: list[PlanRow], world: int) -> list[PlanRow]:
    """The plan's rows of the layout a run keeps: its degrees, its schedule and virtual stages,
    and what a probe of ``world`` ranks can measure (:func:`autotune.probe.spec.layout_refusal`:
    the simulated GPU answers the probes a real one would run)."""
    return [
        row
        for row in rows
        if (row.config.tp, row.config.pp, row.config.cp) == (fixed.tp, fixed.pp, fixed.cp)
        and (fixed.pp == 1 or (row.config.pp_schedule, row.config.pp_virtual)
             == (fixed.pp_schedule, fixed.pp_virtual))
        and layout_refusal(row.config, world) is None
    ]  # fmt: skip


def _recorded_knobs(asked: Knobs, recorded: Knobs) -> Knobs:
    """The knobs asked for, as far as a replayed grid recorded them: it answers nothing else."""
    return Knobs(
        losses=tuple(x for x in asked.losses if x in recorded.losses) or (Loss.FULL,),
        op_checkpointing=asked.op_checkpointing and recorded.op_checkpointing,
        optimizers=tuple(x for x in asked.optimizers if x in recorded.optimizers)
        or (Optimizer.ADAMW,),
        activation_offload=asked.activation_offload and recorded.activation_offload,
        block_patterns=asked.block_patterns,
        block_checkpointing=asked.block_checkpointing,
    )


def _software(device_kind: str) -> dict[str, str]:
    """The software a study is of: the libraries' versions and, on a GPU, the driver's (a new
    driver is another study)."""
    software = software_versions()
    detected = detect_gpus() if device_kind == "cuda" else None
    if detected is not None and detected.driver:
        software["driver"] = detected.driver
    return software


def _job_engines(job: ScriptJob, engines: Iterable[Engine] | None) -> list[Engine]:
    """The engines a job's adapter can hand its framework, or those asked if it can."""
    if engines is None:
        return list(FRAMEWORK_ENGINES[job.framework])
    chosen = list(engines)
    check_engines(job, chosen)
    return chosen


def _accelerate_on_cpu(named: list[Engine] | None, engines: list[Engine]) -> list[Engine]:
    """The engines an accelerate job trains on the CPU: accelerate runs its ranks as DDP there
    (``ACCELERATE_USE_CPU``: its DeepSpeed path is for accelerators only), so DeepSpeed is
    left out of the space, or refused where it was named."""
    if named is not None and Engine.DEEPSPEED in [Engine(e) for e in named]:
        raise ConfigError(
            "--engine deepspeed with --framework accelerate on the CPU: accelerate trains no "
            "DeepSpeed on the CPU (its ranks run as DDP there): use --engine single or ddp, "
            "or probe on GPUs"
        )
    return [e for e in engines if e is not Engine.DEEPSPEED]


def _check_ranks(device: Device, ranks: int, here: int) -> None:
    """More ranks on a node than it can run: GPUs beyond those visible, or CPU ranks beyond
    its cores (a simulated node has as many GPUs as asked; every node is taken to be like
    this one)."""
    if device.kind == "cuda" and ranks > here:
        raise ConfigError(
            f"--gpus {ranks}, but {here} GPU{'s are' if here > 1 else ' is'} visible here "
            f"(CUDA_VISIBLE_DEVICES): use --gpus {here} or fewer, or plan for more with "
            "autotune plan --gpu KEY --gpus N"
        )
    cores = os.cpu_count() or 1
    if device.kind == "cpu" and ranks > cores:
        raise ConfigError(
            f"--gpus {ranks} on the CPU starts {ranks} rank processes, and this machine has "
            f"{cores} cores: use --gpus {cores} or fewer"
        )


def _check_something_fits(
    rows: list[PlanRow], spec: ModelSpec, world: int, capacity: int, *, on_cpu: bool
) -> None:
    """No configuration is predicted to fit: say what the smallest needs, and what to do,
    before a study is made for a search that would probe nothing.

    Raises:
        NothingFits: One line with the smallest configuration's need and what to change.
    """
    if not rows or any(row.fits for row in rows):
        return
    ranks = (
        f"{world} CPU rank{'s' if world > 1 else ''}"
        if on_cpu
        else f"{world} GPU{'s' if world > 1 else ''}"
    )
    each = "rank" if on_cpu else "GPU"
    smallest = min(rows, key=lambda row: row.memory.device_bytes)
    # LoRA, where it was not allowed: the last resort that trains adapters, not the model.
    lora = "" if any(row.config.is_lora for row in rows) else ", or --allow lora"
    if smallest.memory.device_bytes <= capacity:  # the device would do; the host does not
        raise NothingFits(
            f"no configuration of {spec.name} on {ranks} fits this node's host memory (the "
            "offloaded states and each rank's process): use more GPUs or nodes, or a host "
            f"with more memory (--host-memory){lora}"
        )
    needs = format_bytes(smallest.memory.device_bytes)
    more = "a larger --device-memory" if on_cpu else "more GPUs, a larger --device-memory"
    raise NothingFits(
        f"no configuration of {spec.name} on {ranks} fits {format_bytes(capacity)} per {each}: "
        f"the smallest, {smallest.config.label()} at micro-batch {smallest.micro_batch_size}, "
        f"needs {needs} (predicted); use {more}, a shorter --seq-len or a smaller model{lora}"
    )


def tune(
    model: str | None,
    *,
    on_event: Callable[[Event], None] | None = None,
    **options: Any,
) -> RunSummary:
    """Find the fastest configuration that fits: probe, escalate, record every trial.

    Args:
        model: A preset name or a path to a Hugging Face config.json (None: read from a
            Trainer script's ``--model_name_or_path``, with ``script``).
        on_event: Called at each step of the search (a live view, a log).
        **options: As :func:`prepare`: ``budget`` ("30m"), ``seq_len``, ``global_batch``
            (default 8 per GPU), ``gpus``, ``engines``, ``device`` ("auto", "cuda", "cpu" or
            a :class:`~autotune.devices.Device`), ``simulate`` (a GPU key: the estimator's
            simulated GPU), ``device_memory`` (emulated cap per device, needed on the CPU),
            ``headroom``, ``host_memory`` (a node's host memory for the job: default this
            node's; a simulated node's is not limited unless given), ``objective``
            ("tokens" or "mfu"), ``storage`` (an Optuna storage URL), ``trials_dir``,
            ``seed`` (of the simulated device's noise), ``warm`` (real probes: fork ranks from
            a warm process, True; False: each rank a fresh interpreter), ``nodes`` (nodes the
            probes span: default all of the Slurm allocation the run is in, else 1) and
            ``hosts`` (their names, ``"this-host,node2"``, reached by ``ssh``); ``gpus`` is
            then the GPUs in all, split evenly over the nodes. ``script``, ``framework``
            (``hf``, ``accelerate`` or ``torchrun``), ``script_args`` and the script's own
            flags for the knobs (``batch_flag``, ``accum_flag``, ``checkpointing_flag``): probe
            the user's own training script instead of autotune's stand-in (docs/jobs.md).
            ``losses``, ``op_checkpointing``, ``optimizers``, ``activation_offload``: the
            knobs beyond the ladder to search; ``lora_rank``: LoRA allowed at that rank,
            searched once no full fine-tuning configuration is left that may fit (None: not
            allowed).

    Returns:
        Why the search stopped, the best measurement and every measurement of the study.
    """
    return prepare(model, **options).run(on_event)


def tune_jobs(
    path: str | Path,
    *,
    max_age: str | float | None = None,
    on_job: Callable[[Job, Tuning, Freshness], Callable[[Event], None] | None] | None = None,
    on_result: Callable[[JobResult], None] | None = None,
    now: dt.datetime | None = None,
    **defaults: Any,
) -> list[JobResult]:
    """Tune every workload of a job file in turn, each only when something changed.

    A workload is skipped, with the reason, while its study's fingerprint (versions, GPU,
    driver, GPU and node count) is unchanged and holds a configuration that fits, no older
    than ``max_age``. Every workload is checked before the first one runs; one that still
    cannot run (nothing fits, its database is locked) is recorded as failed and the next one
    goes on; Ctrl-C or SIGTERM stops the running probe and the whole job.

    Args:
        path: The job file (YAML, a ``workloads:`` list; see :mod:`autotune.jobs`).
        max_age: Tune again a result older than this (``"7d"``); None: any age stands.
        on_job: Called before a workload is tuned, with its tuning and why; it may return
            the ``on_event`` of that run (a live view).
        on_result: Called with each workload's result as it ends.
        now: The time results are aged against (default: now, the tuner's local time, as
            Optuna stores trial times).
        **defaults: :func:`prepare`'s options (``budget``, ``storage``, ``simulate``, ...),
            for every workload that does not set them.

    Raises:
        ConfigError: When the job file is bad (one line naming file, line and field), or a
            workload's options are ones ``run`` refuses (one line naming file, line and
            workload; every workload is checked as :func:`prepare` checks it, its storage
            and trials folder too, before the first one runs): nothing is run then.
    """
    from autotune.jobs import freshness, read_jobs
    from autotune.study.reader import read_studies

    limit = None if max_age is None else positive_seconds(max_age, "--max-age")
    jobs = read_jobs(Path(path), defaults)
    for job in jobs:
        model, options = _job_arguments(job)
        try:
            _check(model, **options)
        except ValueError as error:  # ConfigError, or a model that cannot be read
            raise ConfigError(f"{path}:{job.line}: workload {job.index}: {error}") from None
    results = []
    for job in jobs:
        model, options = _job_arguments(job)
        storage = options.get("storage", DEFAULT_STORAGE)
        try:
            studies = read_studies(storage, last=0)
            tuning = prepare(model, **options)
        except NothingFits as error:
            result = JobResult(job=job, status="no fit", why=str(error))
        except (ConfigError, ValueError) as error:
            result = JobResult(job=job, status="failed", why=str(error))
        else:
            fresh = freshness(
                tuning.fingerprint, studies, now=now or dt.datetime.now(), max_age_s=limit
            )
            study = tuning.fingerprint.study_name
            if not fresh.tune:
                tuning.device.close()
                kept = next(s.best for s in studies if s.study_name == study)
                result = JobResult(job=job, status="skipped", why=fresh.why, study=study, best=kept)
            else:
                if fresh.again:
                    tuning.store.measure_again()
                on_event = on_job(job, tuning, fresh) if on_job is not None else None
                summary = tuning.run(on_event)
                status = (
                    "interrupted"
                    if summary.interrupted
                    else "failed"
                    if summary.failure or summary.mistake
                    else "tuned"
                    if summary.best is not None
                    else "no fit"
                )
                result = JobResult(
                    job=job,
                    status=status,
                    why=summary.stop_reason if summary.failure or summary.mistake else fresh.why,
                    study=study,
                    summary=summary,
                    best=summary.best,
                )
        results.append(result)
        if on_result is not None:
            on_result(result)
        if result.status == "interrupted":
            break
    return results


def _job_arguments(job: Job) -> tuple[str, dict[str, Any]]:
    """A workload's model and :func:`prepare`'s options, from its fields (``run``'s options)."""
    options = api_arguments(job.options)
    return str(options.pop("model")), options
