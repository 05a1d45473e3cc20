"""Nightly jobs: many workloads from one YAML file, each re-tuned only when something changed.

A job file lists workloads under a top-level ``workloads:`` key, each a mapping whose fields
are named as ``autotune run``'s options (``model``, ``seq_len``, ``global_batch``, ``gpus``,
``engine``, ``headroom``, ``budget``, ...; ``seq-len`` is read as ``seq_len``)::

    workloads:
      - model: llama-7b
        seq_len: 4096
        global_batch: 256
        budget: 45m
      - model: qwen2.5-1.5b
        engine: fsdp,deepspeed

Options given on the command line apply to every workload that does not set them. Values are
written out: YAML's anchors and aliases (``&x``, ``*x``) are refused, and ``hosts`` is a list
of host names, each checked as ``--hosts`` checks it.

A workload is tuned again only when its study has no result for what is installed now (the
study's fingerprint: torch, DeepSpeed and transformers versions, the GPU, its driver, the
number of GPUs and nodes), or when that result is older than ``--max-age``:
:func:`freshness` decides, a pure function of the fingerprint, the studies already in the
storage and the time.

Pure and light: YAML parsing and the decision import no torch and open no database.
"""

from __future__ import annotations

import datetime as dt
import difflib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.config import (
    DEVICES,
    Attention,
    ConfigError,
    Precision,
    parse_choice,
    parse_losses,
    parse_optimizers,
)
from autotune.hardware import gpu_spec
from autotune.models import resolve_model
from autotune.probe.nodes import check_host
from autotune.study.fingerprint import Fingerprint
from autotune.study.measurement import Measurement, StudyResult
from autotune.tuned.script import Framework, ScriptJob, masked_args
from autotune.units import format_bytes, format_duration
from autotune.urls import masked
from autotune.values import (
    count_value,
    engines_value,
    fraction_value,
    objective_value,
    positive_seconds,
    size_bytes,
)

if TYPE_CHECKING:
    from autotune.search.controller import RunSummary

__all__ = ["FIELDS", "Freshness", "Job", "JobResult", "freshness", "read_jobs"]

FIELDS: dict[str, tuple[type, ...]] = {
    "model": (str,),
    "budget": (str, int, float),  # numbers are refused with a word: durations take a unit
    "seq_len": (int,),
    "global_batch": (int,),
    "gpus": (int,),
    "nodes": (int,),
    "hosts": (str, list),
    "engine": (str, list),
    "precision": (str,),
    "attention": (str,),
    "loss": (str, list),
    "ac_ops": (bool,),
    "optimizer": (str, list),
    "lora_rank": (int,),  # LoRA allowed at this rank (run --allow lora --lora-rank)
    "act_offload": (bool,),
    "headroom": (str, int, float),
    "host_memory": (str, int),  # numbers are refused with a word: sizes take a unit
    "host_cores": (int,),
    "device_memory": (str, int),
    "objective": (str,),
    "simulate": (str,),
    "device": (str,),
    "storage": (str,),
    "trials_dir": (str,),
    "seed": (int,),
    "warm": (bool,),
    "script": (str,),
    "framework": (str,),
    "args": (list,),
    "batch_flag": (str,),
    "accum_flag": (str,),
    "checkpointing_flag": (str,),
}
"""The fields a workload may set (``autotune run``'s options) and the YAML types each takes."""

_TYPE_NAMES = {
    str: "text",
    int: "an integer",
    float: "a number",
    list: "a list",
    bool: "true/false",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    """One workload of a job file, with the command line's options merged in."""

    index: int
    """Its position in the file, from 1."""
    line: int
    """The line of the file it starts on, from 1."""
    options: Mapping[str, Any]
    """``autotune run``'s options by their Python names (``seq_len``): the workload's own,
    then the command line's for those it does not set."""
    own: frozenset[str] = frozenset()
    """The fields the workload set itself."""

    @property
    def model(self) -> str:
        return str(self.options["model"])

    def label(self) -> str:
        """``llama-7b seq 4096 gbs 256`` and whatever else the workload set itself."""
        parts = [self.model]
        for key in sorted(self.own - {"model"}):
            value = _text(_shown(key, self.options[key]))
            parts.append(f"{key.replace('_', '-')} {value}")
        return " ".join(parts)


def _text(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def _shown(key: str, value: Any) -> Any:
    """An option as a job's label and ``--json`` show it: a storage URL's secrets masked, and
    those among the script's arguments (:func:`~autotune.tuned.script.masked_args`)."""
    if key == "storage" and isinstance(value, str):
        return masked(value)
    if key == "args" and isinstance(value, list | tuple):
        return list(masked_args([str(arg) for arg in value]))
    return value


MAX_JOB_FILE_BYTES = 256 << 10
"""The largest job file read (256 KiB): a workload is a few lines, so a job file of
:data:`MAX_WORKLOADS` fits in tens of KB; a larger one is not a job file someone wrote (and
YAML's parser takes seconds a megabyte)."""

MAX_JOB_DEPTH = 16
"""The deepest nesting of lists and mappings read in a job file: a workload's values nest
four deep (``workloads:``, the workload, its ``hosts:`` or ``args:``). YAML's parser takes time
quadratic in the depth, and composing deeper nesting overflows Python's recursion."""


MAX_WORKLOADS = 256
"""The most workloads a job file holds: each is a tuning run of its own (minutes to hours of
budget), so a night holds tens, and every one is checked before the first runs."""


def read_jobs(path: Path, defaults: Mapping[str, Any]) -> list[Job]:
    """The workloads of a job file, each merged with ``defaults`` (the command line's).

    Raises:
        ConfigError: One line naming the file, the line and the field, for a file that
            cannot be read, is not YAML, has no ``workloads:`` list, or holds a workload with
            an unknown field, a value of the wrong type, or a value that does not parse
            (a size, a duration, a fraction, an engine).
    """
    import yaml

    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_JOB_FILE_BYTES + 1)
        if len(data) > MAX_JOB_FILE_BYTES:
            raise ConfigError(
                f"{path} is larger than a job file ({format_bytes(path.stat().st_size)}, where "
                f"job files are at most {format_bytes(MAX_JOB_FILE_BYTES)}): split its "
                "workloads over several files"
            )
        text = data.decode("utf-8")
    except OSError as error:
        raise ConfigError(f"cannot read the job file {path}: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{path}: not a text file in UTF-8 (byte {error.start}): a job file is YAML text"
        ) from None
    try:
        # The events one by one (PyYAML's own parser: libyaml's reads ahead, past any depth
        # bound), then the nodes by libyaml's where PyYAML has it (ten times as fast).
        _refuse_anchors_and_depth(yaml.parse(text, Loader=yaml.SafeLoader), path)
        root = yaml.compose(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        # An end of file met early is said at the file's last line (libyaml's mark is past it).
        last = max(1, len(text.splitlines()))
        where = f"{path}:{min(mark.line + 1, last)}" if mark is not None else str(path)
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML ({problem})") from None
    if not isinstance(root, yaml.MappingNode):
        line = root.start_mark.line + 1 if root is not None else 1
        raise ConfigError(f"{path}:{line}: a job file is a mapping with a workloads: list")
    entries: dict[str, tuple[Any, Any]] = {}
    for key, value in root.value:
        if key.value in entries:
            raise ConfigError(
                f"{path}:{key.start_mark.line + 1}: {key.value}: is set twice (the second would "
                "silently replace the first): keep one, with every workload under it"
            )
        entries[key.value] = (key, value)
    unknown = sorted(set(entries) - {"workloads"})
    if unknown:
        key = entries[unknown[0]][0]
        raise ConfigError(
            f"{path}:{key.start_mark.line + 1}: unknown top-level key {unknown[0]!r}: a job "
            "file holds only workloads:"
        )
    if "workloads" not in entries:
        raise ConfigError(f"{path}:1: no workloads: list (one mapping per workload, model: set)")
    node = entries["workloads"][1]
    if not isinstance(node, yaml.SequenceNode) or not node.value:
        raise ConfigError(
            f"{path}:{node.start_mark.line + 1}: workloads: must be a list of at least one "
            "mapping (- model: llama-7b)"
        )
    if len(node.value) > MAX_WORKLOADS:
        raise ConfigError(
            f"{path}:{node.start_mark.line + 1}: {len(node.value):,} workloads, where a job file "
            f"holds at most {MAX_WORKLOADS} (each is a tuning run of its own): split them over "
            "several files"
        )
    loader = yaml.SafeLoader("")
    jobs = []
    for index, item in enumerate(node.value, start=1):
        line = item.start_mark.line + 1
        where = f"{path}:{line}: workload {index}"
        if not isinstance(item, yaml.MappingNode):
            raise ConfigError(f"{where}: not a mapping of fields (- model: llama-7b)")
        own: dict[str, Any] = {}
        for key_node, value_node in item.value:
            key = str(key_node.value).replace("-", "_")
            at = f"{path}:{key_node.start_mark.line + 1}: workload {index}"
            if key not in FIELDS:
                near = difflib.get_close_matches(key, FIELDS, n=1)
                hint = f"did you mean {near[0]}?" if near else "fields: " + ", ".join(FIELDS)
                raise ConfigError(f"{at}: unknown field {key_node.value!r}: {hint}")
            if key in own:
                raise ConfigError(f"{at}: {key} is set twice")
            try:
                value = loader.construct_object(value_node, deep=True)
            except yaml.YAMLError as error:
                problem = getattr(error, "problem", None) or str(error).splitlines()[0]
                raise ConfigError(f"{at}: {key}: {problem} (plain values only)") from None
            own[key] = _checked(key, value, at)
        if "model" not in own:
            raise ConfigError(f"{where}: no model: every workload names its model")
        script_fields = ("framework", "args", "batch_flag", "accum_flag", "checkpointing_flag")
        if any(name in own for name in script_fields) and "script" not in own:
            raise ConfigError(f"{where}: {', '.join(script_fields)} go with a script:")
        if "script" in own:
            if "framework" not in own:
                choices = " or ".join(f.value for f in Framework)
                raise ConfigError(f"{where}: a script: needs its framework: {choices}")
            try:
                ScriptJob.read(
                    str(own["script"]),
                    own["framework"],
                    own.get("args") or (),
                    own.get("batch_flag"),
                    accum_flag=own.get("accum_flag"),
                    checkpointing_flag=own.get("checkpointing_flag"),
                )
            except ConfigError as error:
                raise ConfigError(f"{where}: {error}") from None
        try:
            resolve_model(str(own["model"]))
        except ValueError as error:
            raise ConfigError(f"{where}: {error}") from None
        options = {**{k: v for k, v in defaults.items() if v is not None}, **own}
        jobs.append(Job(index=index, line=line, options=options, own=frozenset(own)))
    loader.dispose()
    return jobs


def _refuse_anchors_and_depth(events: Iterable[Any], path: Path) -> None:
    """Refuse the first anchor (``&x``) or alias (``*x``) of a job file's YAML events, and
    the first list or mapping nested deeper than :data:`MAX_JOB_DEPTH`, as the parser reads
    them, before any node is composed or value constructed: a few hundred bytes of aliases
    nested a few levels deep stand for gigabytes of values, and a job file's values are short
    enough to write out.

    Raises:
        ConfigError: One line with the file, the line and what to do.
    """
    import yaml

    depth = 0
    for event in events:
        if isinstance(event, yaml.NodeEvent) and event.anchor is not None:
            raise ConfigError(
                f"{path}:{event.start_mark.line + 1}: anchors and aliases (&x, *x) are not read "
                "in job files: write the values out"
            )
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_JOB_DEPTH:
                raise ConfigError(
                    f"{path}:{event.start_mark.line + 1}: lists and mappings nested more than "
                    f"{MAX_JOB_DEPTH} deep: a job file's values nest four deep (workloads:, "
                    "a workload, its hosts: or args:)"
                )
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def _checked(key: str, value: Any, at: str) -> Any:
    """A field's value, checked for its type and parsed where it has units."""
    types = FIELDS[key]
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        wanted = " or ".join(_TYPE_NAMES[t] for t in types)
        raise ConfigError(f"{at}: {key} must be {wanted}, not {value!r}")
    try:
        if key == "budget":
            if not isinstance(value, str):
                raise ConfigError(f"budget {value!r} has no unit: write it like 45m, 90s or 1h30m")
            positive_seconds(value, "budget")
        if key in ("device_memory", "host_memory") and isinstance(value, int):
            raise ConfigError(f"{key} {value!r} has no unit: write it like 40GiB")
        if key in ("device_memory", "host_memory"):
            size_bytes(str(value), key)
        if key == "headroom":
            fraction_value(str(value), "headroom")
        if key == "objective":
            objective_value(str(value))
        if key == "device" and value not in DEVICES:
            raise ConfigError(f"unknown device {value!r}: use {', '.join(DEVICES)}")
        if key == "simulate":
            gpu_spec(str(value))
        if key in ("precision", "attention"):
            parse_choice(Precision if key == "precision" else Attention, str(value), key)
        if key == "engine":
            names = [str(x) for x in value] if isinstance(value, list) else str(value)
            value = ",".join(e.value for e in engines_value(names) or ())
        if key == "loss":
            value = ",".join(x.value for x in parse_losses(value) or ())
        if key == "optimizer":
            value = ",".join(x.value for x in parse_optimizers(value) or ())
        if key == "hosts":
            names = value if isinstance(value, list) else value.split(",")
            if not all(isinstance(name, str) for name in names):
                raise ConfigError(
                    f"hosts must be host names, like [this-host, node2], not {value!r}"
                )
            value = ",".join(check_host(name.strip()) for name in names)
        if key == "script":
            ScriptJob.read(str(value), Framework.TORCHRUN)  # it exists and can be read
        if key == "framework":
            parse_choice(Framework, str(value), key)
        if key == "args":
            if not all(isinstance(a, str | int | float) and not isinstance(a, bool) for a in value):
                raise ConfigError("args must be a list of the script's arguments, as text")
            value = [str(a) for a in value]
        if key in ("seq_len", "global_batch", "gpus", "nodes", "host_cores"):
            count_value(value, key)
    except ConfigError as error:
        raise ConfigError(f"{at}: {error}") from None
    except ValueError as error:
        raise ConfigError(f"{at}: {key}: {error}") from None
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class Freshness:
    """Whether a workload is tuned tonight, and why, in words."""

    tune: bool
    why: str
    again: bool = False
    """Measure the study again, as its next generation (its result is older than
    ``--max-age``): the search starts afresh, beside the earlier trials."""


_COMPARED = ("gpu", "gpus", "nodes", "device", "gpu_memory_bytes")


def freshness(
    fingerprint: Fingerprint,
    studies: Sequence[StudyResult],
    *,
    now: dt.datetime,
    max_age_s: float | None = None,
) -> Freshness:
    """Tune again, or keep the result already stored?

    Kept when a study of exactly this fingerprint holds a configuration that fits and its
    newest trial is no older than ``max_age_s`` (None: any age). Otherwise tuned, and
    ``why`` names what changed since the most recent study of the same workload (model,
    sequence length, global batch, objective): a version, the GPU, its driver, the GPU or
    node count.
    """
    name = fingerprint.study_name
    same = next((s for s in studies if s.study_name == name), None)
    if same is not None and same.best is not None:
        age = None if same.updated is None else (now - same.updated).total_seconds()
        if max_age_s is not None and (age is None or age > max_age_s):
            old = "of unknown age" if age is None else f"{format_duration(age)} old"
            return Freshness(
                tune=True,
                why=f"its result is {old} (--max-age {format_duration(max_age_s)}): measured again",
                again=True,
            )
        when = "" if age is None else f" {format_duration(max(age, 0.0))} ago"
        return Freshness(
            tune=False,
            why=f"unchanged since it was tuned{when}: same software, GPU, driver and node count",
        )
    if same is not None:
        return Freshness(tune=True, why="its study holds no configuration that fits yet")
    workload = (fingerprint.model, fingerprint.seq_len, fingerprint.global_batch)
    earlier = [
        s
        for s in studies
        if (s.fingerprint.model, s.fingerprint.seq_len, s.fingerprint.global_batch) == workload
        and s.fingerprint.objective is fingerprint.objective
    ]
    if not earlier:
        return Freshness(tune=True, why="never tuned")
    latest = max(earlier, key=lambda s: s.updated or dt.datetime.min)
    changes = _changes(latest.fingerprint, fingerprint)
    return Freshness(tune=True, why="changed since it was tuned: " + ", ".join(changes))


def _changes(before: Fingerprint, now: Fingerprint) -> list[str]:
    """What differs between two fingerprints of one workload, as ``torch 2.13.0 -> 2.14.1``."""
    changes = []
    for key in sorted(set(before.software) | set(now.software)):
        old, new = before.software.get(key, "none"), now.software.get(key, "none")
        if old != new:
            changes.append(f"{key} {old} -> {new}")
    for field in _COMPARED:
        old, new = getattr(before, field), getattr(now, field)
        if old != new:
            if field == "gpu_memory_bytes":
                field, old, new = "memory per GPU", format_bytes(old), format_bytes(new)
            changes.append(f"{field} {old} -> {new}")
    if before.script != now.script:
        changes.append(_script_change(before.script, now.script))
    return changes or ["its study's name"]


def _script_change(before: Mapping[str, Any] | None, now: Mapping[str, Any] | None) -> str:
    """How the job a workload runs changed: its script's content, its arguments, or the
    job itself (the stand-in, another script)."""
    if before is None or now is None:
        return f"the job {_job_name(before)} -> {_job_name(now)}"
    old, new = ScriptJob.from_dict(before), ScriptJob.from_dict(now)
    if old.path != new.path:
        return f"the script {old.path} -> {new.path}"
    if old.sha256 != new.sha256:
        return f"the script {new.name} changed (sha256 {old.sha256[:8]} -> {new.sha256[:8]})"
    return f"the arguments of {new.name}"


def _job_name(script: Mapping[str, Any] | None) -> str:
    return "autotune's stand-in" if script is None else ScriptJob.from_dict(script).name


@dataclass(frozen=True, kw_only=True)
class JobResult:
    """What became of one workload of a job file."""

    job: Job
    status: str
    """``tuned`` (a configuration fits), ``no fit``, ``skipped`` (unchanged: the stored
    result stands), ``failed`` (it could not run: ``why`` says so) or ``interrupted``."""
    why: str
    """Why it was tuned or skipped, or what failed."""
    study: str | None = None
    summary: RunSummary | None = None
    """The run's summary, when it ran."""
    best: Measurement | None = None
    """The best configuration: this run's, or the stored one a skipped workload keeps."""

    @property
    def failed(self) -> bool:
        """Whether a scheduler should hear of it: it could not run, or nothing fits."""
        return self.status in ("failed", "no fit")

    def to_dict(self) -> dict[str, Any]:
        best = self.best
        return {
            "workload": self.job.index,
            "line": self.job.line,
            "label": self.job.label(),
            "options": {key: _shown(key, value) for key, value in self.job.options.items()},
            "status": self.status,
            "why": self.why,
            "study": self.study,
            "run": None if self.summary is None else self.summary.to_dict(),
            "best": None if best is None else best.to_dict(),
        }
