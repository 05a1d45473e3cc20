"""What a study is about: the workload, the hardware and the software it was measured on.

A throughput measured with torch 2.13 on 8 H100s says nothing certain about torch 2.14 or 4
A100s, so each combination gets its own study, with a name people can read in
optuna-dashboard (``llama-7b/seq2048/gbs512@8xH100-80GB``) and the whole fingerprint stored
in the study's attributes.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.metadata
from dataclasses import dataclass
from typing import Any

from autotune.config import ConfigError
from autotune.space import Workload
from autotune.tuned.script import ScriptJob

__all__ = ["DEFAULT_STORAGE", "PROBE_METHOD", "Fingerprint", "Objective", "software_versions"]

DEFAULT_STORAGE = "sqlite:///trials/autotune.db"
"""Where studies live unless ``--storage`` says otherwise (relative to the working folder)."""


PROBE_METHOD = 2
"""How the probes measure, stored with each study: 1, autotune's stand-in at accumulation 1 (its
optimizer step freed the gradients before the next forward); 2, every probe accumulating as
training does, up to 2 micro-steps (``ProbeSpec.accumulation``), so the peak holds the
gradients kept between micro-steps. Measurements of another method are another study, so a
study of method 1 is measured again rather than mixed with method 2's."""


class Objective(enum.StrEnum):
    """What a study maximizes (one study per objective)."""

    TOKENS = "tokens"
    """Tokens per second, all ranks together, at the user's global batch."""
    MFU = "mfu"
    """Model FLOPs utilization: needs the GPU's peak FLOP/s (none on the CPU)."""

    def text(self, value: float | None) -> str:
        """``74,270 tokens/s`` or ``MFU 43.2%`` (``-`` without a value)."""
        if value is None:
            return "-"
        return f"{value:,.0f} tokens/s" if self is Objective.TOKENS else f"MFU {value:.1%}"


_SOFTWARE = ("torch", "deepspeed", "transformers")


def software_versions() -> dict[str, str]:
    """Installed versions of the packages whose speed and memory a probe measures."""
    versions = {}
    for package in _SOFTWARE:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "none"
    return versions


def _compact_bytes(n: int) -> str:
    """``4MiB``, ``20GiB``, ``1536KiB``: the largest binary unit that divides ``n``."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"


_WHOLE_NUMBERS = (
    "seq_len", "global_batch", "gpu_memory_bytes", "gpus", "nodes", "method", "model_parallel",
)  # fmt: skip
"""The fields of a fingerprint that are whole numbers of 1 or more."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Fingerprint:
    """Workload × hardware × software: one study each."""

    model: str
    seq_len: int
    global_batch: int
    objective: Objective = Objective.TOKENS
    gpu: str
    """Catalogue key (``h100-80gb``), ``cpu``, or the simulated GPU's key."""
    gpu_memory_bytes: int
    """Memory per device a probe may use (the emulated cap when there is one)."""
    capped: bool = False
    """Whether ``gpu_memory_bytes`` is a cap the user set (``--device-memory``) rather than
    the card's own: measurements under another cap are another study."""
    gpus: int
    nodes: int = 1
    device: str = "cuda"
    """``cuda``, ``cpu`` (real CPU probes) or ``simulated`` (the estimator)."""
    software: dict[str, str] = dataclasses.field(default_factory=software_versions)
    """torch, DeepSpeed and transformers versions, and on GPUs the NVIDIA driver's."""
    precision: str | None = None
    """The precision the user asked for (``--precision``); None: the GPU's default. Another
    precision is another question, so another study."""
    attention: str | None = None
    """The attention kernel the user asked for; None: ``sdpa``, the default."""
    script: dict[str, Any] | None = None
    """The user's training job the probes ran (a :class:`~autotune.tuned.script.ScriptJob`'s
    fields: framework, path, arguments, content hash); None: autotune's stand-in. The
    arguments are stored, and read back, with their secrets masked (``--db-password ***``):
    another password or token is the same study."""
    method: int = PROBE_METHOD
    """:data:`PROBE_METHOD` the probes measured with (a study stored without one: 1)."""
    model_parallel: int = 1
    """The ranks of a replica's tensor, pipeline and context parallel groups, where the run
    keeps one layout (``run --tp 2``): another study, whose data-parallel ranks are the GPUs
    over it (1: data parallelism, every study stored before layouts)."""

    def __post_init__(self) -> None:
        self._check_types()
        if self.script is not None:  # as stored: a study read back is masked too
            object.__setattr__(self, "script", ScriptJob.from_dict(self.script).to_dict())
        try:
            object.__setattr__(self, "objective", Objective(self.objective))
        except ValueError:
            choices = " or ".join(o.value for o in Objective)
            raise ConfigError(f"unknown objective {self.objective!r}: use {choices}") from None

    def _check_types(self) -> None:
        """Refuse a field of another type than its own (a study read back from a database
        someone else wrote into: ``"gpus": "8"``), in one line, before any reader compares or
        computes with it."""
        for name in _WHOLE_NUMBERS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(
                    f"a study's {name} is {value!r}, not a whole number of 1 or more: its "
                    "trial database holds a study autotune did not write; give --storage "
                    "another file"
                )
        for name in ("model", "gpu", "device"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(
                    f"a study's {name} is {getattr(self, name)!r}, not text: its trial database "
                    "holds a study autotune did not write; give --storage another file"
                )
        software = self.software
        if not isinstance(software, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in software.items()
        ):
            raise ConfigError(
                f"a study's software is {software!r}, not package versions: its trial "
                "database holds a study autotune did not write; give --storage another file"
            )
        if not isinstance(self.capped, bool):
            raise ConfigError(f"a study's capped is {self.capped!r}, not true or false")

    @property
    def workload(self) -> Workload:
        """The workload this study tunes (sequence length, global batch, GPUs)."""
        return Workload(
            seq_len=self.seq_len,
            global_batch=self.global_batch,
            world_size=self.gpus,
            model_parallel=self.model_parallel,
        )

    @property
    def study_name(self) -> str:
        """Readable and unique, e.g. ``llama-7b/seq2048/gbs512@8xH100-80GB/`` followed by
        ``torch2.13.0+ds0.19.8+tf5.23.0+probe2`` (the probes' method, from 2 on).

        CPU and simulated studies say so, and never mix with real GPU measurements.
        """
        hardware = f"{self.gpus}x{self.gpu.upper()}"
        if self.nodes > 1:
            hardware = f"{self.nodes}n{hardware}"
        if self.capped:
            hardware += f"-cap{_compact_bytes(self.gpu_memory_bytes)}"
        if self.device != "cuda":
            hardware += f"-{self.device}"
        name = f"{self.model}/seq{self.seq_len}/gbs{self.global_batch}@{hardware}"
        if self.objective is not Objective.TOKENS:
            name += f"/{self.objective}"
        for asked in (self.precision, self.attention):
            if asked is not None:
                name += f"/{asked}"
        if self.script is not None:
            name += f"/{ScriptJob.from_dict(self.script).key}"
        if self.model_parallel > 1:
            name += f"/mp{self.model_parallel}"
        short = {"torch": "torch", "deepspeed": "ds", "transformers": "tf", "driver": "drv"}
        versions = "+".join(
            f"{short.get(k, k)}{self.software[k]}"
            for k in sorted(self.software, key=lambda k: (*_SOFTWARE, k).index(k))
        )
        if self.method != 1:  # method 1's studies keep the names they were stored under
            versions += f"+probe{self.method}"
        return f"{name}/{versions}"

    def to_dict(self) -> dict[str, Any]:
        data = {**dataclasses.asdict(self), "objective": self.objective.value}
        if self.model_parallel == 1:  # a data-parallel study stores what it stored before
            del data["model_parallel"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Fingerprint:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{"method": 1, **{k: v for k, v in data.items() if k in known}})
