"""One rank's report (``rank<N>.json``), as autotune's worker and the measurement layer of a
user's job both write it: rewritten atomically after every change, so a crash keeps what was
measured before it. The launcher reads it back through ``result.report_problem``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from autotune.probe.outcome import Outcome, Stage

__all__ = ["RankReport", "finished"]


class RankReport:
    """This rank's report, rewritten atomically after every change."""

    def __init__(self, path: Path, rank: int, world_size: int) -> None:
        self.path = path
        self.data: dict[str, Any] = {
            "rank": rank,
            "world_size": world_size,
            "device": None,
            "status": Outcome.OK.value,
            "stage": None,
            "message": "",
            "sizes": [],
        }

    def update(self, **fields: Any) -> None:
        self.data.update(fields)
        self.write()

    def fail(self, outcome: Outcome, stage: Stage, message: str, error_type: str) -> None:
        self.update(status=outcome.value, stage=stage.value, message=message, error_type=error_type)

    def finish(self) -> None:
        """Say this rank measured every size it was asked: nothing it does after (tearing down
        its process group, exiting) can change the probe's result, so the launcher need not
        wait long for its exit (:data:`~autotune.probe.launcher.EXIT_GRACE_S`)."""
        self.update(finished=True)

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        os.replace(tmp, self.path)


def finished(path: Path) -> bool:
    """Whether the report at ``path`` says its rank finished (False while it is missing, torn
    or still being measured)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("finished") is True
