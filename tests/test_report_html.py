"""``autotune report``: a real (simulated) study rendered as HTML and opened in headless
Chromium, which runs the inlined plotly: every chart draws, and a trial's message that holds
markup shows as text."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import optuna
import pytest

import autotune
from autotune.report.html import _search_clock, read_trial_times

CHARTS = ("memory", "tokens", "mfu", "search")
EVIL = "<script>alert(1)</script>"
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _chromium() -> str:
    """The headless browser; skipped without one, but a failure under CI (it must run)."""
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    reason = "no chromium binary: apt-get install -y --no-install-recommends chromium"
    if "CI" in os.environ:
        pytest.fail(f"{reason} (CI must run the report's browser test)", pytrace=False)
    pytest.skip(reason)


def has(text: str, pattern: str) -> bool:
    """Whether ``pattern`` (a regular expression) occurs in ``text`` (a page of megabytes,
    kept out of the assertion's message)."""
    return re.search(pattern, text) is not None


def _dump_dom(browser: str, page: Path, tmp_path: Path) -> str:
    """The page's DOM after its scripts ran (plotly draws each chart synchronously)."""
    done = subprocess.run(
        [
            browser,
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            "--no-first-run",
            f"--user-data-dir={tmp_path / 'chromium-profile'}",
            "--virtual-time-budget=5000",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.fixture(scope="module")
def searched(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, float]:
    """A simulated search with an out-of-memory probe, and one more trial whose message and
    probe folder hold markup (a failed probe, added through Optuna as the store would): the
    storage, and the time the search charged to its budget."""
    tmp = tmp_path_factory.mktemp("study")
    url = f"sqlite:///{tmp}/t.db"
    summary = autotune.tune(
        "llama-7b", simulate="a100-40gb", gpus=8, budget="10m", storage=url,
        trials_dir=tmp / "trials",
    )  # fmt: skip
    assert summary.best is not None
    assert any(m.outcome == "oom" for m in summary.measurements)
    [study] = optuna.get_all_study_summaries(url)
    loaded = optuna.load_study(study_name=study.study_name, storage=url)
    model = loaded.trials[0]
    loaded.add_trial(
        optuna.trial.create_trial(
            state=optuna.trial.TrialState.FAIL,
            params=model.params,
            distributions=model.distributions,
            user_attrs={
                **model.user_attrs,
                "outcome": "error",
                "message": EVIL,
                "probe_dir": str(tmp / "trials" / "<b>odd</b>"),
            },
        )
    )
    return url, summary.elapsed_s


@pytest.fixture(scope="module")
def storage(searched: tuple[str, float]) -> str:
    return searched[0]


def test_the_report_draws_every_chart_and_shows_markup_as_text(
    storage: str, tmp_path: Path
) -> None:
    browser = _chromium()
    page = tmp_path / "report.html"
    done = autotune.write_report(page, model="llama-7b", storage=storage, budget="10m")
    assert done.path == page and done.study.startswith("llama-7b/")
    source = page.read_text()
    # Self-contained: plotly inlined, no script or style loaded from elsewhere.
    assert not has(source, r"<script[^>]+src=|<link[^>]+href=")
    assert not has(source, re.escape(EVIL))
    assert has(source, re.escape("&lt;script&gt;alert(1)&lt;/script&gt;"))
    # The launch of the best configuration, in the formats that express it.
    assert has(source, "autotune export --format torchrun")

    dom = _dump_dom(browser, page, tmp_path)
    for chart in CHARTS:
        assert has(dom, rf'<div id="chart-{chart}" class="[^"]*js-plotly-plot'), chart
    assert dom.count('class="plot-container') == len(CHARTS)
    assert dom.count('<svg class="main-svg"') >= len(CHARTS)
    # The message is text in the probe table, never an element; so is the folder's name.
    assert not has(dom, re.escape("<script>alert(1)"))
    assert has(dom, re.escape("&lt;script&gt;alert(1)&lt;/script&gt;"))
    assert has(dom, "&lt;b&gt;odd&lt;/b&gt;") and not has(dom, "<b>odd</b>")
    # The OOM is marked on the speed charts, the probes link to their folders.
    assert has(dom, "did not fit")
    assert has(dom, r'<a href="file:///[^"]+/trials/')


def test_the_search_goes_by_time_and_the_api_writes_after_the_package_loaded(
    storage: str, tmp_path: Path
) -> None:
    [study] = autotune.trials(model="llama-7b", storage=storage)
    times = read_trial_times(storage, study.study_name)
    assert set(times) == {m.number for m in study.measurements}
    assert all(t.start is not None for t in times.values())
    importlib.import_module("autotune.report.tables")  # the package, beside the function

    again = autotune.write_report(tmp_path / "again.html", storage=storage)
    assert again.path.stat().st_size > 1_000_000  # plotly's JavaScript, inlined


def test_the_command_refuses_to_overwrite_and_prints_json(storage: str, tmp_path: Path) -> None:
    page = tmp_path / "r.html"
    page.write_text("keep")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", "from autotune.cli import main; main()", "report", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    refused = run("-o", str(page), "--storage", storage)
    assert refused.returncode == 2 and page.read_text() == "keep"
    assert "exists: add --force" in refused.stderr and len(refused.stderr.splitlines()) == 1
    missing = run("-o", str(tmp_path / "x.html"), "--storage", storage, "--study", "nope")
    assert missing.returncode == 2 and not (tmp_path / "x.html").exists()
    written = run("-o", str(page), "--storage", storage, "--force", "--json")
    assert written.returncode == 0, written.stderr
    out = json.loads(written.stdout)
    assert out["path"] == str(page) and out["study"].startswith("llama-7b/")
    assert page.read_text().startswith("<!DOCTYPE html>")


def test_the_search_chart_runs_on_the_budget_clock(searched: tuple[str, float]) -> None:
    """The simulated search's chart ends where its budget's clock stopped: each probe counted
    once, though it measured several sizes (trials)."""
    url, elapsed_s = searched
    [study] = autotune.trials(model="llama-7b", storage=url)
    trials = sorted(study.measurements, key=lambda m: m.number)[:-1]  # the added trial: no run
    assert len({m.probe_dir for m in trials}) < len(trials)
    xs, title = _search_clock(trials, {})
    assert title.startswith("probe time spent")
    assert xs == sorted(xs) and xs[0] > 0
    assert xs[-1] == pytest.approx(elapsed_s, rel=1e-6)


def test_a_cpu_study_has_no_mfu_chart_and_names_its_cpu_ranks(tmp_path: Path) -> None:
    """A study of real CPU probes has no peak FLOP/s, so no MFU: the report draws no empty
    MFU chart, and says its device is CPU ranks under an emulated cap, not a GPU."""
    from tests.test_cli import autotune as run

    storage = f"sqlite:///{tmp_path / 'cpu.db'}"
    done = run(
        "run", "--model", "tiny", "--device", "cpu", "--device-memory", "4MiB", "--seq-len",
        "32", "--global-batch", "4", "--engine", "single", "--budget", "2m", "--storage",
        storage, "--trials-dir", str(tmp_path / "trials"), cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    page = tmp_path / "cpu.html"
    autotune.write_report(page, model="tiny", storage=storage)
    source = page.read_text()
    assert "chart-tokens" in source and "chart-mfu" not in source
    assert "1 CPU rank, each under an emulated 4.00 MiB device" in source
    assert "× cpu" not in source
