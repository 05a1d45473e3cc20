"""A finished probe, merged over its ranks: what result.json holds.

Inside the program a probe's per-size record is a typed :class:`SizeResult`; it becomes JSON
only at the file edge (``result.json``, the ranks' ``rank<N>.json``), through
:meth:`SizeResult.to_dict` and :meth:`SizeResult.from_dict`.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.probe.outcome import Classification, Outcome, Stage
from autotune.probe.spec import ProbeSpec

__all__ = [
    "JOB_MISTAKE",
    "SIGNATURE",
    "TOKEN_FILE",
    "ProbeResult",
    "SizeResult",
    "job_report_problem",
    "merge_sizes",
    "report_problem",
    "report_signature",
]

# Memory readings are per rank: the probe's figure is the worst rank's.
_MAX_OVER_RANKS = (
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "alloc_retries",
    "ooms",
    "nvml_used_bytes",
    "host_rss_bytes",
    "host_peak_rss_bytes",
    "offloaded_activation_peak_bytes",
)
_SEVERITY = {Outcome.OK.value: 0, Outcome.ERROR.value: 1, Outcome.OOM.value: 2}


@dataclass(frozen=True, kw_only=True, slots=True)
class SizeResult:
    """One micro-batch size of a probe: how it ended, its speed and its peak memory.

    Speeds are at the probe's own accumulation count (see ``autotune.probe.metrics``); memory
    is the worst rank's. Fields a probe did not measure (a size that ran out of memory has no
    speed; a CPU has no allocator retries) are None.
    """

    micro_batch_size: int
    outcome: Outcome
    stage: Stage | None = None
    """Where a failed size failed."""
    message: str = ""
    tokens_per_second: float | None = None
    """All ranks together, at the probe's accumulation count."""
    tokens_per_second_per_rank: float | None = None
    mfu: float | None = None
    """Model FLOPs utilization (0..1); None without a known peak FLOP/s (CPU, unknown GPU)."""
    hfu: float | None = None
    micro_step_s: float | None = None
    """Median forward+backward time of one micro-step."""
    optimizer_step_s: float | None = None
    step_s: float | None = None
    losses: tuple[float, ...] = ()
    loss_finite: bool | None = None
    warmup_s: float | None = None
    timed_s: float | None = None
    step_times: tuple[float, ...] = ()
    """Each timed optimizer step's seconds, in order (their spread is the probe's own noise)."""
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    alloc_retries: int | None = None
    """Allocator retries (cudaMalloc failed, caches flushed and retried): a sign of thrashing."""
    ooms: int | None = None
    nvml_used_bytes: int | None = None
    host_rss_bytes: int | None = None
    host_peak_rss_bytes: int | None = None
    emulated_limit_bytes: int | None = None
    offloaded_activation_peak_bytes: int | None = None
    """Activation offload's host copies at their peak (the emulated host pool on the CPU);
    0 without it."""
    memory_source: str | None = None
    loss_dtype: str | None = None
    """The dtype a user's job's loss took the logits in, as the measurement layer saw it
    (:class:`~autotune.config.LossDtype`); None: autotune's stand-in (fp32), or not seen."""
    trained_engine: str | None = None
    """The engine a user's job trained under, as the measurement layer saw its wrapper
    (:class:`~autotune.config.Engine`; at one rank DDP and none are both taken for either);
    None: autotune's stand-in, which trains as asked."""
    trained_zero_stage: int | None = None
    """The ZeRO stage of the DeepSpeed engine a user's job trained under (its engine's own
    ``zero_optimization_stage()``); None under the other engines, and for the stand-in."""
    simulated: bool = False
    """Answered by the simulated device (the estimator), not measured."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Keys of a result file this version does not know, kept so nothing read is lost."""

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK

    @property
    def peak_bytes(self) -> int | None:
        """The peak that decides whether a size fits: reserved (what the caching allocator
        held from the device), or allocated where nothing reports reserved."""
        return self.peak_reserved_bytes or self.peak_allocated_bytes

    def to_dict(self) -> dict[str, Any]:
        """The JSON form written in result.json (every field; None as null)."""
        data = dict(self.extra)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "extra":
                continue
            if isinstance(value, enum.Enum):
                value = value.value
            elif isinstance(value, tuple):
                value = list(value)
            data[f.name] = value
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SizeResult:
        """Inverse of :meth:`to_dict`; also reads a rank's report entry."""
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        values: dict[str, Any] = {k: v for k, v in data.items() if k in known}
        values["outcome"] = Outcome(data["outcome"])
        values["stage"] = Stage(data["stage"]) if data.get("stage") else None
        values["losses"] = tuple(data.get("losses") or ())
        values["step_times"] = tuple(data.get("step_times") or ())
        values["message"] = data.get("message") or ""
        values["simulated"] = bool(data.get("simulated"))
        for name, value in list(values.items()):
            if isinstance(value, float) and math.isnan(value):
                values[name] = None  # JSON's NaN: not a measurement
        extra = {k: v for k, v in data.items() if k not in known}
        return cls(**values, extra=extra)


@dataclass(kw_only=True)
class ProbeResult:
    """Outcome and measurements of one probe (all its micro-batch sizes)."""

    spec: ProbeSpec
    probe_dir: Path
    outcome: Outcome
    """The worst thing that happened: ``oom`` if any size ran out of memory."""
    stage: Stage | None = None
    message: str = ""
    failed_rank: int | None = None
    sizes: list[SizeResult] = field(default_factory=list)
    """One entry per micro-batch size attempted: outcome, throughput, peak memory."""
    wall_s: float = 0.0
    """Launch to last rank reaped."""
    import_s: float | None = None
    """Spawn to the worker's code running (interpreter and imports; near zero when forked)."""
    startup_s: float | None = None
    """Spawn to ready to build the model: imports, CUDA, the process group, the engine (the
    slowest rank's)."""
    spawn: str | None = None
    """How the ranks started: ``fresh`` interpreters or forks of a ``warm`` process."""
    build_s: float | None = None
    device: str = ""
    gpu_name: str | None = None
    peak_flops: float | None = None
    num_params: int | None = None
    exits: list[dict[str, Any]] = field(default_factory=list)
    tuner_fault: str | None = None
    """Why the probe could not run or be read for a reason of the tuner's own, not the
    configuration's (its folder cannot be written: a full disk, a quota, permissions), or
    None. Such a probe is no evidence about its configuration."""

    @property
    def emulated_limit_bytes(self) -> int | None:
        return self.spec.device_memory_bytes

    @property
    def job_mistake(self) -> str | None:
        """What the user's job did that autotune did not ask for (an ignored flag, another
        engine, an end before its first step), as the measurement layer said it; None when
        it did as asked. Such a probe says nothing of its configuration."""
        return next((s.message for s in self.sizes if s.extra.get(JOB_MISTAKE)), None)

    @property
    def other_engine(self) -> SizeResult | None:
        """The size whose job trained under another engine than the one asked (its
        :attr:`SizeResult.trained_engine` says which), or None."""
        return next((s for s in self.sizes if s.extra.get(JOB_MISTAKE) and s.trained_engine), None)

    def ok_sizes(self) -> list[SizeResult]:
        """Sizes that ran to completion with a finite loss."""
        return [s for s in self.sizes if s.ok]

    def size(self, micro_batch_size: int) -> SizeResult | None:
        """The entry of one micro-batch size, if the probe reached it."""
        return next((s for s in self.sizes if s.micro_batch_size == micro_batch_size), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "outcome": self.outcome.value,
            "stage": self.stage.value if self.stage else None,
            "message": self.message,
            "failed_rank": self.failed_rank,
            "device": self.device,
            "gpu_name": self.gpu_name,
            "emulated_device_memory_bytes": self.emulated_limit_bytes,
            "peak_flops": self.peak_flops,
            "num_params": self.num_params,
            "wall_s": self.wall_s,
            "import_s": self.import_s,
            "startup_s": self.startup_s,
            "spawn": self.spawn,
            "build_s": self.build_s,
            "sizes": [s.to_dict() for s in self.sizes],
            "exits": self.exits,
            "tuner_fault": self.tuner_fault,
            "probe_dir": str(self.probe_dir),
            "spec": self.spec.to_dict(),
        }

    def write(self) -> Path:
        path = self.probe_dir / "result.json"
        path.write_text(json.dumps(self.to_dict(), indent=2, default=str))
        return path

    @classmethod
    def read(cls, probe_dir: Path) -> ProbeResult:
        """The result a probe wrote in its folder."""
        return cls.from_dict(json.loads((probe_dir / "result.json").read_text()), probe_dir)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], probe_dir: Path | None = None) -> ProbeResult:
        """A result from its JSON form (``probe_dir``: where it lies now, else as written)."""
        probe_dir = probe_dir if probe_dir is not None else Path(data.get("probe_dir", "."))
        return cls(
            spec=ProbeSpec.from_dict(data["spec"]),
            probe_dir=probe_dir,
            outcome=Outcome(data["outcome"]),
            stage=Stage(data["stage"]) if data.get("stage") else None,
            message=data.get("message", ""),
            failed_rank=data.get("failed_rank"),
            sizes=[SizeResult.from_dict(s) for s in data.get("sizes", [])],
            wall_s=data.get("wall_s", 0.0),
            import_s=data.get("import_s"),
            startup_s=data.get("startup_s"),
            spawn=data.get("spawn"),
            build_s=data.get("build_s"),
            device=data.get("device", ""),
            gpu_name=data.get("gpu_name"),
            peak_flops=data.get("peak_flops"),
            num_params=data.get("num_params"),
            exits=data.get("exits", []),
            tuner_fault=data.get("tuner_fault"),
        )


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


_NUMBER_FIELDS = tuple(
    f.name for f in dataclasses.fields(SizeResult) if f.type in ("float | None", "int | None")
)
"""A size entry's measured fields: each a number or null."""


def _size_problem(entry: Any) -> str | None:
    """What is wrong with one size entry of a rank's report, or None."""
    if not isinstance(entry, dict):
        return f"a size entry is {type(entry).__name__}, not an object"
    mbs = entry.get("micro_batch_size")
    if not isinstance(mbs, int) or isinstance(mbs, bool) or mbs < 1:
        return f"a size entry has micro_batch_size {mbs!r}"
    if entry.get("outcome") not in {o.value for o in Outcome}:
        return f"size {mbs} has outcome {entry.get('outcome')!r}"
    if entry.get("stage") not in (None, *(s.value for s in Stage)):
        return f"size {mbs} has stage {entry.get('stage')!r}"
    bad = [k for k in _NUMBER_FIELDS if entry.get(k) is not None and not _number(entry[k])]
    if bad:
        return f"size {mbs} has a {bad[0]} that is not a number: {entry[bad[0]]!r}"
    losses = entry.get("losses")
    if losses is not None and not (isinstance(losses, list) and all(map(_number, losses))):
        return f"size {mbs} has losses that are not a list of numbers"
    return None


def report_problem(data: Any, rank: int) -> str | None:
    """What makes a parsed ``rank<N>.json`` unusable, or None: the launcher reads a rank's
    report only through this check, so no probe is classified or merged from a report that
    is not the worker's (a torn or foreign file, another rank's)."""
    if not isinstance(data, dict):
        return f"it holds {type(data).__name__}, not an object"
    if data.get("rank") != rank:
        return f"it says rank {data.get('rank')!r}"
    if data.get("status") not in {o.value for o in Outcome}:
        return f"its status is {data.get('status')!r}"
    if data.get("stage") not in (None, *(s.value for s in Stage)):
        return f"its stage is {data.get('stage')!r}"
    if not isinstance(data.get("message", ""), str):
        return "its message is not text"
    sizes = data.get("sizes", [])
    if not isinstance(sizes, list):
        return "its sizes are not a list"
    return next((p for p in map(_size_problem, sizes) if p is not None), None)


JOB_MISTAKE = "job_mistake"
"""The field of a failed size whose failure is the user's job's own mistake, not the
configuration's (:attr:`ProbeResult.job_mistake`)."""

TOKEN_FILE = "rank{}.token"
"""The token of one rank of a run of the user's job, in the run's folder: written by the
launcher before the rank starts, taken (read, then deleted) by the measurement layer before the
job's script runs. The layer signs the rank's report with it (:func:`report_signature`); the
token itself is in no file the script can read while it runs, nor in any environment."""
SIGNATURE = "signature"
"""The field of a job's rank report that holds its signature."""
_REL_TOL = 1e-6
_ABS_TOL_S = 1e-6


def report_signature(data: Mapping[str, Any], token: str) -> str:
    """HMAC-SHA256, under ``token``, of a rank report's JSON (every field but the signature,
    keys sorted): what the measurement layer signs and the launcher checks."""
    body = {key: value for key, value in data.items() if key != SIGNATURE}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hmac.new(token.encode(), text.encode(), hashlib.sha256).hexdigest()


def _close(value: float, expected: float) -> bool:
    return math.isclose(value, expected, rel_tol=_REL_TOL, abs_tol=_ABS_TOL_S)


def _timing_problem(entry: Mapping[str, Any], spec: ProbeSpec) -> str | None:
    """Whether a measured size's figures are the timed steps the probe asked for: as many as
    asked, their durations summing to the timed window, the step time among them (a sum of
    medians lies between the smallest and the largest step), and the tokens/s the asked
    tokens of a step over that step time."""
    mbs = entry["micro_batch_size"]
    times = entry.get("step_times")
    if not (isinstance(times, list) and all(_number(t) and t > 0 for t in times)):
        return f"size {mbs} has no durations of its timed steps"
    if len(times) != spec.timed_steps:
        return f"size {mbs} timed {len(times)} steps where the probe asked for {spec.timed_steps}"
    figures: list[Any] = [entry.get(k) for k in ("step_s", "timed_s", "tokens_per_second")]
    step, window, speed = (float(v) if _number(v) else 0.0 for v in figures)
    if min(step, window, speed) <= 0:
        return f"size {mbs} has no step time, timed window or tokens/s"
    if not _close(window, math.fsum(times)):
        return f"size {mbs}'s timed window ({window} s) is not the sum of its timed steps"
    if not min(times) - _ABS_TOL_S <= step <= max(times) + _ABS_TOL_S:
        return f"size {mbs}'s step time ({step} s) is outside its timed steps' durations"
    tokens = mbs * spec.seq_len * spec.accumulation(mbs) * spec.world_size
    if not _close(speed, tokens / step):
        return f"size {mbs}'s tokens/s ({speed}) is not {tokens} tokens a step over its step time"
    return None


def job_report_problem(data: Mapping[str, Any], token: str, spec: ProbeSpec) -> str | None:
    """What makes a rank report of the user's job unusable beyond :func:`report_problem`, or
    None: one the measurement layer did not sign with the rank's token (the job's script wrote
    or changed it), or whose measured sizes are not the timed steps ``spec`` asked for."""
    signature = data.get(SIGNATURE)
    if not (
        isinstance(signature, str)
        and hmac.compare_digest(signature.encode(), report_signature(data, token).encode())
    ):
        return "not signed with this run's token: the job's script wrote or changed it"
    sizes = [e for e in data.get("sizes", []) if e.get("outcome") == Outcome.OK.value]
    return next((p for e in sizes if (p := _timing_problem(e, spec)) is not None), None)


def merge_sizes(
    reports: list[dict[str, Any] | None], world_size: int, probe: Classification
) -> list[SizeResult]:
    """One entry per micro-batch size from every rank's report.

    Throughput comes from rank 0 (all ranks advance in lock-step), memory is the maximum over
    ranks, the outcome the worst any rank saw. A size some rank never finished takes the
    probe's outcome (the rank crashed, hung or was killed).
    """
    by_size: dict[int, list[dict[str, Any]]] = {}
    for report in reports:
        for entry in (report or {}).get("sizes", []):
            by_size.setdefault(entry["micro_batch_size"], []).append(entry)
    merged = []
    for _mbs, entries in by_size.items():
        base = dict(entries[0])
        base.pop(JOB_MISTAKE, None)  # the worst entry's say, as its message
        worst = max(entries, key=lambda e: _SEVERITY.get(e["outcome"], 3))
        base["outcome"] = worst["outcome"]
        for key in ("stage", "message", JOB_MISTAKE):
            if key in worst:
                base[key] = worst[key]
        for key in _MAX_OVER_RANKS:
            values = [e[key] for e in entries if e.get(key) is not None]
            if values:
                base[key] = max(values)
        if len(entries) < world_size and base["outcome"] == Outcome.OK.value:
            base["outcome"] = probe.outcome.value
            base["message"] = probe.message
        merged.append(SizeResult.from_dict(base))
    return merged
