"""How a measured configuration reaches the user's own training job: one adapter per framework
turns a :class:`~autotune.handoff.launch.Launch` into what that framework reads
(:func:`job_command`): the Trainer's flags rewritten, a DeepSpeed JSON beside them, or the
configuration as a JSON file named by ``AUTOTUNE_JOB_CONFIG`` for a plain ``torchrun`` script
(read with :func:`job_config`). The probes run exactly the command ``autotune export --format
command`` writes (:func:`shell_text`), so what is exported is what was measured. Pure
functions and plain data: nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.config import ConfigError, Engine, Offload, Precision, TrainConfig
from autotune.handoff.launch import (
    Format,
    Launch,
    checkpointing_field,
    deepspeed_for,
    hf_fields,
    one_line,
    render,
    thread_lines,
)
from autotune.tuned.script import (
    BOOL_WORDS,
    Framework,
    ScriptJob,
    check_engines,
    shell_references,
)

JOB_CONFIG_ENV = "AUTOTUNE_JOB_CONFIG"
"""Names the JSON file a ``torchrun`` script reads its configuration from."""


# ---- what a rank of the user's job is told ---------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class JobConfig:
    """The configuration a plain ``torchrun`` script applies itself (``autotune.job_config()``)."""

    micro_batch_size: int
    grad_accum: int
    seq_len: int
    world_size: int
    engine: str
    zero_stage: int
    precision: str
    ac_every: int
    """Checkpoint decoder blocks 0, k, 2k, ...; 0: none."""
    offload: str
    attention: str
    max_steps: int | None = None
    """Optimizer steps to run (a probe's warm-up and timed steps, with one to spare); None:
    the script's own."""
    deepspeed: dict[str, Any] | None = None
    """The DeepSpeed config to pass to ``deepspeed.initialize`` (engine ``deepspeed``)."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def config(self) -> TrainConfig:
        """As autotune's own :class:`~autotune.config.TrainConfig`."""
        return TrainConfig.from_dict(
            {
                "engine": self.engine,
                "zero_stage": self.zero_stage,
                "precision": self.precision,
                "ac_every": self.ac_every,
                "offload": self.offload,
                "attention": self.attention,
            }
        )

    def to_dict(self) -> dict[str, Any]:
        data = {name: getattr(self, name) for name in self.__dataclass_fields__}
        extra = data.pop("extra")
        return {**extra, **data}


def _job_config(launch: Launch, max_steps: int | None, cpu: bool = False) -> JobConfig:
    config = launch.config
    ds = deepspeed_for(launch, cpu=cpu) if config.engine is Engine.DEEPSPEED else None
    return JobConfig(
        micro_batch_size=launch.micro_batch_size,
        grad_accum=launch.grad_accum,
        seq_len=launch.seq_len,
        world_size=launch.world_size,
        engine=config.engine.value,
        zero_stage=config.zero_stage,
        precision=config.precision.value,
        ac_every=config.ac_every,
        offload=config.offload.value,
        attention=config.attention.value,
        max_steps=max_steps,
        deepspeed=ds,
    )


def job_config(path: str | Path | None = None) -> JobConfig | None:
    """The configuration autotune hands this run, or None when autotune did not start it.

    A plain ``torchrun`` script reads its micro-batch size, accumulation, precision and
    engine here (the file ``AUTOTUNE_JOB_CONFIG`` names)::

        import autotune
        job = autotune.job_config()
        micro_batch = job.micro_batch_size if job else 8
    """
    where = path if path is not None else os.environ.get(JOB_CONFIG_ENV)
    if not where:
        return None
    try:
        data = json.loads(Path(where).read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"{JOB_CONFIG_ENV}={where} cannot be read ({error}): rerun the export, or unset it"
        ) from None
    known = set(JobConfig.__dataclass_fields__) - {"extra"}
    extra = {k: v for k, v in data.items() if k not in known}
    return JobConfig(**{k: v for k, v in data.items() if k in known}, extra=extra)


# ---- the adapters ------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class JobCommand:
    """How to run the user's job with one configuration."""

    target: tuple[str, ...]
    """What ``python`` (or ``torchrun``) runs: the script and its (rewritten) arguments."""
    env: dict[str, str]
    """Variables every rank gets."""
    files: dict[str, str]
    """File name -> text: configuration files the command names, written beside it."""
    notes: tuple[str, ...] = ()
    """What the user should know about the command (comments of the export)."""
    launcher: tuple[str, ...] = ()
    """The framework's own launcher, which starts a node's ranks (``accelerate launch
    --config_file accelerate.yaml``); empty: ``torchrun``, or autotune's launcher in a probe,
    starts each rank as ``python`` + ``target``."""


HF_CONTROLLED = (
    "per_device_train_batch_size",
    "per_gpu_train_batch_size",
    "gradient_accumulation_steps",
    "bf16",
    "fp16",
    "gradient_checkpointing",
    "gradient_checkpointing_kwargs",
    "activation_checkpointing",
    "activation_checkpointing_kwargs",
    "deepspeed",
    "fsdp",
    "fsdp_config",
    "auto_find_batch_size",
    "max_steps",
    "use_cpu",
)
"""``TrainingArguments`` fields the Trainer adapter sets: the user's own values of these are
replaced (``max_steps`` only in a probe)."""


def flag_value(args: Sequence[str], name: str) -> str | None:
    """The value ``args`` give flag ``--name`` (``--name value`` or ``--name=value``; the
    last one wins, as argparse reads it), or None."""
    found = None
    for index, arg in enumerate(args):
        if arg == f"--{name}" and index + 1 < len(args):
            found = args[index + 1]
        elif arg.startswith(f"--{name}="):
            found = arg.split("=", 1)[1]
    return found


def rewrite_flags(
    args: Sequence[str], fields: Mapping[str, Any], controlled: Sequence[str]
) -> list[str]:
    """``args`` without any flag of ``controlled`` (``--name value``, ``--name=value``, or a
    bare boolean ``--name``), then ``fields`` as flags, in the form ``HfArgumentParser``
    reads (booleans ``True``/``False``, dicts as JSON)."""
    names = {f"--{name}" for name in controlled} | {f"--{name}" for name in fields}
    kept: list[str] = []
    index = 0
    while index < len(args):
        arg = args[index]
        flag = arg.split("=", 1)[0]
        if flag not in names:
            kept.append(arg)
            index += 1
            continue
        index += 1
        if "=" in arg:
            continue
        following = args[index] if index < len(args) else None
        if following is not None and not following.startswith("--"):
            is_bool = following.lower() in BOOL_WORDS
            if is_bool or flag[2:] not in ("bf16", "fp16", "auto_find_batch_size"):
                index += 1  # its value (a bare boolean flag takes none)
    for name, value in fields.items():
        if isinstance(value, bool):
            text = "True" if value else "False"
        elif isinstance(value, dict | list):
            text = json.dumps(value)
        else:
            text = str(value)
        kept += [f"--{name}", text]
    return kept


def _hf_command(job: ScriptJob, launch: Launch, max_steps: int | None, cpu: bool) -> JobCommand:
    # On the CPU, DeepSpeed with torch's AdamW as the stand-in's CPU probes: no op to build.
    fields = dict(hf_fields(launch, cpu=cpu))
    if cpu:
        fields["use_cpu"] = True
    files: dict[str, str] = {}
    notes = []
    if "deepspeed" in fields:
        files["ds_config.json"] = json.dumps(fields.pop("deepspeed"), indent=2) + "\n"
        fields["deepspeed"] = "ds_config.json"
    if not launch.config.ac_every:
        # The user's own checkpointing flag is replaced: off must be said, not left out.
        fields[checkpointing_field(launch.transformers)] = False
    if max_steps is not None:
        fields["max_steps"] = max_steps
    if launch.config.precision is Precision.BF16:
        notes.append("pure bf16: the script loads the model in torch.bfloat16")
    # The user's own --max_steps stands in an export: only a probe stops the job early.
    controlled = [name for name in HF_CONTROLLED if max_steps is not None or name != "max_steps"]
    return JobCommand(
        target=(job.path, *rewrite_flags(job.args, fields, controlled)),
        env={},
        files=files,
        notes=tuple(notes),
    )


JOB_CONFIG_FILE = "autotune-job.json"


def _script_args(job: ScriptJob, launch: Launch) -> tuple[str, ...]:
    """The script's arguments, its own flags for the micro-batch, the accumulation and
    checkpointing (those named) set to the launch's: the user's values of them replaced."""
    values = {job.batch_flag: launch.micro_batch_size, job.accum_flag: launch.grad_accum}
    kept = list(job.args)
    for flag in values:
        if flag is not None:
            kept = _without(kept, flag)
    switch = job.checkpointing_flag
    if switch is not None:
        if launch.config.ac_every > 1:
            raise ConfigError(
                f"{launch.config.label()} checkpoints every {launch.config.ac_every}-th block, "
                f"and the script's {switch} checkpoints every block or none: tune it anew, or "
                "let the script read autotune.job_config() in place of --checkpointing-flag"
            )
        negated = "--no-" + switch.lstrip("-")
        kept = [arg for arg in kept if arg.split("=", 1)[0] not in (switch, negated)]
    added = [part for flag, value in values.items() if flag for part in (flag, str(value))]
    if switch is not None and launch.config.ac_every == 1:
        added.append(switch)
    return (*kept, *added)


def _without(args: Sequence[str], flag: str) -> list[str]:
    """``args`` without ``flag`` and its value (``--flag value`` or ``--flag=value``)."""
    kept: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(f"{flag}="):
            kept.append(arg)
    return kept


def _torchrun_command(
    job: ScriptJob, launch: Launch, max_steps: int | None, cpu: bool
) -> JobCommand:
    config = _job_config(launch, max_steps, cpu)
    own = [f for f in (job.batch_flag, job.accum_flag, job.checkpointing_flag) if f]
    how = (
        f"the script takes {', '.join(own)} from its own flags, the rest of the "
        "configuration from autotune.job_config()"
        if own
        else "the script applies the configuration it reads with autotune.job_config()"
    )
    return JobCommand(
        target=(job.path, *_script_args(job, launch)),
        env={JOB_CONFIG_ENV: JOB_CONFIG_FILE},
        files={JOB_CONFIG_FILE: json.dumps(config.to_dict(), indent=2) + "\n"},
        notes=(how,),
    )


ACCELERATE_CONFIG_FILE = "accelerate.yaml"


def _accelerate_command(
    job: ScriptJob, launch: Launch, max_steps: int | None, cpu: bool
) -> JobCommand:
    config = _job_config(launch, max_steps, cpu)
    env = {
        # Accelerator() reads its accumulation here unless the script passes its own.
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": str(launch.grad_accum),
        JOB_CONFIG_ENV: JOB_CONFIG_FILE,
    }
    if cpu:
        # Without it, accelerate's ranks on a CPU never join one process group (each trains
        # alone, while torch's variables still say the world is several).
        env["ACCELERATE_USE_CPU"] = "1"
    return JobCommand(
        target=(job.path, *_script_args(job, launch)),
        env=env,
        files={
            ACCELERATE_CONFIG_FILE: render(launch, Format.ACCELERATE),
            JOB_CONFIG_FILE: json.dumps(config.to_dict(), indent=2) + "\n",
        },
        notes=(
            "accelerate reads the engine and precision from accelerate.yaml; the "
            "accumulation from ACCELERATE_GRADIENT_ACCUMULATION_STEPS unless the script "
            "passes Accelerator(gradient_accumulation_steps=...)",
        ),
        launcher=("accelerate", "launch", "--config_file", ACCELERATE_CONFIG_FILE),
    )


def job_command(
    job: ScriptJob, launch: Launch, *, max_steps: int | None = None, cpu: bool = False
) -> JobCommand:
    """The user's job run with ``launch``'s configuration (``max_steps``: stop after that many
    optimizer steps, where the framework has the knob; ``cpu``: the ranks train on the CPU,
    as autotune's CPU probes do). The names of its ``files`` in its
    ``env`` and ``target`` are bare: :func:`placed` makes them paths in a folder."""
    check_engines(job, [launch.config.engine])
    if launch.config.offload is not Offload.NONE and launch.config.engine is not Engine.DEEPSPEED:
        raise ConfigError("offload needs the deepspeed engine")
    if job.framework is Framework.HF:
        return _hf_command(job, launch, max_steps, cpu)
    if job.framework is Framework.ACCELERATE:
        return _accelerate_command(job, launch, max_steps, cpu)
    return _torchrun_command(job, launch, max_steps, cpu)


def placed(command: JobCommand, folder: Path) -> JobCommand:
    """``command`` with its files' names made paths in ``folder`` (where they are written)."""

    def place(text: str) -> str:
        return str(folder / text) if text in command.files else text

    return dataclasses.replace(
        command,
        target=tuple(place(t) for t in command.target),
        env={k: place(v) for k, v in command.env.items()},
        launcher=tuple(place(t) for t in command.launcher),
    )


def write_files(command: JobCommand, folder: Path) -> None:
    """Write the command's configuration files into ``folder``."""
    for name, text in command.files.items():
        (folder / name).write_text(text)


def _here_document_end(text: str) -> str:
    """A word that ends a here-document holding ``text``: ``AUTOTUNE_EOF``, with a number
    added where a line of ``text`` is that word already."""
    lines = set(text.split("\n"))  # the shell's lines
    word, number = "AUTOTUNE_EOF", 0
    while word in lines:
        number += 1
        word = f"AUTOTUNE_EOF_{number}"
    return word


def shell_text(
    command: JobCommand, launch: Launch, summary: str, *, with_files: bool = True
) -> str:
    """The job as a shell script: its files written by here-documents (``with_files``), then
    the ``torchrun`` line (``autotune export --format command``). Every argument is quoted
    with ``shlex``, a secret of :func:`referenced_args` read from its variable; comments hold
    one line each (:func:`~autotune.handoff.launch.one_line`)."""
    lines = ["#!/bin/sh", f"# autotune: {one_line(summary)}"]
    lines += [f"# {one_line(note)}" for note in command.notes]
    lines.append("set -e")
    lines += thread_lines(launch.per_node)  # as the probes' ranks ran
    for name, text in command.files.items() if with_files else ():
        end = _here_document_end(text)
        lines += [f"cat > {shlex.quote(name)} <<'{end}'", text.rstrip("\n"), end]
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in command.env.items())
    runner = [
        "torchrun",
        f"--nnodes={launch.nodes}",
        f"--nproc-per-node={launch.per_node}",
    ]
    if launch.nodes == 1:
        runner.insert(1, "--standalone")
    if command.launcher:
        runner = list(command.launcher)
    line = shell_references(shlex.join([*runner, *command.target]))
    lines.append(f"{env} {line}" if env else line)
    return "\n".join(lines) + "\n"
