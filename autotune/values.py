"""The user's values and their checks, one home for each: durations, sizes, fractions, counts,
the GPU, the workload, the nodes, the trials folder, the engines, the objective, the attention
kernel and the knobs. The command line, the Python API (:mod:`autotune.api`) and job files
(:mod:`autotune.jobs`) check a value through the same function.

Each takes what a caller was given (text with units or a number) and answers the checked value,
or raises :class:`~autotune.config.ConfigError` whose message names the option and what to do.
"""

from __future__ import annotations

import dataclasses
import errno
import importlib.util
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from autotune.config import (
    LADDER_ONLY,
    Attention,
    ConfigError,
    Engine,
    Knobs,
    Loss,
    Optimizer,
    Precision,
    TrainConfig,
)
from autotune.estimator.plan import DEVICE_RESERVE_BYTES
from autotune.hardware import GpuSpec, detect_gpus, gpu_spec
from autotune.models import ModelSpec
from autotune.probe.launcher import folder_hint
from autotune.probe.nodes import Nodes, nodes_from_environment
from autotune.space import Workload
from autotune.study.fingerprint import Objective
from autotune.tuned.script import ScriptJob
from autotune.units import (
    format_bytes,
    is_plain_number,
    parse_duration,
    parse_fraction,
    parse_size,
)

PER_GPU_BATCH = 8
"""Global batch per GPU when none is given (sequences)."""
DEFAULT_SEQ_LEN = 2048
"""Tokens per sequence when none is given, for a model that takes as many positions."""


def positive_seconds(value: str | float, what: str) -> float:
    """A positive duration: typed text with its unit (``30m``, ``1h30m``; a bare ``30`` is
    refused, as a job file refuses it: minutes or seconds?), or a number of seconds (the
    Python API's)."""
    if isinstance(value, str) and is_plain_number(value):
        raise ConfigError(f"{what} {value.strip()} has no unit: write it like 45m, 90s or 1h30m")
    seconds = parse_duration(value) if isinstance(value, str) else float(value)
    if seconds <= 0:
        raise ConfigError(f"{what} must be positive, like 30m")
    return seconds


def engines_value(value: str | Sequence[str] | None) -> list[Engine] | None:
    """``--engine``: engines by name, comma-separated or as a list (None: every engine)."""
    if value is None:
        return None
    names = value.split(",") if isinstance(value, str) else [str(name) for name in value]
    try:
        return [Engine(name.strip()) for name in names]
    except ValueError:
        choices = ", ".join(e.value for e in Engine)
        raise ConfigError(f"unknown engine in {value!r}: use {choices}, comma-separated") from None


_API_NAMES = {
    "engine": "engines",
    "loss": "losses",
    "ac_ops": "op_checkpointing",
    "act_offload": "activation_offload",
    "optimizer": "optimizers",
    "args": "script_args",
}
"""Options named as the command line and job files name them, and the API's names."""


def api_arguments(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The API's keyword arguments (:func:`autotune.api.prepare`'s, :func:`autotune.api.plan`'s)
    from options named as the command line and a job file name them (``engine: fsdp,ddp``,
    ``ac_ops``, ``args``): a workload's fields and the command's defaults meet under these
    names, and are renamed once, here."""
    options = {_API_NAMES.get(name, name): value for name, value in fields.items()}
    if "engines" in options:
        options["engines"] = engines_value(options["engines"])
    for name in ("op_checkpointing", "activation_offload"):
        if name in options:
            options[name] = options[name] is True
    return options


def objective_value(value: Objective | str) -> Objective:
    """``--objective``: what the search maximizes."""
    if value in set(Objective):
        return Objective(value)
    choices = " or ".join(o.value for o in Objective)
    raise ConfigError(f"unknown objective {value!r}: use {choices}")


def size_bytes(value: str | int | None, what: str, *, zero: bool = False) -> int | None:
    if value is None:
        return None
    size = parse_size(value) if isinstance(value, str) else int(value)
    if size < 0 or (size == 0 and not zero):
        raise ConfigError(f"{what} must be a positive size, like 20GiB")
    return size


def reserve_bytes(value: str | int, gpu: GpuSpec) -> int:
    """``--reserve``: device memory kept from the plan, less than the whole card."""
    reserve = size_bytes(value, "--reserve", zero=True) or 0
    if reserve >= gpu.memory_bytes:
        raise ConfigError(
            f"--reserve {format_bytes(reserve)} is all of the {gpu.name}'s "
            f"{format_bytes(gpu.memory_bytes)} or more: leave it out (default "
            f"{format_bytes(DEVICE_RESERVE_BYTES)}) or keep it below the card's memory"
        )
    return reserve


def fraction_value(value: str | float, what: str) -> float:
    if isinstance(value, str):
        return parse_fraction(value, what)
    if not 0.0 <= value < 1.0:
        raise ConfigError(f"{what} {value!r} must be between 0 and 1")
    return float(value)


def target_gpu(gpu: str | GpuSpec | None) -> tuple[GpuSpec, int]:
    """The GPU named (a catalogue key or a .toml file) or detected here, and the count here."""
    detected = detect_gpus()
    here = detected.count if detected else 1
    if isinstance(gpu, GpuSpec):
        return gpu, here
    if gpu is not None:
        return gpu_spec(gpu), here
    if detected is None:
        raise ConfigError("no GPU detected: name the target with --gpu h100-80gb (or a .toml file)")
    if detected.spec is None:
        raise ConfigError(
            f"{detected.name} is not in the GPU catalogue: describe it in a .toml file and pass "
            "--gpu that-file.toml (see docs/gpus.md)"
        )
    return detected.spec, detected.count


def workload_for(
    spec: ModelSpec,
    seq_len: int | None,
    global_batch: int | None,
    world_size: int,
    *,
    layouts: bool = False,
) -> Workload:
    """The workload asked for; its global batch a multiple of the GPUs unless ``layouts``
    (a plan with TP/PP/CP layouts, whose data-parallel ranks may be fewer than the GPUs)."""
    batch = global_batch if global_batch is not None else PER_GPU_BATCH * world_size
    work = Workload(seq_len=seq_len_for(spec, seq_len), global_batch=batch, world_size=world_size)
    if not layouts:
        work.check_splits()
    return work


def seq_len_for(spec: ModelSpec, seq_len: int | None) -> int:
    """The sequence length asked for, or by default ``DEFAULT_SEQ_LEN`` capped at the model's
    positions (a 1,024-position GPT-2 is tuned at 1,024 unless told otherwise).

    Raises:
        ConfigError: A sequence longer than the model's positions: its position embeddings or
            RoPE range end there (a config that scales RoPE, ``rope_scaling``, states its own
            range).
    """
    longest = spec.max_position_embeddings
    if seq_len is None:
        return min(DEFAULT_SEQ_LEN, longest)
    if seq_len > longest and not spec.config.get("rope_scaling"):
        raise ConfigError(
            f"--seq-len {seq_len} is longer than {spec.name} takes ({longest} positions, "
            f"max_position_embeddings): use --seq-len {longest} or less, or a config.json that "
            "extends it (rope_scaling)"
        )
    return seq_len


SEARCHED_KNOBS = LADDER_ONLY
"""The knobs ``run`` searches unless told: the ladder's alone. The chunked and fused losses
(``--loss full,chunked``), op-level checkpointing (``--ac-ops``) and 8-bit AdamW
(``--optimizer adamw,adamw-8bit``) are planned by default and searched when named: with them
in its space the search falls short of its goal on the benchmark's sets, where the best point
is often a configuration predicted not to fit whose memory the simulated error overstates
(docs/search.md, "The knobs beyond the ladder")."""


def knobs_for(
    job: ScriptJob | None,
    losses: tuple[Loss, ...] | None,
    op_checkpointing: bool,
    optimizers: tuple[Optimizer, ...] | None,
    device: str = "cuda",
    lora_rank: int | None = None,
    activation_offload: bool = False,
) -> Knobs:
    """The knobs a run on ``device`` (a device kind: ``cuda``, ``cpu``, ``simulated``,
    ``replay``) tries: those asked, by default :data:`SEARCHED_KNOBS`. A user's script
    computes its own loss, checkpoints as its framework does and builds its own optimizer, so
    it is tried on the ladder alone.

    ``lora_rank``: LoRA allowed at this rank (``--allow lora``), searched once no full
    fine-tuning configuration is left that may fit; None: full fine-tuning alone.
    ``activation_offload``: search activation offload (``--act-offload``) too.

    Raises:
        ConfigError: A knob that cannot run there: the fused loss off a CUDA GPU or without
            ``liger-kernel``, 8-bit AdamW without ``torchao``, LoRA without ``peft``, any
            knob with a script.
    """
    if job is not None and lora_rank is not None:
        raise ConfigError(
            "--allow lora puts adapters on autotune's stand-in; your script builds its own "
            "model: leave out --allow lora with --script (wrap it with peft there)"
        )
    rank = lora_rank_value(lora_rank)
    if rank:
        need_peft("--allow lora", device)
    if job is not None:
        if losses is not None and set(losses) != {Loss.FULL}:
            raise ConfigError(
                "--loss chunked is a loss of autotune's stand-in; your script computes its "
                "own: leave out --loss with --script"
            )
        if optimizers is not None and set(optimizers) != {Optimizer.ADAMW}:
            raise ConfigError(
                "--optimizer adamw-8bit is an optimizer of autotune's stand-in; your script "
                "builds its own: leave out --optimizer with --script (a Trainer takes "
                'optim="adamw_torch_8bit")'
            )
        if activation_offload:
            raise ConfigError(
                "--act-offload wraps the blocks of autotune's stand-in; your script builds its "
                "own model: leave out --act-offload with --script (TRL's SFTConfig takes "
                "activation_offloading=True)"
            )
        # A script's own checkpointing switch: every block or none.
        # A job that cannot checkpoint (--checkpointing-flag none) trains without it.
        return dataclasses.replace(
            LADDER_ONLY,
            block_patterns=job.checkpointing_flag is None,
            block_checkpointing=job.checkpoints,
        )
    losses = losses or SEARCHED_KNOBS.losses
    optimizers = optimizers or SEARCHED_KNOBS.optimizers
    if Loss.FUSED in losses and device == "cpu":
        raise ConfigError(
            "--loss fused runs Liger-Kernel's Triton kernels on a CUDA GPU: use --loss "
            "chunked on the CPU (the same memory, one more forward of the output layer)"
        )
    probing = device in ("cuda", "cpu")
    if Loss.FUSED in losses and device == "cuda" and not is_installed("liger_kernel"):
        raise ConfigError(
            "--loss fused needs Liger-Kernel: pip install liger-kernel, or use --loss chunked"
        )
    if Optimizer.ADAMW_8BIT in optimizers and probing and not is_installed("torchao"):
        raise ConfigError(
            "--optimizer adamw-8bit needs torchao: pip install torchao, or use --optimizer adamw"
        )
    return Knobs(
        losses=losses,
        op_checkpointing=op_checkpointing,
        optimizers=optimizers,
        lora_rank=rank,
        activation_offload=activation_offload,
    )


def lora_rank_value(value: int | None) -> int:
    """LoRA's rank as asked (``--lora-rank`` with ``--allow lora``): 0 when not allowed (None);
    one line below 1."""
    return 0 if value is None else (count_value(value, "--lora-rank") or 0)


def need_peft(option: str, device: str) -> None:
    """Refuse LoRA where a probe would import peft and it is not installed."""
    if device in ("cuda", "cpu") and not is_installed("peft"):
        raise ConfigError(f"{option} needs peft: pip install peft, or leave out {option}")


def check_attention(attention: Attention, device: str, precision: Precision | None = None) -> None:
    """Refuse flash-attn's kernels where they cannot run: in fp32, off a CUDA GPU, or without
    the package (a plan or a simulated GPU predicts them on any GPU).

    Raises:
        ConfigError: ``--attention flash_attention_2 runs flash-attn's CUDA kernels ...``.
    """
    if attention is not Attention.FLASH:
        return
    if precision is not None:
        TrainConfig(precision=precision, attention=attention)  # 16-bit compute only
    if device == "cpu":
        raise ConfigError(
            "--attention flash_attention_2 runs flash-attn's CUDA kernels: use --attention "
            "sdpa on the CPU (torch's own flash kernel for the CPU)"
        )
    if device == "cuda" and not is_installed("flash_attn"):
        raise ConfigError(
            "--attention flash_attention_2 needs flash-attn: pip install flash-attn, or use "
            "--attention sdpa (torch's flash kernel on Ampere and newer)"
        )


def is_installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def nodes_for(
    nodes: int | None, hosts: str | Sequence[str] | None, *, simulated: bool
) -> Nodes | None:
    """The nodes real probes span (``--hosts``, or the Slurm allocation the run is in), or
    None for this node alone; a simulated device has no hosts (``nodes`` alone counts)."""
    count_value(nodes, "--nodes")
    listed = [h.strip() for h in hosts.split(",")] if isinstance(hosts, str) else hosts
    if listed is not None and not all(listed):
        raise ConfigError(f"--hosts {hosts!r} has an empty name: use --hosts this-host,node2")
    if simulated:
        if listed:
            raise ConfigError("--hosts places real probes: leave it out with --simulate")
        return None
    return nodes_from_environment(os.environ, nodes=nodes, hosts=listed)


def check_trials_dir(trials_dir: Path) -> None:
    """Refuse a trials folder no probe folder can be made in, making nothing: a file in the
    way (the folder itself, or one above it), or a folder that cannot be written. (A run
    finds out at its first probe; a job file's workloads are checked before the first runs.)

    Raises:
        ConfigError: ``no probe folder can be made in DIR (Not a directory): a file is in the
            way: give --trials-dir a folder``, or the like.
    """
    existing = trials_dir.absolute()
    try:
        while not existing.exists():
            existing = existing.parent
    except OSError as error:  # a folder above it cannot be read
        why = error.strerror or str(error)
    else:
        if not existing.is_dir():
            why = os.strerror(errno.ENOTDIR)
        elif not os.access(existing, os.W_OK | os.X_OK):
            why = os.strerror(errno.EACCES)
        else:
            return
    raise ConfigError(f"no probe folder can be made in {trials_dir} ({why}): {folder_hint(why)}")


FOLDER_NAME = re.compile(r"(?!\.\.?\Z)[A-Za-z0-9._-]{1,128}")
"""One folder name: no separator, no line break, not ``.`` or ``..`` (the whole name must
match: ``fullmatch``)."""


def degrees_value(value: str | Sequence[int] | None, option: str) -> tuple[int, ...] | None:
    """A parallel degree or degrees to plan (``--tp 4`` or ``--tp 2,4,8``), each 1 or more;
    None: every degree the planner considers."""
    if value is None:
        return None
    parts = value.split(",") if isinstance(value, str) else list(value)
    try:
        degrees = tuple(int(part) for part in parts)
    except (TypeError, ValueError):
        degrees = ()
    if not degrees or any(d < 1 for d in degrees):
        raise ConfigError(f"{option} {value}: use a degree of 1 or more, or a list like 2,4,8")
    return degrees


def count_value(value: int | None, option: str) -> int | None:
    """A count the user gave, refused below 1 under its own name: an option's
    (``--gpus 0: use 1 or more``) or a job file field's (``gpus must be positive, not 0``)."""
    if value is not None and value < 1:
        if option.startswith("--"):
            raise ConfigError(f"{option} {value}: use 1 or more")
        raise ConfigError(f"{option} must be positive, not {value}")
    return value


def per_node_count(gpus: int | None, nodes: int, here: int) -> int:
    """Ranks on each node: ``gpus`` in all split evenly over the nodes, or every GPU here."""
    count_value(gpus, "--gpus")
    if gpus is None:
        return here
    if gpus % nodes:
        raise ConfigError(
            f"--gpus {gpus} does not split evenly over {nodes} nodes: use a multiple of {nodes}"
        )
    return gpus // nodes
