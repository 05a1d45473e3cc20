"""The ``autotune`` command as a user runs it: exit codes, --json, one-line errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from shared_study import FinishedRun, finished_run

ARMED_MAIN = (
    "from autotune.probe import faults; faults.arm(); from autotune.cli import main; main()"
)
"""The test suite's entry point to the command: ``autotune.cli.main`` in a process armed for
test faults (a real ``autotune`` never is)."""


def autotune(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the real console entry point in a fresh interpreter (``env`` added to ours), armed
    for the test faults of ``AUTOTUNE_TEST_FAULT`` as the suite's own entry point."""
    return subprocess.run(
        [sys.executable, "-c", ARMED_MAIN, *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


TINY_CPU = (
    "--model",
    "tiny",
    "--device",
    "cpu",
    "--seq-len",
    "32",
    "--warmup-steps",
    "1",
    "--steps",
    "2",
)


def test_probe_table_and_exit_1_when_nothing_fits_then_json_is_the_result_file(
    tmp_path: Path,
) -> None:
    """A limit below the model's own size: OOM while building, exit 1, 'emulated' is said.
    Then a probe that fits: --json prints result.json, exit 0. Each probe's folder lands under
    --trials-dir/probes/<n>, numbered from 0 in the order they ran."""
    trials = tmp_path / "t"
    done = autotune(
        "probe",
        *TINY_CPU,
        "--device-memory",
        "64KiB",
        "--trials-dir",
        str(trials),
        cwd=tmp_path,
    )
    assert done.returncode == 1, done.stderr
    assert "emulated device memory 64.00 KiB" in done.stdout
    assert "outcome oom at build" in done.stdout
    assert (trials / "probes" / "0" / "result.json").is_file()
    second = autotune(
        "probe",
        *TINY_CPU,
        "--micro-batch",
        "1,2",
        "--json",
        "--trials-dir",
        str(trials),
        cwd=tmp_path,
    )
    assert second.returncode == 0, second.stderr
    data = json.loads(second.stdout)
    assert data["outcome"] == "ok"
    assert [s["micro_batch_size"] for s in data["sizes"]] == [1, 2]
    written = json.loads((trials / "probes" / "1" / "result.json").read_text())
    assert written == data


def test_models_json_lists_every_preset(tmp_path: Path) -> None:
    """`autotune models --json` gives each preset with its parameter count."""
    done = autotune("models", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = {row["name"]: row for row in json.loads(done.stdout)}
    assert {"llama-7b", "qwen2.5-1.5b", "gpt2", "tiny"} <= set(rows)
    assert abs(rows["llama-7b"]["params"] - 6.74e9) / 6.74e9 < 0.005


def test_plan_table_and_json(tmp_path: Path) -> None:
    """`autotune plan` ranks the space for a named GPU; --json carries every row."""
    args = ("plan", "--model", "llama-7b", "--gpu", "h100-80gb", "--gpus", "8")
    args += ("--seq-len", "4096", "--global-batch", "512")
    table = autotune(*args, "--top", "5", cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    assert "predicted, not measured" in table.stdout
    assert "configurations (" in table.stdout and "fit in" in table.stdout
    done = autotune(*args, "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["predicted"] is True and data["gpu"] == "h100-80gb"
    rows = data["rows"]
    assert rows[0]["fits"] and not rows[-1]["fits"]
    assert rows[0]["micro_batch_size"] * 8 * rows[0]["grad_accum"] == 512


def test_run_without_a_gpu_says_what_to_use(tmp_path: Path) -> None:
    done = autotune("run", "--model", "tiny", cwd=tmp_path)
    assert done.returncode == 2
    assert "--device cpu" in done.stderr and "--simulate" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_run_on_the_cpu_finds_a_fit_records_trials_and_resumes(tmp_path: Path) -> None:
    """Real CPU probes under an emulated cap; the rerun probes nothing it already knows."""
    args = ("run", "--model", "tiny", "--device", "cpu", "--device-memory", "3MiB")
    args += ("--seq-len", "128", "--global-batch", "16", "--budget", "2m")
    first = autotune(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "best: " in first.stdout
    assert (tmp_path / "trials" / "autotune.db").is_file()
    again = autotune(*args, "--json", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    summary = json.loads(again.stdout)
    assert summary["probes"] == 0
    best = summary["best"]
    assert best["micro_batch_size"] * best["grad_accum"] == 16
    assert best["peak_allocated_bytes"] <= 3 * 1024**2
    assert Path(best["probe_dir"]).is_dir()
    # Launchers read the best configuration back from the trial database.
    read = autotune("best", "--model", "tiny", "--json", cwd=tmp_path)
    assert read.returncode == 0, read.stderr
    (study,) = json.loads(read.stdout)
    assert study["study"] == summary["study"]
    assert study["best"]["config"] == best["config"]
    assert study["best"]["micro_batch_size"] == best["micro_batch_size"]
    listed = autotune("trials", "--json", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)[0]["trials"]
    assert len(rows) == study["trials"] >= 1
    assert {row["outcome"] for row in rows} <= {"ok", "oom"}
    missing = autotune("best", "--model", "llama-7b", cwd=tmp_path)
    assert missing.returncode == 2 and "run autotune run first" in missing.stderr


LLAMA_8_H100 = ("run", "--model", "llama-7b", "--simulate", "h100-80gb", "--gpus", "8")
LLAMA_8_H100 += ("--seed", "1", "--seq-len", "4096", "--global-batch", "512", "--json")
"""llama-7b on 8 simulated H100s. The simulated noise of seed 1 leaves near-ties with the best
to re-measure."""


@pytest.fixture(scope="session")
def llama_8_h100(tmp_path_factory: pytest.TempPathFactory) -> FinishedRun:
    """``autotune run`` of ``LLAMA_8_H100`` in the default storage, made once per session;
    each test copies its folder."""
    return finished_run(tmp_path_factory, *LLAMA_8_H100)


def test_run_on_a_simulated_gpu_says_so(tmp_path: Path, llama_8_h100: FinishedRun) -> None:
    llama_8_h100.copy_to(tmp_path)  # the run as if made here: trials/autotune.db
    summary = json.loads(llama_8_h100.stdout)
    assert "simulated" in summary["study"]
    assert summary["best"]["simulated"] is True
    assert summary["stop_reason"].startswith("search done")
    # Near-ties with the best were re-measured: the tables say which rows are re-measurements
    # and that the best is a mean.
    rows = json.loads(autotune("trials", "--json", cwd=tmp_path).stdout)[0]["trials"]
    again = [row for row in rows if row["repeat"]]
    assert again and any(row["repeat"] == 1 for row in again)
    # Each point's measurements are numbered 0, 1, ... (beyond 1 only for a tie-break).
    points: dict[str, list[int]] = {}
    for row in rows:
        points.setdefault(f"{row['label']} {row['micro_batch_size']}", []).append(row["repeat"])
    assert all(sorted(r) == list(range(len(r))) for r in points.values())
    listed = autotune("trials", cwd=tmp_path, env={"COLUMNS": "300"})
    assert listed.stdout.count("(re-measure ") == len(again)
    for row in again:
        assert f"(re-measure {row['repeat']})" in listed.stdout
    repeats = summary["best"]["repeats"]
    best = autotune("best", cwd=tmp_path, env={"COLUMNS": "300"})
    assert (f"(mean of {repeats})" in best.stdout) == (repeats > 1)
    # --last N: the N highest-numbered trials, in order; 0 is bad input.
    last = json.loads(autotune("trials", "--last", "2", "--json", cwd=tmp_path).stdout)
    assert [r["number"] for r in last[0]["trials"]] == sorted(r["number"] for r in rows)[-2:]
    zero = autotune("trials", "--last", "0", cwd=tmp_path)
    assert zero.returncode == 2 and "--last" in zero.stderr


def test_run_can_maximize_mfu_in_a_study_of_its_own(
    tmp_path: Path, llama_8_h100: FinishedRun
) -> None:
    """The tokens/s study of the workload is in the database: ``--objective mfu`` measures
    in a study of its own beside it."""
    llama_8_h100.copy_to(tmp_path)
    tokens = json.loads(llama_8_h100.stdout)
    # Five simulated minutes: a few probes of its own, not the whole search.
    done = autotune(*LLAMA_8_H100, "--objective", "mfu", "--budget", "5m", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    mfu = json.loads(done.stdout)
    assert "/mfu/" in mfu["study"] and mfu["study"].replace("/mfu", "") == tokens["study"]
    assert mfu["probes"] > 0  # its own study: nothing is reused from the tokens/s one
    best = mfu["best"]
    assert 0 < best["objective"] < 1 and best["objective"] == best["objective_mfu"]
    refused = autotune("run", "--model", "tiny", "--device", "cpu", "--device-memory", "4MiB",
                       "--objective", "mfu", cwd=tmp_path)  # fmt: skip
    assert refused.returncode == 2 and "--objective tokens" in refused.stderr


def test_a_probe_the_budget_cuts_short_is_recorded_as_interrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every rank hangs after its build: the budget's end, not a hang guard, stops the probe."""
    monkeypatch.setenv("AUTOTUNE_TEST_FAULT", "hang")
    args = ("run", "--model", "tiny", "--device", "cpu", "--device-memory", "4MiB")
    done = autotune(*args, "--seq-len", "64", "--budget", "12s", "--json", cwd=tmp_path)
    assert done.returncode == 1, done.stderr  # nothing measured, so no best
    summary = json.loads(done.stdout)
    assert summary["probes"] == 1 and summary["stop_reason"].startswith("budget spent")
    listed = json.loads(autotune("trials", "--json", cwd=tmp_path).stdout)[0]["trials"]
    assert listed and all(row["state"] == "FAIL" for row in listed)
    assert {row["outcome"] for row in listed} == {"interrupted"}  # retried by a later run
    assert {row["message"] for row in listed} == {"the budget ended during the probe"}


def test_plan_uses_the_measured_reserve_unless_told(tmp_path: Path) -> None:
    from autotune.estimator.plan import usable_bytes
    from autotune.hardware import gpu_spec
    from autotune.units import GIB

    gpu = gpu_spec("h100-80gb")
    default = autotune("plan", "--gpu", "h100-80gb", "--json", cwd=tmp_path)
    told = autotune("plan", "--gpu", "h100-80gb", "--reserve", "2GiB", "--json", cwd=tmp_path)
    assert default.returncode == 0 and told.returncode == 0, default.stderr + told.stderr
    assert json.loads(default.stdout)["rows"][0]["capacity_bytes"] == usable_bytes(gpu)
    assert json.loads(told.stdout)["rows"][0]["capacity_bytes"] == usable_bytes(
        gpu, reserve=2 * GIB
    )


def test_the_default_sequence_fits_the_model_and_a_longer_one_is_refused() -> None:
    """Without --seq-len a model is planned at 2048 tokens, or at its positions if it takes
    fewer (GPT-2's 1024, the tiny preset's 512); asking for more than it takes is bad input."""
    from autotune import api
    from autotune.config import ConfigError

    for model, expected in (("llama-7b", 2048), ("gpt2", 1024), ("tiny", 512)):
        found = api.plan(model, gpu="h100-80gb", gpus=1)
        assert found.workload.seq_len == expected, model
    assert api.plan("llama-7b", gpu="h100-80gb", gpus=1, seq_len=4096).workload.seq_len == 4096
    with pytest.raises(ConfigError, match="--seq-len 1025 is longer than gpt2 takes"):
        api.plan("gpt2", gpu="h100-80gb", gpus=1, seq_len=1025)


def test_the_storage_url_can_come_from_the_environment(tmp_path: Path) -> None:
    """``$AUTOTUNE_STORAGE`` stands for ``--storage`` (a password in argv is visible to every
    user of the machine in ``ps``; the environment is not), and ``--storage`` still wins. The
    run's header names its study, and its last line its probe count in words."""
    env = {"AUTOTUNE_STORAGE": f"sqlite:///{tmp_path / 'env.db'}"}
    run = ("run", "--model", "tiny", "--simulate", "a100-40gb", "--budget", "5m")
    done = autotune(*run, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "env.db").is_file() and not (tmp_path / "trials" / "autotune.db").exists()
    line = next(x for x in done.stdout.splitlines() if x.startswith("stopped:"))
    count = int(line.rsplit("; ", 1)[1].split()[0])
    probes = f"{count} probe this run" if count == 1 else f"{count} probes this run"
    # The budget used, on the simulated GPU's clock, beside the budget given.
    spent = re.search(rf"; {probes}, (\S+) of its 5m00s budget$", line)
    assert spent, line
    from autotune.units import parse_duration

    assert 0 < parse_duration(spent[1]) <= 300
    named = re.search(r"; study\s+(\S+)\s+in\s", done.stdout)
    assert named, done.stdout
    best = autotune("best", "--json", cwd=tmp_path, env=env)
    assert json.loads(best.stdout)[0]["study"] == named[1]
    given = autotune(
        "best", "--storage", f"sqlite:///{tmp_path / 'none.db'}", cwd=tmp_path, env=env
    )
    assert given.returncode != 0 and "none.db" in given.stderr


def test_bare_autotune_prints_the_help_and_version_prints_the_versions(tmp_path: Path) -> None:
    """``autotune`` alone: the help, exit 0, no error line. ``--version``: autotune's and its
    frameworks' versions. No help shows a ``<bool>`` type on a flag, every command's first
    line in the list is whole, and ``plan --help`` does not offer ``--simulate``."""
    bare = autotune(cwd=tmp_path)
    assert bare.returncode == 0 and "Usage: " in bare.stdout and not bare.stderr
    version = autotune("--version", cwd=tmp_path)
    assert version.returncode == 0
    assert version.stdout.startswith("autotune ") and "torch " in version.stdout
    assert "deepspeed " in version.stdout and "optuna " in version.stdout
    helps = {}
    for command in ("", "probe", "plan", "run", "best", "trials", "export", "report", "models"):
        shown = autotune(*([command] if command else []), "--help", cwd=tmp_path)
        assert shown.returncode == 0, shown.stderr
        assert "<bool>" not in shown.stdout, command
        helps[command] = shown.stdout
    listed = helps[""]  # autotune --help
    assert "export  The best configuration in a trainer's own format." in listed
    assert "report  One self-contained HTML page of a study (works offline)." in listed
    assert "--simulate" not in helps["plan"]


def test_the_library_prints_no_optuna_line(tmp_path: Path) -> None:
    """``autotune.tune`` in a script: Optuna's "A new study created in RDB" stays unsaid (the
    caller decides what to print), and Optuna's verbosity is the script's again afterwards."""
    code = (
        "import autotune, optuna\n"
        "summary = autotune.tune('tiny', simulate='h100-80gb', budget='1m', "
        "storage='sqlite:///x.db')\n"
        "assert summary.best is not None\n"
        "print(optuna.logging.get_verbosity() == optuna.logging.INFO)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "A new study" not in done.stderr + done.stdout
    assert done.stdout.strip() == "True"


def test_the_live_log_and_the_tables_show_one_figure_per_point(tmp_path: Path) -> None:
    """Every size the live log reports is the figure the study recorded (at the workload's
    accumulation, which the line names), so the log and the tables never disagree; with
    ``--json`` the same progress goes to stderr and stdout is the summary alone."""
    args = ("run", "--model", "qwen2.5-1.5b", "--simulate", "h100-80gb", "--global-batch", "256")
    done = autotune(*args, "--budget", "2m", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    json.loads(done.stdout)  # nothing but the summary
    logged = re.findall(r"(\d+): ok ([\d,]+) tok/s \(accum (\d+)\)", done.stderr)
    assert logged, done.stderr
    listed = json.loads(autotune("trials", "--json", cwd=tmp_path).stdout)[0]["trials"]
    recorded = {
        (row["micro_batch_size"], round(row["tokens_per_second"]), row["grad_accum"])
        for row in listed
        if row["outcome"] == "ok"
    }
    for size, speed, accum in logged:
        assert (int(size), int(speed.replace(",", "")), int(accum)) in recorded
    assert any(int(accum) > 2 for _, _, accum in logged)  # the probe's own was at most 2


def test_run_takes_precision_and_attention_as_plan_and_probe_do(tmp_path: Path) -> None:
    """``run --precision fp16-mixed --attention eager``: every configuration the search
    probes has that precision and attention kernel, and the job file takes them too."""
    args = ("run", "--model", "tiny", "--simulate", "a100-40gb", "--budget", "2m")
    done = autotune(*args, "--precision", "fp16-mixed", "--attention", "eager", "--json",
                    cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    (tmp_path / "jobs.yaml").write_text(
        "workloads:\n  - model: tiny\n    precision: fp32\n    simulate: a100-40gb\n"
        "    budget: 2m\n"
    )
    jobs = autotune("run", "--jobs", "jobs.yaml", "--json", cwd=tmp_path)
    assert jobs.returncode == 0, jobs.stderr
    studies = json.loads(autotune("trials", "--json", cwd=tmp_path).stdout)
    # Another precision is another question: a study of its own, named so.
    assert [s["study"].split("/")[3:-1] for s in studies] == [["fp16-mixed", "eager"], ["fp32"]]
    rows = studies[0]["trials"]  # the first run's study
    assert rows and {(r["config"]["precision"], r["config"]["attention"]) for r in rows} == {
        ("fp16-mixed", "eager")
    }
    assert {r["config"]["precision"] for r in studies[1]["trials"]} == {"fp32"}


def test_plan_says_what_to_run_next_and_run_takes_it(tmp_path: Path) -> None:
    """``plan``'s last line is the ``run`` that measures it; that command, on the simulated
    GPU the plan was for, tunes (exit 0). A layout's degrees are written as run takes them."""
    import shlex

    from autotune.config import Engine, Schedule, TrainConfig
    from autotune.layouts import layout_flags

    done = autotune(
        "plan", "--model", "llama-7b", "--gpu", "h100-80gb", "--gpus", "8", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    said = " ".join(done.stdout.split("next: ", 1)[1].split())  # as any terminal wraps it
    command = shlex.split(said.split(" on NVIDIA H100", 1)[0])
    assert command[:2] == ["autotune", "run"] and "--gpus" in command
    storage = f"sqlite:///{tmp_path}/t.db"
    ran = autotune(*command[1:], "--simulate", "h100-80gb", "--budget", "2m", "--storage",
                   storage, cwd=tmp_path)  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    layout = TrainConfig(
        engine=Engine.FSDP, zero_stage=3, tp=4, pp=2, pp_schedule=Schedule.INTERLEAVED_1F1B,
        pp_virtual=2,
    )  # fmt: skip
    assert layout_flags(layout) == [
        "--tp", "4", "--pp", "2", "--pp-schedule", "interleaved-1f1b", "--pp-virtual", "2",
    ]  # fmt: skip
    assert layout_flags(TrainConfig()) == []
