"""The user's own training job as probes, for real on this machine's CPU.

The jobs are real scripts of the frameworks users write them for (``examples/``): a Hugging
Face ``Trainer`` script (single rank, and DeepSpeed through the Trainer), an accelerate loop
and a plain torch loop under ``torchrun`` (2 ranks, gloo). They train the tiny model on random
tokens. No test reads an estimator constant: a cap is placed between the job's own measured
peaks at the two largest sizes of the search's first probe (the plan says which probe that
is), and what is checked is what the measurement layer saw in the job's process (its
optimizer, its batches, its checkpointed blocks, its peak) against what autotune asked for and
recorded.

- A Trainer script tuned end to end by ``autotune run --script``: several configurations
  probed, an OOM under the emulated cap among them, the best exported as ``--format command``,
  and that export run for its steps with the measurement layer on (which refuses a run of
  another batch, accumulation, checkpointing or engine): its peak within 10 % of the probe's.
  Its tokens/s beside the probe's are printed here and compared in bench/unedited_jobs.py.
- The same for a torchrun script over 2 ranks, and for an accelerate script (one rank; two
  CPU ranks of it, which accelerate joins with ``ACCELERATE_USE_CPU``, are probed once).
- DeepSpeed through the Trainer over 2 ranks: tuned and exported the same way (no first
  probe of it sweeps a size that runs out, so its cap is a fixed one), and a probe that runs
  DeepSpeed's engine from the adapter's JSON.
- Bad jobs: a crash at import, a script that ignores the batch flags, one that never trains,
  one that hangs: each an error or timeout with the job's last lines, never a hang.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from autotune.api import prepare, trials
from autotune.config import Engine, TrainConfig
from autotune.devices import LocalDevice
from autotune.estimator.memory import estimate_memory
from autotune.models import resolve_model
from autotune.probe.forkserver import ForkServer
from autotune.probe.outcome import Outcome
from autotune.probe.scriptprobe import launch_script_probe, run_measured
from autotune.probe.spec import ProbeSpec
from autotune.search.ladder import Proposal, propose
from autotune.space import micro_batch_options
from autotune.tuned.script import ScriptJob

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BIN = Path(sys.executable).parent
SEQ = 64
GLOBAL_BATCH = 16
UNTIL_S = 600.0
"""Longest wait for a tuner (a failure, not a timing claim)."""
PEAK_STEPS = {"warmup_steps": 1, "timed_steps": 1}
"""Steps of a run measured for its peak alone: the second step holds everything a later one
does (the optimizer's state is made in the first), so its peak is the peak of the tuner's
five-step probes."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the tiny model's config.json, as a Trainer script names its model."""
    folder = tmp_path_factory.mktemp("model")
    (folder / "config.json").write_text(json.dumps(dict(resolve_model("tiny").config)))
    return folder


def hf_args(model_dir: Path, out: Path) -> list[str]:
    return [
        "--model_name_or_path",
        str(model_dir),
        "--output_dir",
        str(out),
        "--seq_len",
        str(SEQ),
        "--report_to",
        "none",
        "--per_device_train_batch_size",
        "64",  # the user's own: the probes replace it
    ]


def autotune(*args: str, expect: int = 0) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [str(BIN / "autotune"), *args], capture_output=True, text=True, timeout=UNTIL_S
    )
    assert done.returncode == expect, (args, done.returncode, done.stdout, done.stderr[-3000:])
    return done


@dataclass(frozen=True)
class Case:
    """A user's job as ``autotune run`` and ``autotune.prepare`` are given it."""

    script: Path
    framework: str
    args: tuple[str, ...]
    model: Path
    ranks: int = 1
    engine: str | None = None
    batch_flag: str | None = None
    budget: str = "5m"
    warm: ForkServer | None = None
    """Where the test's own probes of the job fork from (the tuner starts its own)."""

    @property
    def job(self) -> ScriptJob:
        return ScriptJob.read(self.script, self.framework, self.args, self.batch_flag)

    def cli(self, *options: str) -> list[str]:
        given = ["--script", str(self.script), "--framework", self.framework]
        given += ["--model", str(self.model), "--gpus", str(self.ranks)]
        given += ["--engine", self.engine] if self.engine else []
        given += ["--batch-flag", self.batch_flag] if self.batch_flag else []
        return [*given, *options, "--", *self.args]

    def first_probe(self, cap: int, folder: Path) -> Proposal:
        """What the search probes first under ``cap`` (its plan, no measurement yet)."""
        tuning = prepare(
            str(self.model),
            seq_len=SEQ,
            global_batch=GLOBAL_BATCH,
            gpus=self.ranks,
            engines=None if self.engine is None else [Engine(self.engine)],
            device="cpu",
            device_memory=cap,
            storage=f"sqlite:///{folder}/plan.db",
            trials_dir=folder / "plan",
            script=self.script,
            framework=self.framework,
            script_args=self.args,
            batch_flag=self.batch_flag,
        )
        proposal = propose(tuning.rows, [], micro_batch_options(tuning.workload))
        assert proposal is not None
        return proposal

    def peaks(self, config: TrainConfig, sizes: tuple[int, ...], folder: Path) -> list[int]:
        """The job's real peak at each size, as the tuner's probes run it (the peak of their
        second step on: ``PEAK_STEPS``), without a cap."""
        spec = ProbeSpec(
            model=str(self.model),
            script=self.job,
            config=config,
            micro_batch_sizes=sizes,
            seq_len=SEQ,
            num_processes=self.ranks,
            global_batch=GLOBAL_BATCH,
            device="cpu",
            **PEAK_STEPS,
        )
        result = launch_script_probe(spec, folder, warm=self.warm)
        assert result.outcome is Outcome.OK, result.message
        return [size.peak_bytes or 0 for size in result.sizes]

    def cap(self, folder: Path) -> int:
        """A cap under which the search's first probe runs its largest size out of memory
        for real while the next smaller one fits: found from the job's own measured peaks
        (the plan, and so the first probe, depends on the cap: settled in a few rounds)."""
        cap = 16 << 20
        tried = []
        for round_ in range(8):
            proposal = self.first_probe(cap, folder / f"plan{round_}")
            if len(proposal.micro_batch_sizes) < 2:
                tried.append((cap, proposal.config.label(), proposal.micro_batch_sizes))
                # One size only: the whole per-rank batch (one micro-step, probed alone) fits
                # the plan, so tighten the cap; a small size alone, so give the plan room.
                whole = proposal.micro_batch_sizes == (GLOBAL_BATCH // self.ranks,)
                cap = cap * 2 // 3 if whole else cap * 3 // 2
                continue
            low, high = self.peaks(
                proposal.config, proposal.micro_batch_sizes[-2:], folder / f"peaks{round_}"
            )
            tried.append((cap, proposal.config.label(), proposal.micro_batch_sizes, low, high))
            if low <= cap < high:
                return cap
            cap = (low + high) // 2
        raise AssertionError(f"no cap puts an OOM in the first probe of {self.job.key}: {tried}")


def tune(case: Case, storage: str, trials: Path, cap: int) -> dict[str, Any]:
    """``autotune run --script ... --json``: its summary; its trials (``autotune trials``)."""
    options = ["--device", "cpu", "--device-memory", f"{cap}B", "--seq-len", str(SEQ)]
    options += ["--global-batch", str(GLOBAL_BATCH), "--budget", case.budget, "--json"]
    options += ["--storage", storage, "--trials-dir", str(trials)]
    done = autotune("run", *case.cli(*options))
    summary = json.loads(done.stdout)
    summary["stderr"] = done.stderr
    listed = json.loads(autotune("trials", "--storage", storage, "--json").stdout)
    assert len(listed) == 1
    summary["trials"] = listed[0]["trials"]
    return summary


def run_export(text: str, case: Case, best: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The exported shell script run as a user runs it, with the measurement layer on (which
    stops it once it has trained ``PEAK_STEPS``): each rank's size entry, measured at the
    export's own accumulation."""
    folder.mkdir()
    script = folder / "run.sh"
    script.write_text(text)
    spec = ProbeSpec(
        model=str(case.model),
        script=case.job,
        config=TrainConfig.from_dict(best["config"]),
        micro_batch_sizes=(best["micro_batch_size"],),
        grad_accum=best["grad_accum"],
        seq_len=SEQ,
        num_processes=case.ranks,
        device="cpu",
        **PEAK_STEPS,
    )
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // case.ranks))
    done = run_measured(["sh", str(script)], spec, folder, env=env, timeout_s=UNTIL_S)
    assert done.returncode == 0, done.stderr[-3000:]
    entries = []
    for report in done.reports:
        assert report is not None and report["status"] == "ok", report
        (entry,) = report["sizes"]
        entries.append(entry)
    return {"sizes": entries, "spec": spec}


def check_tuned_and_exported(tmp_path: Path, case: Case, *, cap: int | None = None) -> None:
    """Tune the job, export its best, run the export with the measurement layer on (which
    refuses a run of another batch, accumulation, checkpointing or engine than the best's);
    ``cap``: a cap to tune under instead of one that puts a real OOM in the first probe. The
    export's tokens/s beside the probe's are bench/unedited_jobs.py's (on quiet cores)."""
    storage = f"sqlite:///{tmp_path}/at.db"
    limit = cap if cap is not None else case.cap(tmp_path / "cap")
    summary = tune(case, storage, tmp_path / "trials", limit)
    trials = summary["trials"]
    outcomes = {t["outcome"] for t in trials}
    assert cap is not None or "oom" in outcomes, trials  # a real OOM under the emulated cap
    assert "ok" in outcomes, trials
    assert summary["best"] is not None
    assert case.job.key in summary["study"]
    assert "your job: tokens/s" in summary["stderr"]
    assert summary["prediction_gap"]["points"] >= 1
    best = summary["best"]
    # The study is found by the model's config.json, and the export is the job's command.
    exported = json.loads(
        autotune(
            "export",
            "--format",
            "command",
            "--model",
            str(case.model),
            "--storage",
            storage,
            "--json",
        ).stdout
    )
    assert exported["micro_batch_size"] == best["micro_batch_size"]
    recorded = next(
        t
        for t in trials
        if t["config"] == best["config"] and t["micro_batch_size"] == best["micro_batch_size"]
    )
    report = tmp_path / "report.html"
    autotune("report", "--model", str(case.model), "--storage", storage, "-o", str(report))
    html = report.read_text()
    assert "your job</td>" in html and "autotune export --format command" in html
    ran = run_export(exported["text"], case, best, tmp_path / "export")
    peak = max(e["peak_reserved_bytes"] for e in ran["sizes"])
    speed = ran["sizes"][0]["tokens_per_second"]
    print(
        f"{case.job.name}: best {best['label']} micro-batch {best['micro_batch_size']} "
        f"accumulation {best['grad_accum']}: probed peak {recorded['peak_bytes']} B, exported "
        f"run's peak {peak} B ({peak / recorded['peak_bytes']:.3f}x); tokens/s recorded "
        f"{recorded['tokens_per_second']:.0f}, exported run {speed:.0f}; against the "
        f"stand-in's prediction: {summary['prediction_gap']}"
    )
    assert abs(peak - recorded["peak_bytes"]) <= 0.10 * recorded["peak_bytes"]


def test_a_trainer_script_is_tuned_exported_and_its_export_runs_as_probed(
    tmp_path: Path, model_dir: Path, fork_server: ForkServer
) -> None:
    """... and a lone rank of the Trainer under torchrun trains in DDP: once a probe saw its
    wrapper, the predictions recorded with every later trial count DDP's gradient buckets
    (4 bytes a parameter the one-process configuration does not keep)."""
    args = tuple(hf_args(model_dir, tmp_path / "out"))
    # Several probes, a bounded number: a probe after the first starts while 30 s (or its
    # predicted time, about the first's) are left, and the search's re-measures of points
    # within the noise of the best end with the budget.
    case = Case(EXAMPLES / "train_hf.py", "hf", args, model_dir, budget="150s", warm=fork_server)
    check_tuned_and_exported(tmp_path, case)
    [study] = trials(storage=f"sqlite:///{tmp_path}/at.db")
    ran = [m for m in study.measurements if m.outcome == "ok"]
    assert ran and all(m.attrs["trained_engine"] == "ddp" for m in ran)
    first = min(m.attrs["probe_dir"] for m in study.measurements)
    later = [m for m in ran if m.attrs["probe_dir"] != first]
    assert later, "a probe after the first"
    model = resolve_model(str(model_dir))
    for m in later:
        assert m.config.engine is Engine.SINGLE
        as_trained = estimate_memory(
            model, dataclasses.replace(m.config, engine=Engine.DDP),
            micro_batch_size=m.micro_batch_size, seq_len=SEQ, cuda_allocator=False,
            grad_accum=m.grad_accum,
        )  # fmt: skip
        assert m.attrs["estimate_peak_bytes"] == as_trained.peak_bytes, m


def test_a_torchrun_script_over_two_ranks_is_tuned_and_its_export_runs_as_probed(
    tmp_path: Path, model_dir: Path, fork_server: ForkServer
) -> None:
    args = ("--model", str(model_dir), "--seq-len", str(SEQ), "--batch-size", "64")
    # A budget of a probe or two: the first probe alone holds an OOM (its largest size, under
    # the cap) and sizes that fit; the search past it is the Trainer's test's.
    case = Case(
        EXAMPLES / "train_torchrun.py",
        "torchrun",
        args,
        model_dir,
        2,
        "ddp",
        budget="60s",
        warm=fork_server,
    )
    check_tuned_and_exported(tmp_path, case)


def test_an_accelerate_script_is_tuned_and_its_export_runs_as_probed(
    tmp_path: Path, model_dir: Path
) -> None:
    args = ("--model", str(model_dir), "--seq-len", str(SEQ), "--steps", "50")
    case = Case(
        EXAMPLES / "train_accelerate.py",
        "accelerate",
        args,
        model_dir,
        batch_flag="--batch-size",
        budget="60s",
    )
    # Every probe here is a fresh `accelerate launch`, so this test keeps to what only it
    # shows (accelerate's launch tuned, exported and run): a fixed cap, not one searched for
    # an OOM in the first probe (the Trainer's and torchrun's tests show that).
    check_tuned_and_exported(tmp_path, case, cap=6 << 20)


def test_deepspeed_through_the_trainer_is_tuned_and_its_export_runs_as_probed(
    tmp_path: Path, model_dir: Path, fork_server: ForkServer
) -> None:
    args = tuple(hf_args(model_dir, tmp_path / "out"))
    # A budget of a few probes: the search's whole DeepSpeed ladder is not the point here.
    case = Case(
        EXAMPLES / "train_hf.py",
        "hf",
        args,
        model_dir,
        ranks=2,
        engine="deepspeed",
        budget="30s",
        warm=fork_server,
    )
    # The estimator over-predicts this job's DeepSpeed memory, so no first probe sweeps a size
    # that runs out (tried: 8 caps from 1.5 to 16 MiB): tuned under a cap that fits several.
    check_tuned_and_exported(tmp_path, case, cap=3 << 20)


def one_probe(tmp_path: Path, script: Path, framework: str, args: list[str], **fields: Any) -> Any:
    warm = fields.pop("warm", None)
    spec = ProbeSpec(
        model=str(tmp_path / "model"),
        script=ScriptJob.read(script, framework, args),
        micro_batch_sizes=fields.pop("sizes", (2,)),
        seq_len=SEQ,
        device="cpu",
        warmup_steps=1,
        timed_steps=2,
        timeout_s=fields.pop("timeout_s", 300.0),
        **fields,
    )
    for step in LocalDevice("cpu", warm=False).setup(spec):
        step.run()  # DeepSpeed's ops built first, as the tuner does (under the build lock)
    return launch_script_probe(spec, tmp_path / "probe", warm=warm)


@pytest.fixture
def here(tmp_path: Path, model_dir: Path) -> Path:
    (tmp_path / "model").symlink_to(model_dir)
    return tmp_path


@pytest.fixture
def job_probe(here: Path, fork_server: ForkServer) -> Callable[..., Any]:
    """``one_probe`` in ``here``, its ranks forked from the session's warm process."""

    def probe(script: Path, framework: str, args: list[str], **fields: Any) -> Any:
        return one_probe(here, script, framework, args, warm=fork_server, **fields)

    return probe


def test_deepspeed_through_the_trainer_is_the_jobs_engine(
    here: Path, job_probe: Callable[..., Any]
) -> None:
    result = job_probe(
        EXAMPLES / "train_hf.py",
        "hf",
        hf_args(here / "model", here / "out"),
        config=TrainConfig.from_dict({"engine": "deepspeed", "zero_stage": 2}),
    )
    assert result.outcome is Outcome.OK, result.message
    (size,) = result.sizes
    # DeepSpeed's engine around torch's AdamW (the JSON's torch_adam on the CPU, as the
    # stand-in's CPU probes: no Adam op to build), not the Trainer's own optimizer.
    assert size.extra["optimizers"] == ["AdamW"]
    assert "DeepSpeed" in (here / "probe" / "mb2" / "stdout.log").read_text()
    assert size.extra["tokens_counted"] is True
    written = json.loads((here / "probe" / "mb2" / "ds_config.json").read_text())
    assert written["zero_optimization"]["stage"] == 2
    assert written["optimizer"]["params"]["torch_adam"] is True
    assert "--deepspeed" in (here / "probe" / "mb2" / "cmd.txt").read_text()


def test_a_script_that_crashes_at_import_is_an_error_with_its_last_lines(
    here: Path, job_probe: Callable[..., Any]
) -> None:
    script = here / "crash.py"
    script.write_text("import torch\nraise SystemExit('cannot find the dataset /data/x')\n")
    result = job_probe(script, "torchrun", [])
    assert result.outcome is Outcome.ERROR
    assert "ended before its first training step" in result.message
    assert "cannot find the dataset /data/x" in result.message


def test_a_script_that_ignores_the_batch_flags_is_caught(
    here: Path, job_probe: Callable[..., Any]
) -> None:
    args = ["--model", str(here / "model"), "--seq-len", str(SEQ)]
    result = job_probe(EXAMPLES / "train_torchrun.py", "torchrun", args)
    assert result.outcome is Outcome.OK, result.message  # it reads autotune.job_config()
    script = here / "stubborn.py"
    text = (EXAMPLES / "train_torchrun.py").read_text()
    script.write_text(text.replace("batch = job.micro_batch_size if job else", "batch ="))
    result = job_probe(script, "torchrun", [*args, "--batch-size", "3"])
    assert result.outcome is Outcome.ERROR
    assert result.message.startswith(
        "the script fed micro-batches of 3 sequences where autotune asked for 2"
    ), result.message


def test_a_script_that_ignores_checkpointing_is_caught(
    here: Path, job_probe: Callable[..., Any]
) -> None:
    script = here / "no_checkpointing.py"
    text = (EXAMPLES / "train_torchrun.py").read_text()
    script.write_text(text.replace("if job and job.ac_every:", "if False:"))
    args = ["--model", str(here / "model"), "--seq-len", str(SEQ)]
    config = TrainConfig.from_dict({"ac_every": 1})
    result = job_probe(script, "torchrun", args, config=config)
    assert result.outcome is Outcome.ERROR
    assert result.message.startswith(
        "the job checkpointed 0 of 2 decoder blocks per micro-step where autotune asked for "
        "ac:every (2): does it turn checkpointing on from autotune.job_config().ac_every?"
    ), result.message
    result = job_probe(EXAMPLES / "train_torchrun.py", "torchrun", args, config=config)
    assert result.outcome is Outcome.OK, result.message
    assert result.sizes[0].extra["checkpointed_blocks"] == 2


def test_a_script_that_never_trains_or_hangs_never_hangs_the_tuner(
    here: Path, job_probe: Callable[..., Any]
) -> None:
    idle = here / "idle.py"
    idle.write_text("import torch\nprint('nothing to do today')\n")
    result = job_probe(idle, "torchrun", [])
    assert result.outcome is Outcome.ERROR
    assert "ended before its first training step" in result.message
    assert "nothing to do today" in result.message
    hang = here / "hang.py"
    hang.write_text("import time\nprint('waiting for a lock', flush=True)\ntime.sleep(3600)\n")
    result = job_probe(hang, "torchrun", [], timeout_s=15.0)
    assert result.outcome is Outcome.TIMEOUT
    assert "waiting for a lock" in result.message


def test_a_nightly_job_tunes_a_script_workload_then_keeps_it(here: Path) -> None:
    nightly = here / "nightly.yaml"
    args = json.dumps(hf_args(here / "model", here / "out"))
    nightly.write_text(
        "workloads:\n"
        f"  - model: {here / 'model'}\n"
        f"    script: {EXAMPLES / 'train_hf.py'}\n"
        "    framework: hf\n"
        f"    args: {args}\n"
        f"    seq_len: {SEQ}\n"
        f"    global_batch: {GLOBAL_BATCH}\n"
        "    device: cpu\n"
        "    device_memory: 8MiB\n"
        # A budget of a probe or two: a best is all a workload needs to be kept.
        "    budget: 60s\n"
    )
    storage = ["--storage", f"sqlite:///{here}/at.db", "--trials-dir", str(here / "trials")]
    first = json.loads(autotune("run", "--jobs", str(nightly), *storage, "--json").stdout)
    (workload,) = first["workloads"]
    assert workload["status"] == "tuned", workload
    key = ScriptJob.read(EXAMPLES / "train_hf.py", "hf", json.loads(args)).key
    assert key in workload["study"] and workload["best"] is not None
    again = json.loads(autotune("run", "--jobs", str(nightly), *storage, "--json").stdout)
    (kept,) = again["workloads"]
    assert kept["status"] == "skipped" and "unchanged" in kept["why"], kept


def test_autotune_probe_runs_the_script_at_the_sizes_asked(here: Path) -> None:
    done = autotune(
        "probe",
        "--script",
        str(EXAMPLES / "train_hf.py"),
        "--framework",
        "hf",
        "--device",
        "cpu",
        "--micro-batch",
        "2,4",
        "--seq-len",
        str(SEQ),
        "--ac",
        "every",
        "--trials-dir",
        str(here / "trials"),
        "--json",
        "--",
        *hf_args(here / "model", here / "out"),
    )
    result = json.loads(done.stdout)
    assert result["outcome"] == "ok", result["message"]
    assert [s["micro_batch_size"] for s in result["sizes"]] == [2, 4]
    assert all(s["checkpointed_blocks"] == 2 for s in result["sizes"])  # tiny's 2 blocks
    assert result["spec"]["script"]["framework"] == "hf"


CUSTOM = """
import torch
import autotune

job = autotune.job_config()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(256, 32), torch.nn.Linear(32, 256))
loss_fn = torch.nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(job.max_steps):
    for _ in range(job.grad_accum):
        ids = torch.randint(0, 256, (job.micro_batch_size, job.seq_len))
        loss = loss_fn(model(ids).flatten(0, 1), ids.flatten()) / job.grad_accum
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
"""


def test_a_model_of_the_users_own_is_measured_at_its_accumulation(
    here: Path, job_probe: Callable[..., Any]
) -> None:
    script = here / "custom.py"
    script.write_text(CUSTOM)
    result = job_probe(script, "torchrun", [], sizes=(2, 4), grad_accum=2)
    assert result.outcome is Outcome.OK, result.message
    for size in result.sizes:
        assert size.extra["optimizers"] == ["SGD"]
        assert size.extra["tokens_counted"] is True
        assert len(size.losses) == 3 and all(loss > 0 for loss in size.losses)


def test_an_accelerate_script_trains_over_two_cpu_ranks_as_one_group(
    here: Path, job_probe: Callable[..., Any]
) -> None:
    """``accelerate launch`` of two ranks on the CPU, as the adapter starts it there
    (``ACCELERATE_USE_CPU``: without it each rank trains alone, the layer refusing it): one
    gloo group, DDP's wrapper seen, measured at the size asked."""
    args = ["--model", str(here / "model"), "--seq-len", str(SEQ), "--steps", "50"]
    config = TrainConfig.from_dict({"engine": "ddp"})
    job = ScriptJob.read(EXAMPLES / "train_accelerate.py", "accelerate", args, "--batch-size")
    spec = ProbeSpec(
        model=str(here / "model"),
        script=job,
        config=config,
        micro_batch_sizes=(2,),
        seq_len=SEQ,
        num_processes=2,
        device="cpu",
        warmup_steps=1,
        timed_steps=2,
        timeout_s=300.0,
    )
    result = launch_script_probe(spec, here / "probe")
    assert result.outcome is Outcome.OK, result.message
    (size,) = result.sizes
    assert size.extra["wrapper"].startswith("DDP"), size.extra
    assert size.loss_finite is True


DATA_JOB = """
import argparse
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import autotune

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
args = parser.parse_args()
job = autotune.job_config()
config = AutoConfig.from_pretrained(args.model)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
# The whole data set in memory as one tensor of token ids (8,192 sequences: 4 MiB).
data = torch.randint(0, config.vocab_size, (8192, job.seq_len))
for step in range(job.max_steps):
    start = step * job.micro_batch_size
    ids = data[start : start + job.micro_batch_size]
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
"""


def test_a_jobs_in_memory_data_set_is_not_counted_as_device_memory_on_the_cpu(
    here: Path, job_probe: Callable[..., Any]
) -> None:
    """A job holding its data set as one 4 MiB tensor of token ids: a GPU run keeps it in
    host memory, so the CPU's emulated device sets it aside when training begins. Under a
    6 MiB cap the step's peak (about 3 MiB without the data, 7 with it) fits, and the size
    says what was set aside; the model's own memory is still counted."""
    script = here / "data_job.py"
    script.write_text(DATA_JOB)
    args = ["--model", str(here / "model")]
    result = job_probe(script, "torchrun", args, device_memory_bytes=6 << 20)
    assert result.outcome is Outcome.OK, result.message
    (size,) = result.sizes
    assert size.extra["host_data_bytes"] == 8192 * SEQ * 8
    assert size.peak_allocated_bytes is not None
    assert 1 << 20 < size.peak_allocated_bytes < 6 << 20
