"""Which study ``export`` and ``report`` read when a model has several: picked by what a user
knows (``--gpus``, ``--seq-len``, ``--global-batch``), of one workload the study measured on this
node's software, else the newest, and said on stderr."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from pathlib import Path

import optuna
import pytest
from shared_study import LLAMA_H100_RUN, finished_run
from test_cli import LLAMA_8_H100, autotune

from autotune.api._results import choose_study
from autotune.config import ConfigError, TrainConfig
from autotune.study.fingerprint import Fingerprint
from autotune.study.measurement import Measurement, StudyResult
from autotune.study.schema import FINGERPRINT_ATTR

NOW = {"torch": "2.13.0", "deepspeed": "0.19.8", "transformers": "5.23.0"}
"""The node's software in the pure tests (what ``software_versions`` reads on a node)."""
UPGRADED = {**NOW, "torch": "2.14.0"}
OLD = {**NOW, "torch": "2.12.0"}


def _study(
    software: dict[str, str], *, day: int, fits: bool = True, **fields: object
) -> StudyResult:
    shape: dict[str, object] = {
        "model": "llama-7b",
        "seq_len": 2048,
        "global_batch": 64,
        "gpu": "h100-80gb",
        "gpu_memory_bytes": 80 << 30,
        "gpus": 8,
        **fields,
    }
    best = Measurement(
        number=0,
        config=TrainConfig(),
        micro_batch_size=2,
        state="COMPLETE",
        outcome="ok",
        feasible=True,
        value=1000.0,
    )
    return StudyResult(
        fingerprint=Fingerprint(software=software, **shape),  # type: ignore[arg-type]
        measurements=[best] if fits else [],
        trial_count=1,
        best=best if fits else None,
        updated=dt.datetime(2026, 11, day),
    )


def test_of_one_workload_this_nodes_software_is_read_else_the_newest() -> None:
    now, newer, older = _study(NOW, day=1), _study(UPGRADED, day=20), _study(OLD, day=10)
    found, why = choose_study([newer, now, older], NOW)
    assert found is now and why is not None and "this node's software" in why
    found, why = choose_study([older, newer], NOW)
    assert found is newer and why is not None and "newest of 2" in why
    # A study in which nothing fits yet (a re-tune cut short) is left aside while one fits.
    empty = _study(NOW, day=25, fits=False)
    found, why = choose_study([empty, older], NOW)
    assert found is older and why is not None and "1 with nothing fitting left aside" in why
    assert choose_study([now], NOW) == (now, None)  # the only one: nothing to say


def test_studies_of_different_workloads_are_refused_with_the_options_that_pick_one() -> None:
    eight, one = _study(NOW, day=1), _study(NOW, day=2, gpus=1)
    with pytest.raises(ConfigError, match=r"different gpus: pick one with --gpus \(8 or 1\)$"):
        choose_study([eight, one], NOW)
    longer = _study(OLD, day=3, seq_len=4096, global_batch=128)
    with pytest.raises(ConfigError) as refused:
        choose_study([eight, longer], NOW)
    assert str(refused.value).endswith(
        "different seq len, global batch: pick one with --seq-len (2048 or 4096) and "
        "--global-batch (64 or 128)"
    )
    # What no option picks (the precision asked for) is picked by the study's name.
    fp16 = _study(NOW, day=4, precision="fp16")
    with pytest.raises(ConfigError, match="different precision: pick one with --study NAME"):
        choose_study([eight, fp16], NOW)


@pytest.fixture(scope="module")
def two_workloads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One trial database holding llama-7b's two finished runs on 8 simulated H100s (its
    defaults, and sequence length 4096 at global batch 512): a model tuned for two jobs."""
    folder = tmp_path_factory.mktemp("two-workloads")
    first = finished_run(tmp_path_factory, *LLAMA_H100_RUN)
    second = finished_run(tmp_path_factory, *LLAMA_8_H100)
    database = first.copy_database(folder / "autotune.db")
    [name] = optuna.study.get_all_study_names(second.storage)
    optuna.copy_study(
        from_study_name=name, from_storage=second.storage, to_storage=f"sqlite:///{database}"
    )
    return database


def test_export_and_report_read_the_study_the_user_names_by_its_workload(
    two_workloads: Path, tmp_path: Path
) -> None:
    database = tmp_path / "autotune.db"
    database.write_bytes(two_workloads.read_bytes())
    storage = f"sqlite:///{database}"
    rows = json.loads(autotune("best", "--storage", storage, "--json", cwd=tmp_path).stdout)
    seq_lens = sorted(row["fingerprint"]["seq_len"] for row in rows)
    assert len(seq_lens) == 2 and seq_lens[0] != seq_lens[1]
    short = next(row for row in rows if row["fingerprint"]["seq_len"] == seq_lens[0])

    refused = autotune(
        "export", "-f", "hf", "--model", "llama-7b", "--storage", storage, cwd=tmp_path
    )
    assert refused.returncode == 2
    assert f"--seq-len ({seq_lens[0]} or {seq_lens[1]})" in refused.stderr, refused.stderr
    picked = autotune(
        "export",
        "-f",
        "hf",
        "--seq-len",
        str(seq_lens[0]),
        "--gpus",
        "8",
        "--storage",
        storage,
        cwd=tmp_path,
    )
    assert picked.returncode == 0, picked.stderr
    named = autotune(
        "export", "-f", "hf", "--study", short["study"], "--storage", storage, cwd=tmp_path
    )
    assert picked.stdout == named.stdout and "read " not in picked.stderr
    # `best` filters the same way, and its table shows the whole name --study takes.
    one = json.loads(
        autotune(
            "best", "--seq-len", str(seq_lens[0]), "--storage", storage, "--json", cwd=tmp_path
        ).stdout
    )
    assert [row["study"] for row in one] == [short["study"]]
    table = autotune("best", "--seq-len", str(seq_lens[0]), "--storage", storage, cwd=tmp_path)
    first_cells = [line.split("│")[1].strip() for line in table.stdout.splitlines()[3:-1]]
    assert "".join(first_cells) == short["study"], table.stdout
    nothing = autotune("best", "--gpus", "3", "--storage", storage, cwd=tmp_path)
    assert nothing.returncode == 2 and "run autotune run first" in nothing.stderr

    # The same workload measured before an upgrade (torch 2.12.0): the study of this node's
    # software is read, and stderr says which and why. The old study is the short one's
    # trials under the fingerprint an older node stored.
    before = dict(short["fingerprint"], software={**short["fingerprint"]["software"]})
    before["software"]["torch"] = "2.12.0"
    old_name = Fingerprint.from_dict(before).study_name
    optuna.copy_study(
        from_study_name=short["study"],
        from_storage=storage,
        to_storage=storage,
        to_study_name=old_name,
    )
    optuna.load_study(study_name=old_name, storage=storage).set_user_attr(FINGERPRINT_ATTR, before)
    export = ("export", "-f", "hf", "--seq-len", str(seq_lens[0]), "--storage", storage)
    current = autotune(*export, cwd=tmp_path)
    assert current.returncode == 0, current.stderr
    assert current.stdout == named.stdout
    assert f"read {short['study']}: the one of 2 studies of this workload measured on this " in (
        current.stderr
    )
    report = autotune(
        "report",
        "--seq-len",
        str(seq_lens[0]),
        "-o",
        str(tmp_path / "r.html"),
        "--storage",
        storage,
        cwd=tmp_path,
    )
    assert report.returncode == 0 and short["study"] in report.stderr, report.stderr
    assert "this node's software" in report.stderr
    # With the new study gone, the old one is what there is: read, and said so.
    optuna.delete_study(study_name=short["study"], storage=storage)
    fallback = autotune(*export, "--json", cwd=tmp_path)
    assert fallback.returncode == 0, fallback.stderr
    summary = json.loads(fallback.stdout)
    assert summary["study"] == old_name and summary["chosen"] is None  # the only one left


def test_a_field_left_out_of_the_choice_is_a_field_of_the_fingerprint() -> None:
    """The fields :func:`choose_study` treats as when a workload was measured, not what it
    is, name fields a fingerprint has (a renamed field would make every study a workload)."""
    from autotune.api._results import _SOFTWARE_FIELDS

    assert {f.name for f in dataclasses.fields(Fingerprint)} >= _SOFTWARE_FIELDS
