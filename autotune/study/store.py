"""Every probe as Optuna trials: one trial per configuration and micro-batch size.

The study lives in any storage Optuna accepts (``sqlite:///trials/autotune.db`` by default,
PostgreSQL for several tuner workers). A trial's params are the configuration and the
micro-batch size; its user attributes hold what was measured (outcome, tokens/s at the user's
global batch, MFU, step times, peak memory, the probe folder). Its value is the objective.

Out-of-memory trials must steer the search, yet Optuna's samplers ignore failed trials, so an
OOM is a *complete* trial with value 0 and a violated constraint (the ``constraints`` list
Optuna and optuna-dashboard both read); so is each size of a probe the host's OOM killer
stopped (``host_oom``). Constraint-aware samplers learn the infeasible region, and
optuna-dashboard shows the trial as infeasible. A
configuration whose peak comes within ``headroom`` of the capacity is infeasible the same way.
Crashes, hangs and errors are FAIL trials with their message.

Trials are claimed before a probe starts, so a RUNNING trial tells other workers (and a
resumed tuner) that its configuration is in flight; two workers racing for the same point both
write their claim, and the later one withdraws (a PRUNED trial marked ``withdrawn``, hidden from
the search). A tuner killed mid-probe leaves RUNNING trials: on this host they are failed as
soon as a tuner finds their owner process gone, elsewhere when the storage's heartbeat goes
stale. Failed-by-interruption trials (``interrupted``, ``stale``) are retried once by the
search; a second such failure closes the point.

A point may be measured more than once on purpose: the search re-measures near-ties with the
best to tell them apart from timing noise. Such a trial carries its ``repeat`` number (1, 2,
...; absent on the first measurement), and :func:`pooled` averages a point's repeats. A
trial's own measurement is its ``measured`` attribute; its Optuna value is its point's
standing (the mean of its repeats, 0 where it is no answer), rewritten as repeats come in, so
that Optuna's ``best_trial`` and optuna-dashboard name the best autotune reads.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import os
import random
import signal
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import optuna
import psutil
import sqlalchemy
import sqlalchemy.exc
from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution
from optuna.storages import RDBStorage
from optuna.trial import FrozenTrial, Trial, TrialState, create_trial

from autotune.config import (
    Attention,
    ConfigError,
    Engine,
    Loss,
    Offload,
    Optimizer,
    Precision,
    Schedule,
    TrainConfig,
)
from autotune.probe.metrics import throughput
from autotune.probe.outcome import Outcome
from autotune.probe.result import ProbeResult, SizeResult
from autotune.space import oom_rules_out
from autotune.study.fingerprint import DEFAULT_STORAGE, Fingerprint, Objective
from autotune.study.measurement import (
    MEASURED,
    OTHER_ENGINE,
    Measurement,
    StoredTrial,
    best_point,
    decode,
    point,
    standings,
)
from autotune.study.schema import (
    CONSTRAINTS,
    FINGERPRINT_ATTR,
    GENERATION,
    GRACE_S,
    HEARTBEAT_S,
    WITHDRAWN,
    cannot_open,
    holds_no_database,
    refuse_foreign_sqlite,
    sqlite_path,
    trial_generation,
)
from autotune.urls import check_storage_url, masked

__all__ = ["STORAGE_ERRORS", "TrialStore", "open_storage", "storage_problem"]

_T = TypeVar("_T")

OPEN_ATTEMPTS = 5
"""Tries to open a storage whose tables another worker is creating at the same moment."""


def _distributions(params: Mapping[str, Any]) -> dict[str, BaseDistribution]:
    """The search space as Optuna distributions (fixed per trial: the sampler is autotune's),
    of the fields ``params`` holds (a data-parallel configuration stores no layout field)."""
    return {k: v for k, v in _SPACE.items() if k in params}


_SPACE: dict[str, BaseDistribution] = {
    "engine": CategoricalDistribution([e.value for e in Engine]),
    "zero_stage": IntDistribution(0, 3),
    "precision": CategoricalDistribution([p.value for p in Precision]),
    "ac_every": IntDistribution(0, 64),
    "ac_ops": CategoricalDistribution([False, True]),
    "offload": CategoricalDistribution([o.value for o in Offload]),
    "attention": CategoricalDistribution([a.value for a in Attention]),
    "loss": CategoricalDistribution([x.value for x in Loss]),
    "optimizer": CategoricalDistribution([x.value for x in Optimizer]),
    "lora_rank": IntDistribution(0, 1 << 12),
    "act_offload": CategoricalDistribution([False, True]),
    "torch_compile": CategoricalDistribution([False, True]),
    "micro_batch_size": IntDistribution(1, 1 << 16),
    "tp": IntDistribution(1, 1 << 10),
    "pp": IntDistribution(1, 1 << 10),
    "pp_schedule": CategoricalDistribution([x.value for x in Schedule]),
    "pp_virtual": IntDistribution(1, 1 << 10),
    "cp": IntDistribution(1, 1 << 10),
}
"""autotune's search space as Optuna distributions, every field a trial may store."""


STORAGE_ERRORS: tuple[type[Exception], ...] = (
    optuna.exceptions.StorageInternalError,
    sqlalchemy.exc.SQLAlchemyError,
)
"""What a write to (or a read of) an open study raises when its database fails under it: a
full disk, a lock held too long, a lost server."""


_INTERRUPTIONS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def _interruptions_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM held back while a heartbeat's write runs, and raised again as it ends
    (to whatever handles them outside).

    A probe's heartbeat is written many times a second, so most interruptions would land inside
    one. One that lands inside SQLAlchemy's commit leaves the session's transaction half closed,
    and on SQLite its connection, orphaned, keeps the write lock until it is collected: the
    interruption's own record then fails with "database is locked", and a Ctrl-C reads as a
    database failure. A heartbeat is one short write (no retries). The handlers are swapped,
    not the signal mask: a signal sent to the process reaches whichever thread does not block
    it (a progress display's), and Python runs its handler on the main thread regardless.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    outside: dict[int, Any] = {}
    try:
        for swapped in _INTERRUPTIONS:  # in the try: a signal between two swaps undoes both
            outside[swapped] = signal.signal(swapped, lambda n, _: caught.append(n))
        yield
    finally:
        for signum, handler in outside.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        for number in dict.fromkeys(caught):
            signal.raise_signal(number)


RETRY_WINDOW_S = 120.0
"""How long a tuner keeps retrying a database server it lost (a restart, a failover, a network
blip) before its run stops with the reason: long enough for a restart, short enough that a
nightly job does not hang on a server that is gone."""
CONNECT_ATTEMPTS = 4
"""Tries to reach a database server at the start of a run (waits of 1, 2 and 4 s between)."""


def lost_connection(error: BaseException) -> bool:
    """Whether a storage error means the database server went away or cannot be reached (worth
    a retry), rather than a fault of the request or of the data."""
    cause: BaseException | None = error
    while cause is not None:
        if getattr(cause, "connection_invalidated", False):
            return True
        text = str(cause).lower()
        if isinstance(
            cause, sqlalchemy.exc.OperationalError | sqlalchemy.exc.InterfaceError
        ) and any(
            marker in text
            for marker in ("connect", "server closed", "terminating", "refused", "timeout")
        ):
            return True
        cause = cause.__cause__
    return False


def storage_problem(error: BaseException) -> str:
    """What went wrong with the database, in a few words (the driver's own message, without
    SQLAlchemy's decoration), from an error of :data:`STORAGE_ERRORS`."""
    cause: BaseException = error
    while isinstance(cause, STORAGE_ERRORS) and cause.__cause__ is not None:
        cause = cause.__cause__
    original = getattr(cause, "orig", None)
    text = str(original if original is not None else cause).strip()
    return masked(text.splitlines()[0] if text else type(cause).__name__)


def open_storage(url: str = DEFAULT_STORAGE, *, read_only: bool = False) -> RDBStorage:
    """An Optuna RDB storage with heartbeats; SQLite's folder is created.

    Args:
        url: Any storage URL Optuna accepts.
        read_only: For reading studies back (``autotune best``): the schema is neither created
            nor checked, which takes most of the half second an open costs.

    Raises:
        ConfigError: When the URL cannot be opened (one line that says what to use).
    """
    check_storage_url(url)
    path = sqlite_path(url)
    if path is not None:
        refuse_foreign_sqlite(path, writing=not read_only)
    new_file = path is not None and not read_only and not path.exists()
    if path is not None and not read_only:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise cannot_open(url, error) from None
    try:
        return _open(url, path, read_only)
    except ConfigError:
        if new_file and path is not None:
            # The file SQLite made before it failed (a full disk) is no database: not left.
            with contextlib.suppress(OSError):
                if path.stat().st_size == 0:
                    path.unlink()
        raise


def _open(url: str, path: Path | None, read_only: bool) -> RDBStorage:
    """:func:`open_storage`'s open, with its retries."""
    skip: dict[str, Any] = (
        {"skip_compatibility_check": True, "skip_table_creation": True} if read_only else {}
    )
    if path is None:  # a server: a pooled connection is checked before use (it may restart)
        skip["engine_kwargs"] = {"pool_pre_ping": True}
    unreachable = 0
    for attempt in range(1, OPEN_ATTEMPTS + CONNECT_ATTEMPTS + 1):
        try:
            with warnings.catch_warnings():
                # Heartbeats are "experimental" in Optuna 5: the interface is what autotune pins.
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return RDBStorage(url, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S, **skip)
        except sqlalchemy.exc.SQLAlchemyError as error:
            if path is None and lost_connection(error):
                unreachable += 1
                if unreachable == CONNECT_ATTEMPTS:
                    waited = 2 ** (unreachable - 1) - 1  # the pauses between the tries
                    raise cannot_open(
                        url,
                        RuntimeError(
                            f"{storage_problem(error)} ({unreachable} tries over {waited} s)"
                        ),
                    ) from None
                time.sleep(2 ** (unreachable - 1))
                continue
            # Workers that start together on an empty database all create its tables; the
            # losers of that race meet duplicate objects (PostgreSQL: an integrity or
            # programming error; SQLite: "table ... already exists", or a lock), and find
            # the tables on a retry.
            racing = isinstance(
                error, sqlalchemy.exc.IntegrityError | sqlalchemy.exc.ProgrammingError
            ) or "already exists" in str(error)
            if not racing or attempt >= OPEN_ATTEMPTS:
                raise cannot_open(url, error) from None
            time.sleep(random.uniform(0.2, 1.0))
        except Exception as error:  # SQLAlchemy raises many kinds; all mean "cannot open"
            raise cannot_open(url, error) from None
    raise AssertionError("unreachable")


def _has_optuna_schema(url: str) -> bool:
    """Whether the database holds Optuna's tables and its version row, read with a plain
    connection (Optuna's own open writes the version row where it is missing).

    Raises:
        ConfigError: When the database cannot be reached.
    """
    engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)
    try:
        with engine.connect() as connection:
            if not sqlalchemy.inspect(connection).has_table("version_info"):
                return False
            rows = connection.execute(sqlalchemy.text("SELECT COUNT(*) FROM version_info"))
            return bool(rows.scalar())
    except sqlalchemy.exc.SQLAlchemyError as error:
        raise cannot_open(url, error) from None
    finally:
        engine.dispose()


@contextlib.contextmanager
def _optuna_quiet() -> Iterator[None]:
    """Optuna's INFO lines held back for a moment (its verbosity is the caller's otherwise)."""
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        yield
    finally:
        optuna.logging.set_verbosity(verbosity)


def _file_id(database: str | None) -> tuple[int, int] | None:
    """A SQLite file's device and inode (None where there is no such file)."""
    try:
        found = os.stat(database) if database and database != ":memory:" else None
    except OSError:
        return None
    return None if found is None else (found.st_dev, found.st_ino)


class TrialStore:
    """The study of one fingerprint: ask a trial per probed size, record what happened.

    The store owns every write to the study: claims, outcomes, interruptions and stale
    trials. A size fits when its measured peak leaves ``headroom`` of the fingerprint's
    memory per device (``gpu_memory_bytes``) free.
    """

    def __init__(
        self,
        fingerprint: Fingerprint,
        *,
        storage: str | RDBStorage = DEFAULT_STORAGE,
        headroom: float = 0.0,
        study: optuna.Study | None = None,
    ) -> None:
        """Open (or create) the study of ``fingerprint``; ``study``: the study already
        loaded (reading a database back)."""
        self.fingerprint = fingerprint
        self.workload = fingerprint.workload
        self.headroom = headroom
        self.storage = open_storage(storage) if isinstance(storage, str) else storage
        try:
            with _optuna_quiet():  # "A new study created in RDB": the caller says what it does
                self.study = study or optuna.create_study(
                    storage=self.storage,
                    study_name=fingerprint.study_name,
                    direction="maximize",
                    load_if_exists=True,
                )
            attrs = self.study.user_attrs  # one read: Optuna queries it on every access
            if attrs.get(FINGERPRINT_ATTR) is None:
                self.study.set_user_attr(FINGERPRINT_ATTR, fingerprint.to_dict())
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    self.study.set_metric_names([fingerprint.objective.value])
        except STORAGE_ERRORS as error:  # read-only, full, locked: nothing of it was written
            url = storage if isinstance(storage, str) else "the trial storage"
            raise cannot_open(url, RuntimeError(storage_problem(error))) from None
        self.retry_window_s = RETRY_WINDOW_S
        """How long a lost database server is retried before a call gives up (0: never)."""
        self.estimates: Mapping[tuple[TrainConfig, int], tuple[float | None, float | None]] = {}
        """The estimator's own (uncalibrated) tokens/s and peak bytes per configuration and
        micro-batch, recorded with each trial (``estimate_tokens_per_second``,
        ``estimate_peak_bytes``): how far a measurement was from the prediction, readable
        from the study alone (a user's job against the stand-in's prediction)."""
        self._server = self.storage.engine.dialect.name != "sqlite"
        self._file = _file_id(self.storage.engine.url.database) if not self._server else None
        self._read_generation = int(attrs.get(GENERATION, 0))
        self.generation = self._read_generation
        """The generation this store's trials are of, and its measurements read
        (:data:`~autotune.study.schema.GENERATION`): the study's, or the next one after
        :meth:`measure_again`."""

    def measure_again(self) -> int:
        """Measure the study again, as its next generation: the search starts afresh beside
        the earlier trials (kept, and read by the study's readers until the new generation
        has a configuration that fits). Returns the new generation's number."""
        self.generation = self._read_generation + 1
        return self.generation

    def lost_file(self) -> str | None:
        """What became of a SQLite file that was deleted or replaced since the study was
        opened (its trials are gone with it), or None while it is the file opened."""
        if self._file is None:
            return None
        database = self.storage.engine.url.database or ""
        now = _file_id(database)
        if now == self._file:
            return None
        return f"{database} was {'deleted' if now is None else 'replaced'} while the run went on"

    def _retrying(self, call: Callable[[], _T]) -> _T:
        """``call()``, retried with a growing pause (1, 2, 4, ... 16 s) while the database
        server is unreachable, for up to ``retry_window_s``; SQLite's faults are not passing,
        and any other error is raised at once."""
        deadline = time.monotonic() + self.retry_window_s
        pause = 1.0
        while True:
            try:
                return call()
            except STORAGE_ERRORS as error:
                if not (self._server and lost_connection(error)):
                    raise
                if time.monotonic() + pause > deadline:
                    raise
                self.storage.scoped_session.remove()  # the next try starts a fresh session
                time.sleep(pause)
                pause = min(pause * 2, 16.0)

    @property
    def capacity_bytes(self) -> int:
        """Memory per device a probe may use: the feasibility line of every trial."""
        return self.fingerprint.gpu_memory_bytes

    @classmethod
    def existing(cls, storage: str | RDBStorage = DEFAULT_STORAGE) -> list[TrialStore]:
        """Every autotune study in a storage (studies without a fingerprint are skipped).

        Reads only: a SQLite file that does not exist or is empty, and a database without
        Optuna's tables, hold no study and are given none; an older schema is not upgraded.
        """
        if isinstance(storage, str):
            path = sqlite_path(storage)
            if path is not None and holds_no_database(path):
                return []
            if not _has_optuna_schema(storage):
                return []  # no study yet; Optuna's open would write its version row
            opened = open_storage(storage, read_only=True)
            try:
                summaries = optuna.get_all_study_summaries(opened, include_best_trial=False)
            except sqlalchemy.exc.SQLAlchemyError as error:
                raise ConfigError(
                    f"cannot read the trial storage {masked(storage)!r}: "
                    f"{storage_problem(error)}; its schema may be an older Optuna's, which "
                    "autotune run with this --storage upgrades"
                ) from None
        else:
            opened = storage
            summaries = optuna.get_all_study_summaries(opened, include_best_trial=False)
        found = []
        for summary in summaries:
            data = summary.user_attrs.get(FINGERPRINT_ATTR)
            if not data:
                continue
            study = optuna.load_study(study_name=summary.study_name, storage=opened)
            found.append(cls(Fingerprint.from_dict(data), storage=opened, study=study))
        return found

    def ask(self, config: TrainConfig, micro_batch_size: int, *, repeat: int = 0) -> Trial:
        """Start a trial for one size of a probe about to run (RUNNING until told).

        The point is autotune's choice, not a sampler's: the trial is created with its params
        fixed, its owner (host, process) recorded, and its heartbeat started (call :meth:`beat`
        while the probe runs). ``repeat`` numbers a deliberate re-measurement of the point.
        """
        params = {**config.to_dict(), "micro_batch_size": micro_batch_size}
        distributions = _distributions(params)
        template = create_trial(
            state=TrialState.RUNNING,
            params=params,
            distributions=distributions,
            user_attrs={
                **_owner(),
                **({"repeat": repeat} if repeat else {}),
                **({GENERATION: self.generation} if self.generation else {}),
                **_estimate_attrs(self.estimates.get((config, micro_batch_size))),
            },
        )
        trial_id = self.storage.create_new_trial(self.study._study_id, template_trial=template)
        self.storage.record_heartbeat(trial_id)
        return Trial(self.study, trial_id)

    def claim(
        self, config: TrainConfig, micro_batch_sizes: Iterable[int] | Mapping[int, int]
    ) -> list[Trial] | None:
        """Ask a trial per size, unless another worker holds or measured one of them (at the
        same re-measurement number, a mapping's value for each size: the n-th re-measurement
        of a point is claimed like a point).

        Every worker writes its claim first, then looks, and withdraws on any other trial of
        the same points. Each worker's writes are committed before it looks, so of two
        overlapping claims at least one sees the other: two workers never both probe a point
        (both may withdraw; they then propose again after a random pause).

        Returns:
            The trials, or None when another worker got there first (ours are withdrawn).
        """
        repeats = (
            dict(micro_batch_sizes)
            if isinstance(micro_batch_sizes, Mapping)
            else dict.fromkeys(micro_batch_sizes, 0)
        )
        return self._retrying(lambda: self._claim(config, repeats))

    def _claim(self, config: TrainConfig, repeats: dict[int, int]) -> list[Trial] | None:
        trials: list[Trial] = []
        try:
            for m, repeat in repeats.items():
                trials.append(self.ask(config, m, repeat=repeat))
        except STORAGE_ERRORS:
            # A claim its database cut short (a full disk): take back the trials it wrote,
            # where the database still takes that much, so none is left running.
            with contextlib.suppress(*STORAGE_ERRORS):
                self.storage.scoped_session.remove()
                self._withdraw(trials, "its claim could not be written whole")
            raise
        mine = {t._trial_id for t in trials}
        keys = {_key(config.to_dict(), m, repeat) for m, repeat in repeats.items()}
        taken = any(
            other._trial_id not in mine
            and trial_generation(other.user_attrs) == self.generation
            and _key(
                other.params,
                int(other.params.get("micro_batch_size", -1)),
                int(other.user_attrs.get("repeat", 0)),
            )
            in keys
            for other in self.study.get_trials(
                deepcopy=False, states=(TrialState.RUNNING, TrialState.COMPLETE)
            )
        )
        if not taken:
            return trials
        self._withdraw(trials, "another worker holds or measured one of its points")
        return None

    def withdraw(self, trials: Iterable[Trial], why: str) -> None:
        """Take back a claim whose probe did not run for a reason of the tuner's own (its
        folder cannot be written): the trials are not counted, and nothing is recorded
        against their points, which any later run probes as new."""
        self.storage.scoped_session.remove()  # start from a fresh session, as interrupt does
        self._retrying(lambda: self._withdraw(list(trials), why))

    def _withdraw(self, trials: list[Trial], why: str) -> None:
        for trial in trials:
            with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
                trial.set_user_attr(WITHDRAWN, True)
                trial.set_user_attr("message", why)
                self.study.tell(trial, state=TrialState.PRUNED)

    def beat(self, trials: Iterable[Trial]) -> None:
        """Tell the storage these trials' tuner is alive (from the probe's progress callback)."""
        try:
            with _interruptions_held():
                for trial in trials:
                    self.storage.record_heartbeat(trial._trial_id)
        except STORAGE_ERRORS as error:
            if not (self._server and lost_connection(error)):
                raise
            self.storage.scoped_session.remove()  # a missed beat: the next one tries again

    def fail_stale(self) -> list[int]:
        """Fail RUNNING trials whose tuner is gone; the search retries their points once.

        On this host a trial's owner process is checked directly (a killed tuner is seen at
        once); elsewhere a trial is stale when its heartbeat is older than ``GRACE_S``.

        Several tuners may do this at once (workers resuming together after one died): each
        trial is failed by one of them, and the others pass it by.

        Returns:
            The numbers of the trials failed here (not those that their own tuner finished,
            nor those another tuner failed first).
        """
        return self._retrying(self._fail_stale)

    def _fail_stale(self) -> list[int]:
        running = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        failed: list[int] = []
        others = []
        for trial in running:
            if not _owner_gone(trial.user_attrs):
                others.append(trial)
                continue
            # Another tuner may fail it between our read and our writes: it is then finished,
            # and Optuna refuses to update it.
            with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
                self.storage.set_trial_user_attr(trial._trial_id, "outcome", "stale")
                self.storage.set_trial_user_attr(
                    trial._trial_id, "message", "its tuner process ended while it ran"
                )
                if self.storage.set_trial_state_values(trial._trial_id, TrialState.FAIL):
                    failed.append(trial.number)
        if not others:
            return sorted(failed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            # Other hosts' trials, by heartbeat: failed with no outcome, which reads as stale.
            optuna.storages.fail_stale_trials(self.study)
        still = {t._trial_id for t in self.study.get_trials(states=(TrialState.RUNNING,))}
        for trial in others:
            if trial._trial_id in still:
                continue
            now = self.storage.get_trial(trial._trial_id)
            # Finished by their own tuner, they have an outcome (or were withdrawn).
            if now.state is TrialState.FAIL and "outcome" not in now.user_attrs:
                failed.append(trial.number)
        return sorted(failed)

    def record(self, trials: Iterable[Trial], result: ProbeResult) -> None:
        """Record a finished probe: each trial gets what the probe found at its size, and
        the study's values their points' standings."""
        for trial in trials:
            self._retrying(functools.partial(self._tell_once, trial, result))
        self._retrying(self._stand)

    def _stand(self) -> None:
        """Optuna's value of each completed trial of this generation made its point's
        standing (:func:`~autotune.study.measurement.standings`: the mean of its repeats, 0
        where it is no answer), and of an earlier generation's 0 once the study's readers read
        this one, so that Optuna's ``best_trial`` and optuna-dashboard's best trial are the
        best autotune reads. Optuna keeps a finished trial's value as told: the values are
        rewritten in its ``trial_values`` table, in one transaction, of the trials that hold
        their own measurement in :data:`~autotune.study.measurement.MEASURED` (a trial stored
        before it keeps its value)."""
        trials = {
            t.number: t
            for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if "micro_batch_size" in t.params and not t.user_attrs.get(WITHDRAWN)
        }
        mine = [t for t in trials.values() if trial_generation(t.user_attrs) == self.generation]
        wanted = standings(point(stored(t)) for t in mine)
        if self._read_generation == self.generation:  # the readers read this generation
            wanted.update((n, 0.0) for n in trials.keys() - wanted.keys())
        changes = [
            {"value": value, "trial_id": trials[number]._trial_id}
            for number, value in wanted.items()
            if trials[number].value != value and MEASURED in trials[number].user_attrs
        ]
        if changes:
            with self.storage.engine.begin() as connection:
                connection.execute(_SET_VALUE, changes)

    def _tell_once(self, trial: Trial, result: ProbeResult) -> None:
        """Tell a trial its result; a retry after a lost connection may find it told."""
        # An earlier try's write may have reached the server before the connection went.
        with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
            self.tell(trial, result)

    def interrupt(self, trials: Iterable[Trial], probe_dir: Path, why: str) -> None:
        """Record trials cut short through no fault of their point (Ctrl-C, the budget's end):
        failed as ``interrupted``, so the search retries the point once."""
        # The interruption may have cut a write short (a claim's or a record's: a heartbeat
        # holds it back), leaving this thread's session mid-transaction (Optuna rolls back only
        # on SQLAlchemy's own errors): start the record from a fresh session.
        self.storage.scoped_session.remove()
        for trial in trials:
            self._fail(
                trial, {"outcome": "interrupted", "message": why, "probe_dir": str(probe_dir)}
            )

    def tell(self, trial: Trial, result: ProbeResult) -> FrozenTrial:
        """Record what the probe found at this trial's micro-batch size."""
        mbs = int(trial.params["micro_batch_size"])
        entry = result.size(mbs)
        attrs: dict[str, Any] = {
            "probe_dir": str(result.probe_dir),
            "device": result.device,
            "simulated": result.device.startswith("simulated"),
            "grad_accum": self.workload.grad_accum(mbs),
            # The whole probe's wall time (every size it ran), as the budget charged it.
            "probe_wall_s": result.wall_s,
        }
        if entry is None and result.outcome is Outcome.HOST_OOM:
            # Killed by the host's OOM killer before any size ran: the configuration does not
            # fit the node at any size (the search rules out what needs as much host memory).
            attrs.update(outcome=Outcome.HOST_OOM.value, message=result.message)
            return self._infeasible(trial, attrs, 1.0)
        if entry is None:
            # Never run at this size: one an OOM rules out (inferred OOM: a larger size that
            # accumulates alike, space.oom_rules_out) or a probe that stopped early.
            smaller_oom = any(
                s.outcome is Outcome.OOM
                and oom_rules_out(s.micro_batch_size, mbs, self.workload.grad_accum)
                for s in result.sizes
            )
            if smaller_oom:
                attrs.update(outcome=Outcome.OOM.value, inferred=True)
                return self._infeasible(trial, attrs, 1.0)
            attrs.update(outcome="not_run", message=result.message or "the probe stopped early")
            return self._fail(trial, attrs)
        attrs.update(_measured(entry))
        attrs["outcome"] = entry.outcome.value
        if entry is result.other_engine:
            # The job trained another engine: what the search learns its engines from.
            attrs["outcome"] = OTHER_ENGINE
            return self._fail(trial, attrs)
        if entry.outcome is Outcome.OOM:
            return self._infeasible(trial, attrs, 1.0)
        if not entry.ok or entry.micro_step_s is None or entry.optimizer_step_s is None:
            attrs["message"] = entry.message or result.message
            return self._fail(trial, attrs)
        # The objective is taken at the user's accumulation count, not the probe's.
        speed = throughput(
            micro_step_s=entry.micro_step_s,
            optimizer_step_s=entry.optimizer_step_s,
            micro_batch_size=mbs,
            seq_len=self.workload.seq_len,
            grad_accum=attrs["grad_accum"],
            world_size=self.workload.world_size,
            model_flops_per_token=0.0,
            hardware_flops_per_token=0.0,
            peak_flops=None,
            model_parallel=result.spec.config.model_parallel,
        )
        scale = speed.tokens_per_second / (entry.tokens_per_second or speed.tokens_per_second)
        attrs["objective_mfu"] = entry.mfu * scale if entry.mfu else None
        attrs["objective_tokens_per_second"] = speed.tokens_per_second
        peak = entry.peak_bytes or 0
        # Feasible when the peak leaves the headroom free and the allocator did not thrash.
        capacity = self.capacity_bytes
        violation = peak / capacity - (1.0 - self.headroom) if capacity else 0.0
        if entry.alloc_retries:
            violation = max(violation, 0.01)
        objective = (
            attrs["objective_tokens_per_second"]
            if self.fingerprint.objective is Objective.TOKENS
            else attrs["objective_mfu"]
        )
        attrs[MEASURED] = float(objective or 0.0)
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        self._constrain(trial, violation)
        told = self.study.tell(trial, attrs[MEASURED])
        if violation <= 0 and self.generation != self._read_generation:
            # The new generation's first fit: from now on the study's readers read it.
            self.study.set_user_attr(GENERATION, self.generation)
            self._read_generation = self.generation
        return told

    def _infeasible(self, trial: Trial, attrs: dict[str, Any], violation: float) -> FrozenTrial:
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        self._constrain(trial, violation)
        return self.study.tell(trial, 0.0)

    def _constrain(self, trial: Trial, violation: float) -> None:
        """The trial's memory constraint (feasible at 0 or less), stored as the list of values
        under ``constraints`` that Optuna reads (as constraint ``0``) and optuna-dashboard
        reads (``Trial.set_constraint``'s ``constraints:memory`` is Optuna's alone)."""
        self.storage.set_trial_system_attr(trial._trial_id, CONSTRAINTS, [violation])

    def _fail(self, trial: Trial, attrs: dict[str, Any]) -> FrozenTrial:
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        return self.study.tell(trial, state=TrialState.FAIL)

    def updated(self) -> dt.datetime | None:
        """When the newest trial of the generation the study's readers read ended (None when
        none has): a re-tune cut before its first fit leaves the study as old as its answer."""
        ends = [
            t.datetime_complete
            for t in self.study.get_trials(deepcopy=False)
            if trial_generation(t.user_attrs) == self._read_generation
        ]
        return max((end for end in ends if end is not None), default=None)

    def measurements(self, states: Iterable[TrialState] | None = None) -> list[Measurement]:
        """Every trial of the study, decoded (all workers', resumed runs' included), except
        claims withdrawn in a race with another worker."""
        return self._retrying(lambda: self._measurements(states))

    def _measurements(self, states: Iterable[TrialState] | None) -> list[Measurement]:
        trials = self.study.get_trials(deepcopy=False, states=tuple(states) if states else None)
        return [
            _decode(t)
            for t in trials
            if "micro_batch_size" in t.params
            and not t.user_attrs.get(WITHDRAWN)
            and trial_generation(t.user_attrs) == self.generation
        ]

    def best(self, measurements: Iterable[Measurement] | None = None) -> Measurement | None:
        """The feasible point with the highest objective (the mean of its repeats), if any.

        Args:
            measurements: The study's measurements when the caller has read them already
                (else they are read here).
        """
        if measurements is None:
            measurements = self.measurements((TrialState.COMPLETE,))
        return best_point(measurements)


_SET_VALUE = sqlalchemy.text(
    "UPDATE trial_values SET value = :value WHERE trial_id = :trial_id AND objective = 0"
)
"""A finished trial's value rewritten, in Optuna's schema (whose revision Optuna's own storage
checks when the store opens it)."""


def _estimate_attrs(estimate: tuple[float | None, float | None] | None) -> dict[str, Any]:
    if estimate is None:
        return {}
    speed, peak = estimate
    return {"estimate_tokens_per_second": speed, "estimate_peak_bytes": peak}


def _owner() -> dict[str, Any]:
    """Who runs a trial: host, process id and the process's start time (pids are reused)."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pid_started": psutil.Process().create_time(),
    }


def _owner_gone(attrs: dict[str, Any]) -> bool:
    """Whether a trial's owner process ran on this host and has ended."""
    if attrs.get("host") != socket.gethostname() or "pid" not in attrs:
        return False
    try:
        return bool(psutil.Process(int(attrs["pid"])).create_time() != attrs.get("pid_started"))
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False  # not ours to inspect: leave it to the heartbeat


def _key(params: dict[str, Any], micro_batch_size: int, repeat: int) -> tuple[Any, ...]:
    config = {k: v for k, v in params.items() if k != "micro_batch_size"}
    return (*sorted(TrainConfig.from_dict(config).to_dict().items()), micro_batch_size, repeat)


_MEASURED = (
    "tokens_per_second",
    "tokens_per_second_per_rank",
    "mfu",
    "hfu",
    "micro_step_s",
    "optimizer_step_s",
    "step_s",
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "alloc_retries",
    "loss_dtype",
    "trained_engine",
    "trained_zero_stage",
)
"""What a trial keeps of its size's probe result (at the probe's accumulation count)."""


def _measured(entry: SizeResult) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        name: getattr(entry, name) for name in _MEASURED if getattr(entry, name) is not None
    }
    if entry.stage is not None:
        attrs["stage"] = entry.stage.value
    if entry.message:
        attrs["message"] = entry.message
    return attrs


def stored(trial: FrozenTrial) -> StoredTrial:
    """The fields of an Optuna trial that autotune decodes."""
    return StoredTrial(
        number=trial.number,
        state=trial.state.name,
        params=trial.params,
        user_attrs=trial.user_attrs,
        constraints=tuple(trial.constraints.values()),
        value=trial.value,
    )


def _decode(trial: FrozenTrial) -> Measurement:
    return decode(stored(trial))
