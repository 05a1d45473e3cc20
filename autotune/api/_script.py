"""The user's own training script as ``run`` and ``probe`` take it (:mod:`autotune.tuned.script`):
its job from the options, its model, and the fields only autotune's stand-in has, refused
for it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from autotune.config import ConfigError, TrainConfig
from autotune.devices import Device
from autotune.handoff.script import flag_value
from autotune.tuned.script import KNOB_FLAGS, Framework, ScriptJob
from autotune.values import knobs_for


def user_script_job(
    script: str | Path | None,
    framework: str | None,
    args: Sequence[str],
    flags: tuple[str | None, str | None, str | None],
    *,
    simulate: str | None,
    device: str | Device,
) -> ScriptJob | None:
    """The user's training job a run probes, checked (None: autotune's stand-in); ``flags``:
    the script's own for the micro-batch, the accumulation and checkpointing."""
    if script is None:
        named = [KNOB_FLAGS[k][0] for k, f in zip(KNOB_FLAGS, flags, strict=True) if f]
        if framework is not None or args or named:
            what = (
                "--framework"
                if framework is not None
                else named[0]
                if named
                else "arguments after --"
            )
            raise ConfigError(f"{what} without --script: name your training script")
        return None
    if framework is None:
        choices = " or ".join(f.value for f in Framework)
        raise ConfigError(f"--script needs --framework: {choices}")
    if simulate is not None or not isinstance(device, str):
        raise ConfigError("--script probes your job for real: leave out --simulate")
    batch, accum, checkpointing = flags
    return ScriptJob.read(
        script,
        framework,
        args,
        batch,
        accum_flag=accum,
        checkpointing_flag=checkpointing,
        recognise=True,  # a script's own --batch-size, --grad-accum, ... by their names
    )


def user_script_model(job: ScriptJob) -> str:
    """The model a job names: the Trainer's ``--model_name_or_path`` when it is a local folder
    with a config.json."""
    found = flag_value(job.args, "model_name_or_path")
    if job.framework is Framework.HF and found and (Path(found) / "config.json").is_file():
        return found
    raise ConfigError(
        "give --model with --script: the preset or config.json of the model the script trains"
    )


def check_stand_in_only(job: ScriptJob, config: TrainConfig) -> None:
    """Refuse, in one line, a field of ``config`` that only autotune's stand-in has, for a
    probe of the user's script ``job``, which builds its own model, loss and optimizer.

    Raises:
        ConfigError: The first such field set: a loss other than the full one, 8-bit AdamW,
            activation offload (through :func:`knobs_for`, one home for their messages),
            op-level checkpointing, compiled blocks, LoRA.
    """
    knobs_for(job, (config.loss,), False, (config.optimizer,))
    knobs_for(job, None, False, None, activation_offload=config.act_offload)
    if config.ac_ops:
        raise ConfigError(
            "--ac ops is autotune's stand-in's checkpointing; your script checkpoints as its "
            "framework does: use --ac off, every or every-N with --script"
        )
    if config.torch_compile:
        raise ConfigError(
            "--compile compiles the blocks of autotune's stand-in; your script builds its own "
            "model: leave out --compile with --script (a Trainer takes torch_compile=True)"
        )
    if config.is_lora:
        raise ConfigError(
            "--lora-rank puts adapters on autotune's stand-in; your script builds its own "
            "model: leave out --lora-rank with --script (wrap it with peft there)"
        )
