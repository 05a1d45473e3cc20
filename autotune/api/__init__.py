"""autotune as a library: what the command line, the tests and the benchmarks call.

- :func:`tune` (or :func:`prepare` and :meth:`Tuning.run`): search for the fastest
  configuration that fits, recording every probe in the study;
- :func:`plan`: every configuration ranked by the estimator, without a GPU;
- :func:`best` and :func:`trials`: read a trial database back;
- :func:`export`: the best configuration (or a trial's) as a trainer's own configuration;
- :func:`write_report`: a study as one self-contained HTML page of charts and tables;
- :func:`probe`: run one configuration for real.

Sizes and durations take units as text (``"20GiB"``, ``"1h30m"``) or plain numbers (bytes,
seconds). Bad input raises :class:`~autotune.config.ConfigError` (a ``ValueError``) whose
message says what to do. Nothing here imports torch: only the ranks of a real probe do.

One module a use case, each re-exported here: :mod:`~autotune.api._plan`,
:mod:`~autotune.api._tune` (``run``: prepare, tune, job files), :mod:`~autotune.api._probe`,
:mod:`~autotune.api._rlhf` (plan, tune and export an RL iteration) and
:mod:`~autotune.api._results` (best, trials, export, report); the user's values are checked in
:mod:`autotune.values`, and the user's script as a run or a probe takes it is
:mod:`~autotune.api._script`. The study (Optuna, SQLAlchemy) and the search are imported inside
the functions that use them: ``autotune plan`` and ``--help`` never open a study, and answer
faster without them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune.api._plan import HostAssumed, Plan, plan
from autotune.api._probe import probe
from autotune.api._results import Export, Report, best, export, trials, write_report
from autotune.api._rlhf import RLHFExport, RLHFPlan, export_rlhf, plan_rlhf, tune_rlhf
from autotune.api._tune import Tuning, prepare, tune, tune_jobs
from autotune.config import NothingFits
from autotune.estimator.plan import DEVICE_RESERVE_BYTES
from autotune.jobs import JobResult
from autotune.outputs import check_output, write_new_file
from autotune.study.measurement import StudyResult
from autotune.values import DEFAULT_SEQ_LEN, PER_GPU_BATCH, SEARCHED_KNOBS

if TYPE_CHECKING:
    from autotune.search.controller import RunSummary

__all__ = [
    "DEFAULT_SEQ_LEN",
    "DEVICE_RESERVE_BYTES",
    "PER_GPU_BATCH",
    "SEARCHED_KNOBS",
    "Export",
    "HostAssumed",
    "JobResult",
    "NothingFits",
    "Plan",
    "RLHFExport",
    "RLHFPlan",
    "Report",
    "RunSummary",
    "StudyResult",
    "Tuning",
    "best",
    "check_output",
    "export",
    "export_rlhf",
    "plan",
    "plan_rlhf",
    "prepare",
    "probe",
    "trials",
    "tune",
    "tune_jobs",
    "tune_rlhf",
    "write_new_file",
    "write_report",
]
