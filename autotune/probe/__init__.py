"""Probes: a few real training steps of one configuration, in their own process group.

The probe layer knows nothing of the search: it takes a :class:`ProbeSpec` and returns a
:class:`ProbeResult` (ok, oom, host_oom, timeout, crash or error, with measurements).

The tuner's side of it (spec, result, outcome, metrics, launcher) imports no torch; only the
ranks (``worker``, ``engines``, ``modeling``, ``memory``, ``trace``) do.
"""

from __future__ import annotations

from autotune.probe.launcher import launch_probe, new_probe_dir
from autotune.probe.outcome import Outcome, Stage, classify_probe, is_oom_error
from autotune.probe.result import ProbeResult, SizeResult
from autotune.probe.spec import ProbeSpec, ProbeTemplate

__all__ = [
    "Outcome",
    "ProbeResult",
    "ProbeSpec",
    "ProbeTemplate",
    "SizeResult",
    "Stage",
    "classify_probe",
    "is_oom_error",
    "launch_probe",
    "new_probe_dir",
]
