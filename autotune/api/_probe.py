"""``probe``: run one configuration for real."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from autotune.api._rlhf import check_rlhf_probe
from autotune.api._script import check_stand_in_only, user_script_job, user_script_model
from autotune.config import (
    DEVICES,
    ConfigError,
    Engine,
    NothingFits,
    TrainConfig,
)
from autotune.devices import Device, LocalDevice
from autotune.devices.base import SetupResult, SetupStep
from autotune.estimator.host import estimate_host, usable_host_bytes
from autotune.estimator.memory import estimate_memory
from autotune.hardware import detect_gpus, host_memory_bytes
from autotune.layouts import check_layout
from autotune.models import ModelSpec, resolve_model
from autotune.probe.launcher import new_probe_dir
from autotune.probe.result import ProbeResult
from autotune.probe.spec import ProbeSpec
from autotune.tuned.rlhf import RLHFProbe
from autotune.tuned.script import check_engines
from autotune.units import format_bytes
from autotune.values import (
    FOLDER_NAME,
    check_attention,
    count_value,
    knobs_for,
    need_peft,
    nodes_for,
    per_node_count,
    positive_seconds,
    seq_len_for,
    size_bytes,
)


def _check_probe_host(model: ModelSpec, spec: ProbeSpec, given: int | None) -> None:
    """Refuse a probe predicted to need more host memory than the node gives the job, as
    ``run`` leaves such configurations out: at its largest size, the offloaded states and
    each rank's process, and on the CPU the emulated device's tensors too (capped by it)."""
    size = max(spec.micro_batch_sizes)
    memory = estimate_memory(
        model, spec.config, micro_batch_size=size, seq_len=spec.seq_len,
        world_size=spec.world_size, cuda_allocator=spec.device == "cuda",
        grad_accum=spec.accumulation(size),
    )  # fmt: skip
    device = memory.device_bytes
    if spec.device_memory_bytes is not None:
        device = min(device, spec.device_memory_bytes)
    need = estimate_host(
        model,
        spec.config,
        world_size=spec.world_size,
        ranks_per_node=spec.num_processes,
        device=spec.device,
        device_bytes=device,
        activation_bytes=memory.offloaded_activation_bytes,
    ).node_bytes
    have = usable_host_bytes(given if given is not None else host_memory_bytes())
    if need > have:
        on_cpu = spec.device == "cpu"
        tensors = ", and on the CPU the device's tensors" if on_cpu else ""
        instead = (
            "a smaller model, a smaller --device-memory or fewer ranks"
            if on_cpu
            else "a configuration that offloads less, or fewer ranks"
        )
        raise NothingFits(
            f"{spec.config.label()} at micro-batch {size} needs {format_bytes(need)} of host "
            f"memory (predicted: offloaded states and each rank's process{tensors}), and this "
            f"node gives the job {format_bytes(have)}: the kernel would kill it; use {instead}, "
            "or --host-memory if the node has more"
        )


def probe(
    model: str | None,
    config: TrainConfig | None = None,
    *,
    micro_batch_sizes: Iterable[int] = (1,),
    seq_len: int | None = None,
    grad_accum: int = 1,
    gpus: int | None = None,
    device: str | Device = "auto",
    device_memory: str | int | None = None,
    warmup_steps: int = 2,
    timed_steps: int = 3,
    timeout: str | float = "10m",
    trials_dir: str | Path = "trials",
    folder: str = "probes",
    on_start: Callable[[ProbeSpec, Path], None] | None = None,
    set_up: Callable[[SetupStep], SetupResult] | None = None,
    nodes: int | None = None,
    hosts: str | Sequence[str] | None = None,
    host_memory: str | int | None = None,
    script: str | Path | None = None,
    framework: str | None = None,
    script_args: Sequence[str] = (),
    batch_flag: str | None = None,
    accum_flag: str | None = None,
    checkpointing_flag: str | None = None,
    rlhf: RLHFProbe | None = None,
) -> ProbeResult:
    """Run a few real training steps of one configuration at each micro-batch size.

    Args:
        model: A preset name or a path to a Hugging Face config.json.
        config: The configuration (default: one process, bf16 mixed precision).
        micro_batch_sizes: Sizes to measure in one process, in this order.
        gpus: Ranks in all; default all GPUs here (on each node) for a distributed engine,
            else 1.
        device: ``auto``, ``cuda``, ``cpu`` or a :class:`~autotune.devices.Device`.
        device_memory: Emulated device-memory cap per rank (``"20GiB"``).
        timeout: Wall-clock limit of the whole probe.
        trials_dir: Where the probe folder goes: a new ``trials_dir/folder/N``, made once
            the probe is known to be valid.
        on_start: Called with the spec and the folder just before the probe starts.
        set_up: Runs each of the device's set-up steps (building DeepSpeed ops the probe
            loads that are not built), before the probe and outside its timeout; default:
            ``step.run()``. A live view wraps it in a spinner and prints its result.
        nodes: Nodes the probe spans (default: all of the Slurm allocation it runs in,
            else 1); ``gpus`` is split evenly over them.
        hosts: The nodes' names (``"this-host,node2"``), this one first; others are
            reached by ``ssh``.
        host_memory: Host memory of a node for the job (``"125GiB"``); default: what this
            node gives it. A probe predicted to need more is refused before it starts (the
            kernel's OOM killer would end it as ``host_oom``, minutes later).
        script, framework, script_args, batch_flag, accum_flag, checkpointing_flag: Probe the
            user's own training script
            (as :func:`tune` does), each size a run of its own.
        rlhf: Each step an RL iteration instead (``model`` the policy): the other models
            built beside it, the rollout engine's share held as allocated memory (an
            emulated reservation), scoring forwards, then the trained models' steps; each
            phase's peak in the result (:mod:`autotune.probe.rlhf`).

    Raises:
        NothingFits: The probe is predicted to need more host memory than the node has.
    """
    job = user_script_job(
        script,
        framework,
        script_args,
        (batch_flag, accum_flag, checkpointing_flag),
        simulate=None,
        device=device,
    )
    if job is not None:
        model = model or user_script_model(job)
        check_engines(job, [(config or TrainConfig()).engine])
        check_stand_in_only(job, config or TrainConfig())
        if (nodes or 1) > 1 or hosts:
            raise ConfigError("--script runs on one node: leave out --nodes and --hosts")
    if model is None:
        raise ConfigError("give --model: a preset name or the path of a config.json")
    shape = resolve_model(model)  # fails fast on an unknown name
    seq_len = seq_len_for(shape, seq_len)
    config = config or TrainConfig()
    if config.ac_every > shape.num_layers:
        raise ConfigError(
            f"checkpointing every {config.ac_every} blocks of {shape.name}'s "
            f"{shape.num_layers} checkpoints only its first block: use --ac every-"
            f"{shape.num_layers} or less"
        )
    if FOLDER_NAME.fullmatch(folder) is None:
        raise ConfigError(
            f"--study {folder!r} is not a folder name: use letters, digits, '.', '_' or '-' "
            "(it is made under --trials-dir, never elsewhere)"
        )
    count_value(gpus, "--gpus")
    layout = nodes_for(nodes, hosts, simulated=not isinstance(device, str))
    count = layout.count if layout is not None else 1
    if isinstance(device, str):
        detected = detect_gpus()
        if device == "cuda" and detected is None:
            raise ConfigError("--device cuda, but no GPU is visible: use --device cpu")
        if device == "auto":
            device = "cuda" if detected else "cpu"
        if device not in DEVICES:
            raise ConfigError(f"unknown device {device!r}: use {', '.join(DEVICES)}")
        # One probe: nothing to share with warm workers.
        chosen: Device = LocalDevice(device, warm=False, nodes=layout)
        here = detected.count if detected and device == "cuda" else 1
    else:
        chosen, here = device, 1
    if job is None:
        knobs_for(None, (config.loss,), False, (config.optimizer,), chosen.kind)  # where it runs
        check_attention(config.attention, chosen.kind)  # the precision: TrainConfig's check
        if config.is_lora:
            need_peft("--lora-rank", chosen.kind)
    single = config.engine is Engine.SINGLE and count == 1 and config.model_parallel == 1
    spec = ProbeSpec(
        model=model,
        config=config,
        micro_batch_sizes=tuple(micro_batch_sizes),
        seq_len=seq_len,
        grad_accum=grad_accum,
        num_processes=1 if single and gpus is None else per_node_count(gpus, count, here),
        nodes=count,
        device=chosen.kind if chosen.kind in ("cuda", "cpu") else "cuda",
        device_memory_bytes=size_bytes(device_memory, "--device-memory"),
        warmup_steps=warmup_steps,
        timed_steps=timed_steps,
        timeout_s=positive_seconds(timeout, "the probe timeout"),
        script=job,
        rlhf=rlhf,
    )
    if rlhf is not None:
        check_rlhf_probe(shape, rlhf, spec)
    check_layout(
        config,
        shape,
        world_size=spec.world_size,
        gpus_per_node=spec.num_processes,
        seq_len=seq_len,
    )
    if config.pp > 1 and shape.tie_word_embeddings:
        raise ConfigError(
            f"{shape.name} ties its output layer to its embedding, which a pipeline puts on "
            "its first and last stages: probe --pp with a model whose tables are apart"
        )
    if isinstance(chosen, LocalDevice):
        _check_probe_host(shape, spec, size_bytes(host_memory, "--host-memory"))
    for step in chosen.setup(spec):
        if set_up is None:
            step.run()
        else:
            set_up(step)
    probe_dir = new_probe_dir(Path(trials_dir), folder)
    if on_start is not None:
        on_start(spec, probe_dir)
    return chosen.launch(spec, probe_dir)
