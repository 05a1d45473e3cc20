"""What a study holds: the best point and the trials, exported as a trainer's configuration, and
the HTML report."""

from __future__ import annotations

import dataclasses
import datetime as dt
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.config import ConfigError, Engine, parse_choice
from autotune.handoff.launch import Format, Launch, knob_notes, render, value_notes
from autotune.handoff.megatron import megatron_notes
from autotune.handoff.script import job_command, shell_text
from autotune.handoff.torchtitan import torchtitan_notes
from autotune.models import ModelSpec, resolve_model
from autotune.outputs import check_output, write_new_file
from autotune.study.fingerprint import (
    DEFAULT_STORAGE,
    PROBE_METHOD,
    Fingerprint,
    software_versions,
)
from autotune.study.measurement import Measurement, StudyResult, best_point, pooled
from autotune.tuned.script import ScriptJob
from autotune.urls import masked
from autotune.values import positive_seconds


@dataclass(frozen=True, kw_only=True, slots=True)
class StudyFilter:
    """What a user knows of the study to read: each None matches every study."""

    model: str | None = None
    """A preset name, or the path its study was run with."""
    gpu: str | None = None
    """The GPU's catalogue key."""
    gpus: int | None = None
    """GPUs in all (every node's)."""
    seq_len: int | None = None
    global_batch: int | None = None

    def keeps(self, fingerprint: Fingerprint) -> bool:
        return (
            (self.gpu is None or fingerprint.gpu == self.gpu.lower())
            and (self.gpus is None or fingerprint.gpus == self.gpus)
            and (self.seq_len is None or fingerprint.seq_len == self.seq_len)
            and (self.global_batch is None or fingerprint.global_batch == self.global_batch)
        )


def _studies(
    storage: str, where: StudyFilter, last: int | None, with_best: bool = True
) -> list[StudyResult]:
    from autotune.study.reader import read_studies

    stores = read_studies(storage, last=last, best=with_best)
    if where.model:
        # A path names its study by the folder that holds the config, as `run` does.
        model = where.model
        name = model if model in {s.fingerprint.model for s in stores} else None
        if name is None:
            try:
                name = resolve_model(model).name
            except ValueError:
                name = model
        stores = [s for s in stores if s.fingerprint.model == name]
    stores = [s for s in stores if where.keeps(s.fingerprint)]
    if not stores:
        raise ConfigError(f"no autotune study in {masked(storage)} matches: run autotune run first")
    return stores


def best(
    *,
    model: str | None = None,
    gpu: str | None = None,
    gpus: int | None = None,
    seq_len: int | None = None,
    global_batch: int | None = None,
    storage: str = DEFAULT_STORAGE,
    last: int | None = None,
) -> list[StudyResult]:
    """The best configuration of each matching study (what a training launcher reads).

    Args:
        model, gpu, gpus, seq_len, global_batch: Only the studies of this model (a preset
            name, or the path its study was run with), GPU key, GPUs in all, sequence length
            and global batch (None: any).
        last: Decode only each study's last ``last`` trials into ``measurements`` (0: none,
            the fastest read of the best); None: every trial. ``best`` and ``trial_count``
            are over every trial either way.

    Raises:
        ConfigError: When no study matches.
    """
    where = StudyFilter(model=model, gpu=gpu, gpus=gpus, seq_len=seq_len, global_batch=global_batch)
    return _studies(storage, where, last)


def trials(
    *,
    model: str | None = None,
    gpu: str | None = None,
    gpus: int | None = None,
    seq_len: int | None = None,
    global_batch: int | None = None,
    storage: str = DEFAULT_STORAGE,
    last: int | None = None,
    best: bool = True,
) -> list[StudyResult]:
    """Every trial of each matching study, or its ``last`` trials by number.

    Args:
        model, gpu, gpus, seq_len, global_batch: As :func:`best` selects studies.
        best: Fill in each study's ``best`` too, over every trial (else it is None, and a
            read of the last trials of a large study is faster).
    """
    where = StudyFilter(model=model, gpu=gpu, gpus=gpus, seq_len=seq_len, global_batch=global_batch)
    return _studies(storage, where, last, best)


@dataclass(frozen=True, kw_only=True)
class Export:
    """A measured configuration in a trainer's format: the text, and what it was made of."""

    study: str
    """The study's name."""
    measurement: Measurement
    """The trial exported (the best point's latest trial, pooled, unless one was named)."""
    launch: Launch
    format: Format
    text: str
    notes: list[str] = dataclasses.field(default_factory=list)
    """What the format cannot carry of the configuration, and what to do instead."""
    chosen: str | None = None
    """Why this study, where several matched (None: it was the only one)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "study": self.study,
            "chosen": self.chosen,
            "trial": self.measurement.number,
            "format": self.format.value,
            "model": self.launch.model,
            "config": self.launch.config.to_dict(),
            "label": self.launch.config.label(),
            "micro_batch_size": self.launch.micro_batch_size,
            "grad_accum": self.launch.grad_accum,
            "world_size": self.launch.world_size,
            "nodes": self.launch.nodes,
            "seq_len": self.launch.seq_len,
            "global_batch": self.launch.global_batch,
            "text": self.text,
            "notes": list(self.notes),
        }


def export(
    format: Format | str,
    *,
    model: str | None = None,
    gpu: str | None = None,
    gpus: int | None = None,
    seq_len: int | None = None,
    global_batch: int | None = None,
    study: str | None = None,
    storage: str = DEFAULT_STORAGE,
    trial: int | None = None,
    engine: Engine | str | None = None,
) -> Export:
    """The best configuration of the matching study, as a trainer's own configuration.

    Args:
        format: ``deepspeed``, ``accelerate``, ``hf``, ``torchrun``, ``fsdp``, ``megatron`` or
            ``torchtitan`` (see
            :class:`~autotune.handoff.launch.Format`).
        model: Only studies of this model (a preset name, or the path its study was run
            with: the model's shape is read from it).
        gpu, gpus, seq_len, global_batch: Only studies on this GPU key, GPUs in all,
            sequence length and global batch.
        study: The study's name. Without it, studies of one workload that differ only in
            their software are read as :func:`choose_study` says: the one measured on this
            node's software, else the newest.
        trial: Export this trial (by number) instead of the best; it must have fit.
        engine: Export the best configuration of this engine (``deepspeed`` for a DeepSpeed
            JSON where the study's best is FSDP, say).

    Raises:
        ConfigError: When the format is unknown or cannot express the configuration, when no
            study matches or several of different workloads do, when the trial is missing or
            did not fit, or when no configuration of the engine fits.
    """
    try:
        chosen = Format(format)
    except ValueError:
        choices = ", ".join(f.value for f in Format)
        raise ConfigError(f"unknown export format {format!r}: use one of {choices}") from None
    if trial is not None and engine is not None:
        raise ConfigError("--trial and --engine: a trial has its engine; give one of them")
    wanted = parse_choice(Engine, engine, "engine")
    where = StudyFilter(model=model, gpu=gpu, gpus=gpus, seq_len=seq_len, global_batch=global_batch)
    found, why = _one_study(storage, where, study, 0 if trial is None and wanted is None else None)
    if wanted is not None:
        measurement = best_point([m for m in found.measurements if m.config.engine is wanted])
        if measurement is None:
            raise ConfigError(
                f"no {wanted.value} configuration of {found.study_name} fits yet: autotune "
                "trials lists what was measured"
            )
    else:
        measurement = found.best if trial is None else _trial(found, trial)
    if measurement is None:
        raise ConfigError(
            f"no configuration of {found.study_name} fits yet: run autotune run, or pick a "
            "trial with --trial N"
        )
    spec = _model_of(found.fingerprint.model, model)
    launch = _launch(found, measurement, spec)
    try:
        text = _render(found, launch, chosen)
    except ConfigError as refused:
        if trial is not None or wanted is not None:
            raise
        # The best cannot be written in this format: name the best that can, by its trial.
        everything = next(
            s for s in _studies(storage, where, None, False) if s.study_name == found.study_name
        )
        raise ConfigError(f"{refused}{_writable(everything, spec, chosen)}") from None
    return Export(
        study=found.study_name,
        measurement=measurement,
        launch=launch,
        format=chosen,
        text=text,
        notes=knob_notes(launch, chosen)
        + value_notes(launch, chosen)
        + (megatron_notes(launch) if chosen is Format.MEGATRON else [])
        + (torchtitan_notes(launch) if chosen is Format.TORCHTITAN else []),
        chosen=why,
    )


def _writable(found: StudyResult, spec: ModelSpec, fmt: Format) -> str:
    """The fastest point ``fmt`` can write, as the way out of a refusal of the best:
    ``; the best megatron can write: trial 12, fsdp z3 ac:every at micro-batch 2 (...):
    --trial 12`` (its latest trial), or that none measured can be written."""
    for point in sorted(pooled(found.measurements), key=lambda m: m.value or 0.0, reverse=True):
        try:
            _render(found, _launch(found, point, spec), fmt)
        except ConfigError:
            continue
        speed = found.fingerprint.objective.text(point.value)
        return (
            f"; the best {fmt.value} can write: trial {point.number}, {point.config.label()} "
            f"at micro-batch {point.micro_batch_size} ({speed}): --trial {point.number}"
        )
    return f"; no configuration measured in {found.study_name} can be written as {fmt.value}"


def _render(found: StudyResult, launch: Launch, fmt: Format) -> str:
    """A study's configuration in ``fmt``; ``command``: the study's own script, run with it.
    ``torchrun`` launches autotune's stand-in: refused for a study of the user's script (its
    own arguments, engine, precision and optimizer are the script's, which that line would
    not hold)."""
    script = found.fingerprint.script
    if fmt is Format.TORCHRUN and script is not None:
        framework = ScriptJob.from_dict(script).framework.value
        raise ConfigError(
            f"--format torchrun launches autotune's stand-in, and {found.study_name} probed "
            f"your {framework} script: use --format command (your script's command line, "
            "tuned)"
        )
    if fmt is not Format.COMMAND or script is None:
        return render(launch, fmt)
    command = job_command(  # its secrets read from variables the user sets
        ScriptJob.from_dict(script).for_shell(), launch, cpu=found.fingerprint.device == "cpu"
    )
    return shell_text(command, launch, launch.summary())


def _one_study(
    storage: str, where: StudyFilter, study: str | None, last: int | None
) -> tuple[StudyResult, str | None]:
    """The study ``export`` and ``report`` read (by name, else as :func:`choose_study`
    chooses among those ``where`` keeps), and why it, where several matched."""
    studies = _studies(storage, where, last)
    if study is not None:
        studies = [s for s in studies if s.study_name == study]
        if not studies:
            raise ConfigError(
                f"no study named {study!r} matches in {masked(storage)}: autotune best lists them"
            )
    return choose_study(studies, software_versions())


_PICKED_BY = {
    "model": "--model",
    "gpu": "--gpu",
    "gpus": "--gpus",
    "seq_len": "--seq-len",
    "global_batch": "--global-batch",
}
"""The options that pick a study by a field of its fingerprint."""

_SOFTWARE_FIELDS = frozenset({"software", "method"})
"""The fields of a fingerprint that tell when (with what) a workload was measured, not what."""


def choose_study(
    studies: list[StudyResult], current: dict[str, str]
) -> tuple[StudyResult, str | None]:
    """One of several matching studies, and why it (None: it was the only one).

    Studies of one workload (model, shape, hardware, job) that differ only in the software
    they were measured with (before and after an upgrade) are one question asked again: the
    study measured on ``current`` (this node's torch, DeepSpeed and transformers) is read,
    else the newest, among those in which something fits if any does. Studies of different
    workloads are different answers: refused, with the options that pick one.

    Raises:
        ConfigError: When the matching studies differ in more than their software.
    """
    if len(studies) == 1:
        return studies[0], None
    questions = {_question(s.fingerprint) for s in studies}
    if len(questions) > 1:
        raise ConfigError(_pick_one(studies, len(questions)))
    fitting = [s for s in studies if s.best is not None] or studies
    oldest = dt.datetime.min

    def on_this_node(s: StudyResult) -> bool:
        return all(s.fingerprint.software.get(k) == v for k, v in current.items()) and (
            s.fingerprint.method == PROBE_METHOD
        )

    found = max(fitting, key=lambda s: (on_this_node(s), s.updated or oldest))
    n = len(studies)
    if on_this_node(found):
        why = f"the one of {n} studies of this workload measured on this node's software"
    else:
        why = f"the newest of {n} studies of this workload (none measured on this node's software)"
    if len(fitting) < n:
        why += f"; {n - len(fitting)} with nothing fitting left aside"
    return found, why


_WORKLOAD_FIELDS = tuple(
    f.name for f in dataclasses.fields(Fingerprint) if f.name not in _SOFTWARE_FIELDS
)
"""The fields of a fingerprint that say what workload a study measures."""


def _question(fingerprint: Fingerprint) -> tuple[str, ...]:
    """A fingerprint without its software: the workload a study measures."""
    return tuple(repr(getattr(fingerprint, f)) for f in _WORKLOAD_FIELDS)


def _pick_one(studies: list[StudyResult], workloads: int) -> str:
    """The line that refuses studies of ``workloads`` different workloads, with the options
    that pick one (``--study NAME`` where those options cannot tell them apart)."""
    values = {
        f: list(dict.fromkeys(getattr(s.fingerprint, f) for s in studies)) for f in _WORKLOAD_FIELDS
    }
    differ = [f for f in _WORKLOAD_FIELDS if len(values[f]) > 1]
    what = ", ".join(f.replace("_", " ") for f in differ)
    picked = [f for f in differ if f in _PICKED_BY]
    told = {tuple(getattr(s.fingerprint, f) for f in picked) for s in studies}
    if picked and len(told) == workloads:
        options = " and ".join(
            f"{_PICKED_BY[f]} ({' or '.join(str(v) for v in values[f])})" for f in picked
        )
        return f"{len(studies)} studies match, of different {what}: pick one with {options}"
    return (
        f"{len(studies)} studies match, of different {what}: pick one with --study NAME "
        "(autotune best --json lists their names)"
    )


def _launch(found: StudyResult, measurement: Measurement, spec: ModelSpec) -> Launch:
    """How to launch a measured configuration of a study."""
    fingerprint = found.fingerprint
    return Launch(
        model=fingerprint.model,
        hidden_size=spec.hidden_size,
        config=measurement.config,
        micro_batch_size=measurement.micro_batch_size,
        grad_accum=measurement.grad_accum
        or fingerprint.workload.grad_accum(measurement.micro_batch_size),
        world_size=fingerprint.gpus,
        nodes=fingerprint.nodes,
        seq_len=fingerprint.seq_len,
        transformers=fingerprint.software.get("transformers"),
        simulated=measurement.simulated or fingerprint.device == "simulated",
        spec=spec,
    )


@dataclass(frozen=True, kw_only=True)
class Report:
    """An HTML report written: where, and of which study."""

    path: Path
    study: str
    """The study's name."""
    chosen: str | None = None
    """Why this study, where several matched (None: it was the only one)."""

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "study": self.study, "chosen": self.chosen}


def write_report(
    output: str | Path,
    *,
    model: str | None = None,
    gpu: str | None = None,
    gpus: int | None = None,
    seq_len: int | None = None,
    global_batch: int | None = None,
    study: str | None = None,
    storage: str = DEFAULT_STORAGE,
    budget: str | float | None = None,
    force: bool = False,
) -> Report:
    """Write the matching study as one self-contained HTML page (works offline): memory per
    GPU of each configuration (predicted breakdown and measured peak), tokens/s and MFU
    against micro-batch, the search's path, the best configuration with its launch, and
    every probe with a link to its folder.

    Args:
        output: The HTML file to write.
        model: Only studies of this model (a preset name, or the path its study was run
            with).
        gpu, gpus, seq_len, global_batch: Only studies on this GPU key, GPUs in all,
            sequence length and global batch.
        study: The study's name; without it, chosen as :func:`export` chooses.
        budget: The search's budget (``"30m"``), drawn on the search's chart.
        force: Overwrite ``output`` if it exists.

    Raises:
        ConfigError: When no study matches or several of different workloads do, ``output``
            exists without ``force``, or it cannot be written.
    """
    from autotune.report.html import read_trial_times, render_html

    path = Path(output)
    check_output(path, force=force)
    budget_s = None if budget is None else positive_seconds(budget, "the budget")
    where = StudyFilter(model=model, gpu=gpu, gpus=gpus, seq_len=seq_len, global_batch=global_batch)
    found, why = _one_study(storage, where, study, None)
    spec = _model_of(found.fingerprint.model, model)
    launches: dict[str, str] = {}
    if found.best is not None:
        launch = _launch(found, found.best, spec)
        for fmt in Format:
            try:
                launches[fmt.value] = _render(found, launch, fmt)
            except ConfigError:
                continue  # a format that cannot express this engine
    text = render_html(
        found,
        model=spec,
        launches=launches,
        times=read_trial_times(storage, found.study_name),
        budget_s=budget_s,
    )
    write_new_file(path, text, force=force)
    return Report(path=path, study=found.study_name, chosen=why)


def _trial(found: StudyResult, number: int) -> Measurement:
    """Trial ``number`` of a study, which must have fit."""
    match = next((m for m in found.measurements if m.number == number), None)
    if match is None:
        raise ConfigError(
            f"{found.study_name} has no trial {number}: autotune trials lists its trials"
        )
    if not match.feasible:
        raise ConfigError(
            f"trial {number} of {found.study_name} did not fit ({match.outcome or match.state}): "
            "export a trial that fit, or the best without --trial"
        )
    return match


def _model_of(name: str, given: str | None) -> ModelSpec:
    """The shape of a study's model: from the path it was run with, else its preset."""
    for candidate in (given, name):
        if candidate is None:
            continue
        try:
            return resolve_model(candidate)
        except ValueError:
            continue
    raise ConfigError(
        f"the study's model {name!r} is not a preset: pass --model path/to/config.json, the "
        "config it was run with"
    )
