"""The first real GPU run (one H100 80GB HBM3, 2026-11-23): every probe's ``result.json``,
loaded as :class:`ProbeResult`. What the estimator, the host model and the simulator are
checked against (see measurements/h100-2026-11-23/README.md)."""

from __future__ import annotations

import json
from pathlib import Path

from autotune.probe.result import ProbeResult

FOLDER = Path(__file__).parents[1] / "measurements" / "h100-2026-11-23"
HOST_MEMORY_BYTES = 125 * 1024**3
"""The node's host RAM as ``free`` showed it (16 cores, 125 GiB)."""


def probes() -> dict[str, ProbeResult]:
    """Every probe of the run by file stem (``grid-4``, ``llama-7b-run-0``, ...)."""
    return {
        path.stem: ProbeResult.from_dict(json.loads(path.read_text()))
        for path in sorted(FOLDER.glob("*.json"))
        if not path.stem.endswith("-plan")
    }
