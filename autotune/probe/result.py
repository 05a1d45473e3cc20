"""A finished probe, merged over its ranks: what result.json holds."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.probe.outcome import Classification, Outcome, Stage
from autotune.probe.spec import ProbeSpec

# Memory readings are per rank: the probe's figure is the worst rank's.
_MAX_OVER_RANKS = (
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "alloc_retries",
    "ooms",
    "nvml_used_bytes",
    "host_rss_bytes",
    "host_peak_rss_bytes",
)
_SEVERITY = {Outcome.OK.value: 0, Outcome.ERROR.value: 1, Outcome.OOM.value: 2}


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
    sizes: list[dict[str, Any]] = field(default_factory=list)
    """One entry per micro-batch size attempted: outcome, throughput, peak memory."""
    wall_s: float = 0.0
    """Launch to last rank reaped."""
    import_s: float | None = None
    build_s: float | None = None
    device: str = ""
    gpu_name: str | None = None
    peak_flops: float | None = None
    num_params: int | None = None
    exits: list[dict[str, Any]] = field(default_factory=list)

    @property
    def emulated_limit_bytes(self) -> int | None:
        return self.spec.device_memory_bytes

    def ok_sizes(self) -> list[dict[str, Any]]:
        """Sizes that ran to completion with a finite loss."""
        return [s for s in self.sizes if s["outcome"] == Outcome.OK.value]

    def best(self) -> dict[str, Any] | None:
        """The fastest size that fit."""
        return max(self.ok_sizes(), key=lambda s: s["tokens_per_second"], default=None)

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
            "build_s": self.build_s,
            "sizes": self.sizes,
            "exits": self.exits,
            "probe_dir": str(self.probe_dir),
            "spec": self.spec.to_dict(),
        }

    def write(self) -> Path:
        path = self.probe_dir / "result.json"
        path.write_text(json.dumps(self.to_dict(), indent=2, default=str))
        return path

    @classmethod
    def read(cls, probe_dir: Path) -> ProbeResult:
        data = json.loads((probe_dir / "result.json").read_text())
        return cls(
            spec=ProbeSpec.from_dict(data["spec"]),
            probe_dir=probe_dir,
            outcome=Outcome(data["outcome"]),
            stage=Stage(data["stage"]) if data.get("stage") else None,
            message=data.get("message", ""),
            failed_rank=data.get("failed_rank"),
            sizes=data.get("sizes", []),
            wall_s=data.get("wall_s", 0.0),
            import_s=data.get("import_s"),
            build_s=data.get("build_s"),
            device=data.get("device", ""),
            gpu_name=data.get("gpu_name"),
            peak_flops=data.get("peak_flops"),
            num_params=data.get("num_params"),
            exits=data.get("exits", []),
        )


def merge_sizes(
    reports: list[dict[str, Any] | None], world_size: int, probe: Classification
) -> list[dict[str, Any]]:
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
        worst = max(entries, key=lambda e: _SEVERITY.get(e["outcome"], 3))
        base["outcome"] = worst["outcome"]
        for key in ("stage", "message"):
            if key in worst:
                base[key] = worst[key]
        for key in _MAX_OVER_RANKS:
            values = [e[key] for e in entries if e.get(key) is not None]
            if values:
                base[key] = max(values)
        if len(entries) < world_size and base["outcome"] == Outcome.OK.value:
            base["outcome"] = probe.outcome.value
            base["message"] = probe.message
        merged.append(base)
    return merged
