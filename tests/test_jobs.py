"""``autotune run --jobs``: many workloads from one file, each re-tuned only when something
changed; the file's errors name the file, the line and the field."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import sqlite3
import time
from pathlib import Path

import pytest

from autotune.config import ConfigError
from autotune.jobs import JobResult, freshness, read_jobs
from autotune.study.fingerprint import Fingerprint
from autotune.study.measurement import StudyResult
from autotune.study.reader import read_studies
from autotune.study.schema import GENERATION
from autotune.study.store import TrialStore
from autotune.tuned.script import ScriptJob
from tests.test_cli import autotune

NIGHTLY = """\
workloads:
  - model: llama-7b
    gpus: 8
    budget: 10m
  # a second workload, two GPUs fewer than the command line's
  - model: qwen2.5-1.5b
    seq-len: 4096
    global_batch: 64
    engine: [fsdp]
    loss: [chunked]
    optimizer: adamw,adamw-8bit
    lora_rank: 16
"""


def test_the_job_file_merges_the_command_line_under_each_workload(tmp_path: Path) -> None:
    path = tmp_path / "nightly.yaml"
    path.write_text(NIGHTLY)
    first, second = read_jobs(path, {"budget": "30m", "gpus": 4, "storage": "x", "seed": None})
    assert (first.index, first.line, second.index, second.line) == (1, 2, 2, 6)
    assert first.options == {"model": "llama-7b", "gpus": 8, "budget": "10m", "storage": "x"}
    assert second.options["seq_len"] == 4096 and second.options["engine"] == "fsdp"
    assert second.options["gpus"] == 4 and second.options["budget"] == "30m"
    assert second.options["loss"] == "chunked"
    assert second.options["optimizer"] == "adamw,adamw-8bit"
    assert second.options["lora_rank"] == 16
    assert second.label() == (
        "qwen2.5-1.5b engine fsdp global-batch 64 lora-rank 16 loss chunked optimizer "
        "adamw,adamw-8bit seq-len 4096"
    )


def test_a_workloads_own_storage_is_masked_in_its_label_and_options(tmp_path: Path) -> None:
    path = tmp_path / "nightly.yaml"
    path.write_text(
        "workloads:\n  - model: tiny\n    storage: postgresql://u:pw1@h/db?sslpassword=pw2\n"
    )
    [job] = read_jobs(path, {})
    assert job.label() == "tiny storage postgresql://u:***@h/db?sslpassword=***"
    assert "pw" not in json.dumps(JobResult(job=job, status="failed", why="x").to_dict())


A = "workloads:\n  - model: a\n"
"""A job file's start: one workload."""


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("workloads: [", r":1: not valid YAML"),
        ("- model: x\n", r":1: a job file is a mapping with a workloads: list"),
        ("jobs:\n  - model: x\n", r":1: unknown top-level key 'jobs'"),
        ("workloads: []\n", r":1: workloads: must be a list of at least one mapping"),
        ("workloads:\n  - llama-7b\n", r":2: workload 1: not a mapping"),
        ("workloads:\n  - gpus: 8\n", r":2: workload 1: no model"),
        (A + "  - model: b\n    seqlen: 9\n",
         r":4: workload 2: unknown field 'seqlen': did you mean seq_len\?"),
        (A + "    seq_len: long\n", r":3: workload 1: seq_len must be an integer, not 'long'"),
        (A + "    gpus: true\n", r":3: workload 1: gpus must be an integer"),
        (A + "    budget: -5m\n", r":3: workload 1: .*-5m"),
        (A + "    budget: soon\n", r":3: workload 1: .*soon"),
        (A + "    engine: megatron\n", r":3: workload 1: unknown engine"),
        (A + "    loss: [full, liger]\n", r":3: workload 1: unknown loss in \['full', 'liger'\]"),
        (A + "    ac_ops: sometimes\n", r":3: workload 1: ac_ops must be true/false"),
        (A + "    optimizer: [adamw, sgd]\n", r":3: workload 1: unknown optimizer in \['adamw'"),
        (A + "    headroom: 150%\n", r":3: workload 1: .*150%"),
        (A + "    global_batch: 0\n", r":3: workload 1: global_batch must be positive"),
        (A + "    gpus: 2\n    gpus: 4\n", r":4: workload 1: gpus is set twice"),
        (A + "workloads:\n  - model: b\n", r":3: workloads: is set twice"),
        (A + "  - model: llama-7bb\n", r":3: workload 2: unknown model 'llama-7bb'"),
        (A + "    budget: .nan\n", r":3: workload 1: budget nan has no unit"),
        (A + "    budget: .inf\n", r":3: workload 1: budget inf has no unit"),
        (A + "    budget: 45\n", r":3: workload 1: budget 45 has no unit: write it like 45m"),
        (A + "    budget: -5\n", r":3: workload 1: budget -5 has no unit"),
        (A + "    budget: '45'\n", r":3: workload 1: budget 45 has no unit: write it like 45m"),
        (A + "    headroom: 150\n", r":3: workload 1: .*headroom '150' must be between 0% and"),
        (A + "    device_memory: -1\n", r":3: workload 1: device_memory -1 has no unit"),
        (A + "    device_memory: 0GiB\n", r":3: workload 1: device_memory must be a positive"),
        (A + "    objective: speed\n", r":3: workload 1: unknown objective 'speed'"),
        (A + "    device: tpu\n", r":3: workload 1: unknown device 'tpu'"),
        (A + "    simulate: h100x\n", r":3: workload 1: .*unknown GPU 'h100x'"),
        (A + "    precision: fp8\n", r":3: workload 1: unknown precision 'fp8': use one of"),
        (A + "    attention: flash9\n", r":3: workload 1: unknown attention 'flash9'"),
        (A + "    seed: !!python/object/apply:os.system [echo hi]\n",
         r":3: workload 1: seed: could not determine a constructor"),
        (A + "    script: nowhere.py\n", r":3: workload 1: the script nowhere.py does not exist"),
        (A + "    script: " + __file__ + "\n",
         r":2: workload 1: a script: needs its framework: hf or accelerate or torchrun"),
        (A + "    script: " + __file__ + "\n    framework: keras\n",
         r":4: workload 1: unknown framework 'keras'"),
        (A + "    framework: hf\n",
         r":2: workload 1: framework, args, batch_flag, accum_flag, checkpointing_flag go"),
        (A + "    script: " + __file__ + "\n    framework: hf\n    args: --lr\n",
         r":5: workload 1: args must be a list, not '--lr'"),
        (A + "    script: " + __file__ + "\n    framework: hf\n    batch_flag: --bs\n",
         r":2: workload 1: --batch-flag with --framework hf"),
    ],
)  # fmt: skip
def test_a_bad_job_file_is_one_line_naming_file_line_and_field(
    tmp_path: Path, text: str, says: str
) -> None:
    path = tmp_path / "nightly.yaml"
    path.write_text(text.replace("model: a\n", "model: tiny\n"))
    with pytest.raises(ConfigError, match=rf"^{path}{says}") as raised:
        read_jobs(path, {})
    assert "\n" not in str(raised.value)


def test_a_workload_names_its_script_framework_and_arguments(tmp_path: Path) -> None:
    path = tmp_path / "nightly.yaml"
    path.write_text(
        "workloads:\n  - model: tiny\n    script: " + __file__ + "\n    framework: torchrun\n"
        "    batch_flag: --batch-size\n    args: [--data, d/, --epochs, 2]\n"
    )
    (job,) = read_jobs(path, {})
    assert job.options["script"] == __file__
    assert job.options["framework"] == "torchrun"
    assert job.options["args"] == ["--data", "d/", "--epochs", "2"]
    assert job.options["batch_flag"] == "--batch-size"


def test_a_job_file_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    path = tmp_path / "nightly.yaml"
    path.write_bytes(b"workloads:\n  - model: \xff\xfe\n")
    with pytest.raises(ConfigError, match=rf"^{path}: not a text file in UTF-8"):
        read_jobs(path, {})


FP = Fingerprint(
    model="llama-7b",
    seq_len=2048,
    global_batch=64,
    gpu="h100-80gb",
    gpu_memory_bytes=80 << 30,
    gpus=8,
    software={"torch": "2.13.0", "deepspeed": "0.19.8", "transformers": "5.23.0", "driver": "580"},
)
NOW = dt.datetime(2026, 11, 23, 23, 0)


def _study(fingerprint: Fingerprint, *, hours_ago: float, fits: bool = True) -> StudyResult:
    """A stored study as the reader gives it, with a best (any measurement) when it fits."""
    from autotune.config import TrainConfig
    from autotune.study.measurement import Measurement

    best = Measurement(
        number=0, config=TrainConfig(), micro_batch_size=1, state="COMPLETE", outcome="ok",
        feasible=True, value=1.0,
    )  # fmt: skip
    return StudyResult(
        fingerprint=fingerprint,
        measurements=[best],
        trial_count=1,
        best=best if fits else None,
        updated=NOW - dt.timedelta(hours=hours_ago),
    )


def test_an_unchanged_fit_stands_until_it_is_older_than_the_max_age() -> None:
    stored = [_study(FP, hours_ago=30)]
    kept = freshness(FP, stored, now=NOW)
    assert not kept.tune and "unchanged since it was tuned 30h00m ago" in kept.why
    assert not freshness(FP, stored, now=NOW, max_age_s=2 * 86400).tune
    aged = freshness(FP, stored, now=NOW, max_age_s=86400)
    assert aged.tune and aged.again
    assert aged.why == "its result is 30h00m old (--max-age 24h00m): measured again"
    week = freshness(FP, [_study(FP, hours_ago=24 * 8 + 3)], now=NOW, max_age_s=7 * 86400)
    assert week.tune and week.why == "its result is 8d3h old (--max-age 7d): measured again"
    assert not freshness(FP, [_study(FP, hours_ago=1, fits=False)], now=NOW, max_age_s=60).again


def test_a_changed_fingerprint_is_tuned_and_says_what_changed() -> None:
    newer = dataclasses.replace(FP, software={**FP.software, "torch": "2.14.1", "driver": "590"})
    older = dataclasses.replace(FP, software={**FP.software, "torch": "2.12.0"})
    stored = [_study(older, hours_ago=48), _study(FP, hours_ago=2)]
    why = freshness(newer, stored, now=NOW).why
    assert why == "changed since it was tuned: driver 580 -> 590, torch 2.13.0 -> 2.14.1"
    more = dataclasses.replace(FP, gpus=16, nodes=2, gpu_memory_bytes=40 << 30)
    why = freshness(more, stored, now=NOW).why
    assert "gpus 8 -> 16" in why and "nodes 1 -> 2" in why and "memory per GPU" in why
    other_workload = dataclasses.replace(FP, seq_len=4096)
    assert freshness(other_workload, stored, now=NOW).why == "never tuned"
    nothing_fits = freshness(FP, [_study(FP, hours_ago=1, fits=False)], now=NOW)
    assert nothing_fits.tune and "no configuration that fits" in nothing_fits.why


def test_a_changed_script_or_its_arguments_is_tuned_and_says_so(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('v1')\n")
    job = ScriptJob.read(script, "hf", ["--lr", "1"])
    tuned = dataclasses.replace(FP, script=job.to_dict())
    stored = [_study(tuned, hours_ago=2)]
    assert not freshness(tuned, stored, now=NOW).tune
    other_args = dataclasses.replace(
        FP, script=dataclasses.replace(job, args=("--lr", "2")).to_dict()
    )
    assert freshness(other_args, stored, now=NOW).why == (
        "changed since it was tuned: the arguments of train.py"
    )
    script.write_text("print('v2')\n")
    edited = ScriptJob.read(script, "hf", ["--lr", "1"])
    why = freshness(dataclasses.replace(FP, script=edited.to_dict()), stored, now=NOW).why
    assert why == (
        f"changed since it was tuned: the script train.py changed (sha256 {job.sha256[:8]} -> "
        f"{edited.sha256[:8]})"
    )
    assert freshness(FP, stored, now=NOW).why == (
        "changed since it was tuned: the job train.py -> autotune's stand-in"
    )


def _trials(db: Path) -> int:
    with sqlite3.connect(db) as connection:
        return int(connection.execute("SELECT COUNT(*) FROM trials").fetchone()[0])


def test_a_nightly_job_tunes_each_workload_then_skips_what_did_not_change(
    tmp_path: Path,
) -> None:
    """Two simulated workloads, run three times: tuned; all skipped (no trial added); one
    tuned again because its GPU count changed. A workload that nothing fits fails alone."""
    (tmp_path / "nightly.yaml").write_text(NIGHTLY)
    db = tmp_path / "t.db"
    common = ("--simulate", "a100-40gb", "--storage", f"sqlite:///{db}", "--json")
    args = ("run", "--jobs", "nightly.yaml", *common)

    first = autotune(*args, "--gpus", "4", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    done = json.loads(first.stdout)
    assert [w["status"] for w in done["workloads"]] == ["tuned", "tuned"]
    assert {w["why"] for w in done["workloads"]} == {"never tuned"}
    assert done["workloads"][0]["run"]["probes"] > 0 and done["failed"] == 0
    studies = {s.study_name: s for s in read_studies(f"sqlite:///{db}")}
    assert {w["study"] for w in done["workloads"]} == set(studies)
    assert {s.fingerprint.gpus for s in studies.values()} == {8, 4}
    trials = _trials(db)

    again = autotune(*args, "--gpus", "4", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    skipped = json.loads(again.stdout)["workloads"]
    assert [w["status"] for w in skipped] == ["skipped", "skipped"]
    assert all(w["why"].startswith("unchanged since it was tuned") for w in skipped)
    assert [w["best"]["label"] for w in skipped] == [w["best"]["label"] for w in done["workloads"]]
    assert _trials(db) == trials

    fewer = autotune(*args, "--gpus", "2", "--budget", "5m", cwd=tmp_path)
    assert fewer.returncode == 0, fewer.stderr
    third = json.loads(fewer.stdout)["workloads"]
    assert third[0]["status"] == "skipped"  # sets gpus: 8 itself
    assert (
        third[1]["status"] == "tuned"
        and third[1]["why"] == "changed since it was tuned: gpus 4 -> 2"
    )

    (tmp_path / "broken.yaml").write_text(
        "workloads:\n  - model: llama-7b\n    device_memory: 1GiB\n  - model: qwen2.5-1.5b\n"
    )
    table = autotune("run", "--jobs", "broken.yaml", *common[:-1], "--gpus", "4", cwd=tmp_path)
    assert table.returncode == 1, table.stderr  # one workload failed: a scheduler hears of it
    assert "workload 1 (broken.yaml:2) llama-7b device-memory 1GiB: no fit" in table.stdout
    assert "no configuration of llama-7b on 4 GPUs fits" in " ".join(table.stdout.split())
    # The next one ran: its row says tuned, and why (a fresh workload: never tuned).
    second = next(line for line in table.stdout.splitlines() if "│ 2 │" in line)
    cells = [cell.strip() for cell in second.split("│")]
    assert cells[2:5] == ["qwen2.5-1.5b", "tuned", "never tuned"], second


def test_a_result_older_than_the_max_age_is_measured_again_beside_the_old_trials(
    tmp_path: Path,
) -> None:
    """A nightly job with ``--max-age``: the aged workload's study is searched afresh (new
    trials, the earlier ones kept), its best is the new measurements', and what reads the
    study reads the new generation from then on: autotune's reader, and Optuna's own view
    through the store (the same trials)."""
    # One engine: the search ends (nothing left to probe) within a few seconds' probes.
    (tmp_path / "nightly.yaml").write_text(
        "workloads:\n  - model: qwen2.5-1.5b\n    engine: [ddp]\n"
    )
    db = tmp_path / "t.db"
    url = f"sqlite:///{db}"
    args = ("run", "--jobs", "nightly.yaml", "--simulate", "a100-40gb", "--storage", url)
    args += ("--gpus", "4", "--budget", "10h", "--json")
    first = autotune(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    [tuned] = json.loads(first.stdout)["workloads"]
    assert tuned["status"] == "tuned" and tuned["run"]["probes"] > 0
    assert tuned["run"]["stop_reason"].startswith("search done")  # a re-run finds nothing new
    trials = _trials(db)
    [before] = read_studies(url)

    time.sleep(1.1)  # older than the --max-age below
    aged = autotune(*args, "--max-age", "1s", cwd=tmp_path)
    assert aged.returncode == 0, aged.stderr
    [again] = json.loads(aged.stdout)["workloads"]
    assert again["status"] == "tuned", again
    assert again["why"].startswith("its result is") and again["why"].endswith("measured again")
    # Measured again: as many probes as the first search (the same simulated GPU and seed),
    # the first night's trials kept.
    assert again["run"]["probes"] == tuned["run"]["probes"]
    assert _trials(db) > trials
    with sqlite3.connect(db) as connection:
        generations = dict(
            connection.execute(
                "SELECT value_json, COUNT(*) FROM trial_user_attributes WHERE key = ? "
                "GROUP BY value_json",
                (GENERATION,),
            ).fetchall()
        )
    assert set(generations) == {"1"} and generations["1"] == _trials(db) - trials
    [after] = read_studies(url)
    assert after.study_name == before.study_name  # one study, measured again
    assert after.trial_count == before.trial_count  # the new generation's trials alone
    assert after.best is not None and after.best.number >= trials  # a trial of tonight's
    [store] = TrialStore.existing(url)
    assert store.generation == 1
    assert sorted(m.number for m in store.measurements()) == sorted(
        m.number for m in after.measurements
    )
    best = json.loads(autotune("best", "--storage", url, "--json", cwd=tmp_path).stdout)
    assert best[0]["best"]["number"] == after.best.number

    # The next night, without --max-age: the new result stands.
    kept = autotune(*args, cwd=tmp_path)
    [skipped] = json.loads(kept.stdout)["workloads"]
    assert skipped["status"] == "skipped" and skipped["best"]["number"] == after.best.number

    # A re-tune cut before its first fit (its one probe interrupted): the study is as old
    # as its last answer, so the night after measures it again rather than taking the cut
    # re-tune's trial for a fresh result.
    store.measure_again()
    measured = after.best
    cut = store.ask(measured.config, measured.micro_batch_size)
    store.interrupt([cut], tmp_path, "the budget's end")
    [read] = read_studies(url)
    assert read.updated == after.updated and read.best is not None
    assert read.best.number == after.best.number
    assert TrialStore.existing(url)[0].updated() == after.updated


def test_a_bad_job_file_runs_nothing_and_writes_nothing(tmp_path: Path) -> None:
    (tmp_path / "nightly.yaml").write_text("workloads:\n  - model: llama-7b\n    seq_len: x\n")
    db = tmp_path / "t.db"
    done = autotune(
        "run", "--jobs", "nightly.yaml", "--simulate", "a100-40gb", "--storage", f"sqlite:///{db}",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "error: nightly.yaml:3: workload 1: seq_len must be an integer, not 'x'"
    )
    assert not db.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["nightly.yaml"]
    both = autotune("run", "--jobs", "nightly.yaml", "--model", "gpt2", cwd=tmp_path)
    assert both.returncode == 2 and "name each workload's model in the job file" in both.stderr
    alone = autotune("run", "--max-age", "7d", "--simulate", "a100-40gb", cwd=tmp_path)
    assert alone.returncode == 2 and "--max-age applies to --jobs" in alone.stderr
