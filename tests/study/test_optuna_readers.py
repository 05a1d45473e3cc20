"""A study read with Optuna's own tools gives autotune's answer: ``study.best_trial`` and
optuna-dashboard's best trial are the point ``autotune best`` names, with its pooled value, and
optuna-dashboard shows the configurations that did not fit as infeasible.

The study is a finished ``autotune run`` on 8 simulated H100s whose simulated noise (seed 1)
leaves near-ties with the best that the search measures again; the dashboard is
optuna-dashboard's own WSGI application, asked for the study as its web page asks."""

from __future__ import annotations

import io
import json
import statistics
from collections import defaultdict
from typing import Any
from wsgiref.util import setup_testing_defaults

import optuna
import pytest
from optuna.trial import TrialState
from shared_study import FinishedRun, finished_run
from test_cli import LLAMA_8_H100, autotune

from autotune.study.measurement import MEASURED


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> FinishedRun:
    return finished_run(tmp_path_factory, *LLAMA_8_H100)


def _dashboard(storage: str, study_id: int) -> dict[str, Any]:
    """optuna-dashboard's reading of a study: the JSON its page renders."""
    from optuna_dashboard import wsgi

    app = wsgi(storage)
    environ: dict[str, Any] = {"PATH_INFO": f"/api/studies/{study_id}", "REQUEST_METHOD": "GET"}
    setup_testing_defaults(environ)
    status: list[str] = []
    body = b"".join(app(environ, lambda s, headers, *rest: status.append(s) or io.BytesIO().write))
    assert status == ["200 OK"], (status, body[:300])
    return json.loads(body)


def test_optunas_best_trial_and_the_dashboards_are_autotunes_best(run: FinishedRun) -> None:
    [row] = json.loads(autotune("best", "--storage", run.storage, "--json", cwd=run.folder).stdout)
    best = row["best"]
    study = optuna.load_study(study_name=row["study"], storage=run.storage)
    trials = study.get_trials(deepcopy=False)
    by_number = {t.number: t for t in trials}
    # The search measured near-ties again: points of several measurements, whose trials'
    # own measurements differ from the mean Optuna now holds as each trial's value.
    points: dict[tuple[Any, ...], list[optuna.trial.FrozenTrial]] = defaultdict(list)
    for t in trials:
        if t.state is TrialState.COMPLETE and MEASURED in t.user_attrs:
            points[tuple(sorted(t.params.items()))].append(t)
    repeated = [group for group in points.values() if len(group) > 1]
    assert repeated, "the run measured no point twice: the check would check nothing"
    assert best["repeats"] > 1
    assert any(t.value != t.user_attrs[MEASURED] for group in repeated for t in group)

    optunas = study.best_trial
    assert optunas.params == by_number[best["number"]].params
    assert optunas.value == pytest.approx(best["objective"], rel=1e-9)

    page = _dashboard(run.storage, study._study_id)
    [dashboards] = page["best_trials"]
    assert dashboards["number"] in {t.number for t in points[tuple(sorted(optunas.params.items()))]}
    assert dashboards["values"] == [pytest.approx(best["objective"], rel=1e-9)]
    # Every trial that did not fit is one the dashboard reads a violated constraint of.
    shown = {t["number"]: t for t in page["trials"]}
    did_not_fit = [t for t in trials if t.state is TrialState.COMPLETE and t.constraints]
    did_not_fit = [t for t in did_not_fit if max(t.constraints.values()) > 0]
    assert did_not_fit, "nothing ran out of memory: the check would check nothing"
    for t in did_not_fit:
        assert shown[t.number]["constraints"] and max(shown[t.number]["constraints"]) > 0


def test_every_value_is_its_points_mean_and_no_measurement_is_lost(run: FinishedRun) -> None:
    """Each completed trial's value is the mean of its point's own measurements where every
    one of them fit, else 0 (recomputed here from the trials, not by autotune's pooling); the
    trials' own measurements are kept beside it."""
    [name] = optuna.study.get_all_study_names(run.storage)
    study = optuna.load_study(study_name=name, storage=run.storage)
    done = [t for t in study.get_trials(deepcopy=False) if t.state is TrialState.COMPLETE]
    points: dict[tuple[Any, ...], list[optuna.trial.FrozenTrial]] = defaultdict(list)
    for t in done:
        points[tuple(sorted(t.params.items()))].append(t)
    assert len(points) > 5
    for group in points.values():
        fit = all(max(t.constraints.values()) <= 0 for t in group)
        mean = statistics.mean(t.user_attrs[MEASURED] for t in group) if fit else 0.0
        assert [t.value for t in group] == pytest.approx([mean] * len(group))
        for t in group:
            if MEASURED in t.user_attrs:  # the objective is tokens/s here
                assert t.user_attrs[MEASURED] == t.user_attrs["objective_tokens_per_second"]


def test_the_reports_best_so_far_ends_at_the_best_it_names(run: FinishedRun) -> None:
    """The search chart's "best so far" is the best as the search read it after each probe
    (a point's mean): it ends at the best the report names, not at a lucky measurement."""
    import plotly.graph_objects as go

    import autotune
    from autotune.report.html import _search_figure

    [study] = autotune.trials(storage=run.storage)
    assert study.best is not None and study.best.repeats > 1
    figure = _search_figure(study, go, {}, None)
    [line] = [trace for trace in figure.data if trace.name == "best so far"]
    assert line.y[-1] == pytest.approx(study.best.value)
    lucky = max(m.value for m in study.measurements if m.feasible and m.value)
    assert lucky > study.best.value  # the run's noise made one: the check has teeth
