"""The user's own job (autotune.tuned.script): the adapters' commands, read back by the frameworks'
own parsers (transformers' HfArgumentParser, the Trainer's DeepSpeed loading), the job's
identity, ``autotune.job_config()``, (its bad input: tests/test_bad_input.py).

No probe runs here (tests/probe/test_userjob.py runs the jobs for real)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from autotune.config import ConfigError, Engine, TrainConfig
from autotune.handoff.launch import Launch
from autotune.handoff.script import (
    JOB_CONFIG_ENV,
    flag_value,
    job_command,
    job_config,
    placed,
    rewrite_flags,
    shell_text,
    write_files,
)
from autotune.probe.userjob import runs_script
from autotune.study.fingerprint import Fingerprint
from autotune.study.measurement import Measurement, prediction_gap
from autotune.tuned.script import Framework, ScriptJob

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def launch_of(config: dict[str, object], *, mbs: int = 4, accum: int = 2, world: int = 1) -> Launch:
    return Launch(
        model="tiny",
        hidden_size=64,
        config=TrainConfig.from_dict(config),
        micro_batch_size=mbs,
        grad_accum=accum,
        world_size=world,
        seq_len=128,
    )


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        (["--per_device_train_batch_size", "16", "--output_dir", "o"], ["--output_dir", "o"]),
        (["--per_device_train_batch_size=16", "--seed", "3"], ["--seed", "3"]),
        (["--bf16", "--output_dir", "o"], ["--output_dir", "o"]),  # a bare boolean
        (["--bf16", "true", "--seed", "1"], ["--seed", "1"]),
        (["--output_dir", "o", "--bf16"], ["--output_dir", "o"]),  # bare, last
        (["--auto_find_batch_size", "x.json"], ["x.json"]),  # a bare flag before a positional
        (["--deepspeed", "mine.json", "--fsdp", "full_shard"], []),
        (["--max_steps", "1000", "--learning_rate", "3e-4"], ["--learning_rate", "3e-4"]),
    ],
)
def test_rewrite_flags_replaces_what_the_adapter_sets_and_keeps_the_rest(
    given: list[str], kept: list[str]
) -> None:
    from autotune.handoff.script import HF_CONTROLLED

    fields = {"per_device_train_batch_size": 4, "bf16": True}
    out = rewrite_flags(given, fields, HF_CONTROLLED)
    assert out == [*kept, "--per_device_train_batch_size", "4", "--bf16", "True"]


def test_flag_value_reads_both_forms_and_the_last_wins() -> None:
    assert flag_value(["--model_name_or_path", "a", "--x"], "model_name_or_path") == "a"
    assert flag_value(["--model_name_or_path=b"], "model_name_or_path") == "b"
    assert flag_value(["--m", "a", "--m=c"], "m") == "c"
    assert flag_value(["--other", "a"], "m") is None


def _parse_trainer_args(target: tuple[str, ...], cwd: Path) -> object:
    """The Trainer script's own parser on the adapter's command line."""
    from transformers import HfArgumentParser, TrainingArguments

    argv = list(target[1:])
    parser = HfArgumentParser(TrainingArguments)
    old = Path.cwd()
    os.chdir(cwd)
    try:
        (args,) = parser.parse_args_into_dataclasses(argv, look_for_args_file=False)
    finally:
        os.chdir(old)
    return args


@pytest.mark.parametrize(
    "config",
    [
        {"engine": "single", "ac_every": 0},
        {"engine": "ddp", "ac_every": 1},
        {"engine": "ddp", "ac_every": 2, "precision": "fp32"},
    ],
)
def test_the_trainer_adapter_is_read_by_hf_argument_parser(
    tmp_path: Path, config: dict[str, object]
) -> None:
    job = ScriptJob.read(
        EXAMPLES / "train_hf.py",
        "hf",
        ["--output_dir", str(tmp_path / "out"), "--per_device_train_batch_size", "64", "--bf16"],
    )
    launch = launch_of(config)
    command = job_command(job, launch, max_steps=7, cpu=True)
    assert command.target[0] == job.path
    args = _parse_trainer_args(command.target, tmp_path)
    assert args.per_device_train_batch_size == 4
    assert args.gradient_accumulation_steps == 2
    assert args.max_steps == 7
    assert args.use_cpu is True
    assert args.output_dir == str(tmp_path / "out")
    assert args.bf16 is (config.get("precision", "bf16-mixed") != "fp32")
    every = int(str(config["ac_every"]))
    assert args.gradient_checkpointing is bool(every)
    if every > 1:
        assert args.gradient_checkpointing_kwargs == {
            "use_reentrant": False,
            "every_n_layers": every,
        }


def test_the_users_own_max_steps_stands_in_an_export_and_a_probe_sets_its_own(
    tmp_path: Path,
) -> None:
    """A Trainer job asked for 2 steps trains 2 steps as exported (read back by
    HfArgumentParser); only a probe replaces ``--max_steps`` with its own."""
    job = ScriptJob.read(
        EXAMPLES / "train_hf.py", "hf", ["--output_dir", str(tmp_path), "--max_steps", "2"]
    )
    launch = launch_of({"engine": "single", "ac_every": 0})
    exported = _parse_trainer_args(job_command(job, launch, cpu=True).target, tmp_path)
    assert exported.max_steps == 2
    probed = _parse_trainer_args(job_command(job, launch, max_steps=7, cpu=True).target, tmp_path)
    assert probed.max_steps == 7


def test_the_trainer_adapter_hands_deepspeed_its_measured_json(tmp_path: Path) -> None:
    job = ScriptJob.read(EXAMPLES / "train_hf.py", "hf", ["--output_dir", str(tmp_path)])
    launch = launch_of({"engine": "deepspeed", "zero_stage": 2})
    command = placed(job_command(job, launch, cpu=True), tmp_path)
    write_files(command, tmp_path)
    args = _parse_trainer_args(command.target, tmp_path)
    assert args.deepspeed == str(tmp_path / "ds_config.json")
    written = json.loads((tmp_path / "ds_config.json").read_text())
    assert written["zero_optimization"]["stage"] == 2
    assert written["train_micro_batch_size_per_gpu"] == 4
    # The Trainer's own DeepSpeed config reader accepts it against these arguments.
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    ds = HfTrainerDeepSpeedConfig(args.deepspeed)
    ds.trainer_config_process(args)
    assert ds.config["gradient_accumulation_steps"] == 2


def test_the_trainer_adapter_refuses_what_it_cannot_hand_the_trainer() -> None:
    job = ScriptJob.read(EXAMPLES / "train_hf.py", "hf", [])
    with pytest.raises(ConfigError, match="--framework hf cannot run engine fsdp"):
        job_command(job, launch_of({"engine": "fsdp", "zero_stage": 3}))


def test_the_torchrun_adapter_hands_the_configuration_through_job_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = ScriptJob.read(EXAMPLES / "train_torchrun.py", "torchrun", ["--model", "m"])
    launch = launch_of({"engine": "deepspeed", "zero_stage": 3, "ac_every": 1}, world=2)
    command = placed(job_command(job, launch, max_steps=5), tmp_path)
    write_files(command, tmp_path)
    assert command.target == (job.path, "--model", "m")
    monkeypatch.setenv(JOB_CONFIG_ENV, command.env[JOB_CONFIG_ENV])
    import autotune

    read = autotune.job_config()
    assert read is not None
    assert (read.micro_batch_size, read.grad_accum, read.max_steps) == (4, 2, 5)
    assert read.config == launch.config
    assert read.deepspeed is not None and read.deepspeed["zero_optimization"]["stage"] == 3
    monkeypatch.delenv(JOB_CONFIG_ENV)
    assert autotune.job_config() is None
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="cannot be read"):
        job_config(tmp_path / "bad.json")


def test_the_export_is_a_shell_script_that_writes_its_files(tmp_path: Path) -> None:
    job = ScriptJob.read(EXAMPLES / "train_hf.py", "hf", ["--output_dir", "out"])
    launch = launch_of({"engine": "deepspeed", "zero_stage": 1}, world=2)
    text = shell_text(job_command(job, launch), launch, launch.summary())
    assert text.startswith("#!/bin/sh\n")
    assert "cat > ds_config.json <<'AUTOTUNE_EOF'" in text
    assert "--nproc-per-node=2" in text and "--deepspeed ds_config.json" in text
    # The here-document is valid JSON, as written by the shell.
    body = text.split("<<'AUTOTUNE_EOF'\n", 1)[1].split("\nAUTOTUNE_EOF", 1)[0]
    assert json.loads(body)["zero_optimization"]["stage"] == 1


def test_a_job_is_its_script_content_and_arguments(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('v1')\n")
    one = ScriptJob.read(script, "hf", ["--a", "1"])
    assert one.key.startswith("train.py@hf:")
    assert ScriptJob.read(script, "hf", ["--a", "2"]).key != one.key
    assert ScriptJob.from_dict(one.to_dict()) == one
    script.write_text("print('v2')\n")
    assert ScriptJob.read(script, "hf", ["--a", "1"]).key != one.key
    fingerprint = Fingerprint(
        model="tiny", seq_len=64, global_batch=8, gpu="cpu", gpu_memory_bytes=1 << 30, gpus=1,
        script=one.to_dict(),
    )  # fmt: skip
    assert fingerprint.study_name.split("/")[3] == one.key
    assert Fingerprint.from_dict(fingerprint.to_dict()) == fingerprint


def test_runs_script_finds_the_script_in_an_interpreter_command_line(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    job = ScriptJob.read(script, "torchrun")
    python = sys.executable
    assert runs_script(job, [python, str(script), "--x"])
    assert runs_script(job, [python, "-u", "-X", "faulthandler", str(script)])
    assert not runs_script(job, [python, "-m", "torch.distributed.run", str(script)])
    assert not runs_script(job, [python, "-c", "from multiprocessing import spawn"])
    assert not runs_script(job, [python, str(tmp_path / "other.py")])
    assert not runs_script(job, [python])


def test_framework_engines_cover_every_engine_of_torchrun() -> None:
    from autotune.tuned.script import FRAMEWORK_ENGINES

    assert set(FRAMEWORK_ENGINES[Framework.TORCHRUN]) == set(Engine)


def _measured(outcome: str, tokens: float, peak: int, **attrs: object) -> Measurement:
    return Measurement(
        number=0,
        config=TrainConfig(),
        micro_batch_size=4,
        state="COMPLETE",
        outcome=outcome,
        feasible=outcome == "ok",
        value=tokens,
        tokens_per_second=tokens,
        peak_bytes=peak,
        attrs=attrs,
    )


def test_the_gap_to_the_estimate_is_the_median_over_the_points_that_ran() -> None:
    points = [
        _measured("ok", 50.0, 120, estimate_tokens_per_second=100.0, estimate_peak_bytes=100),
        _measured("ok", 80.0, 150, estimate_tokens_per_second=100.0, estimate_peak_bytes=100),
        _measured("ok", 60.0, 110, estimate_tokens_per_second=100.0, estimate_peak_bytes=100),
        _measured("oom", 0.0, 999, estimate_tokens_per_second=100.0, estimate_peak_bytes=100),
        _measured("ok", 70.0, 100),  # a trial recorded without an estimate
    ]
    gap = prediction_gap(points)
    assert gap is not None
    assert (gap.speed_ratio, gap.memory_ratio, gap.points) == (0.6, 1.2, 3)
    assert (
        gap.text() == "tokens/s 0.60x and peak memory 1.20x the estimator's prediction (3 points)"
    )
    assert prediction_gap(points[3:]) is None


def _shell_environment(text: str, env: dict[str, str], folder: Path) -> dict[str, str]:
    """The variables the export's lines before its command leave exported, run by ``sh`` in
    ``folder`` (they write the configuration's files there)."""
    import subprocess

    before = text.rsplit("\n", 2)[0]  # the last line starts the job
    done = subprocess.run(
        ["sh", "-c", f"{before}\nenv"],
        env=env,
        cwd=folder,
        capture_output=True,
        text=True,
        check=True,
    )
    return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)


@pytest.mark.parametrize("ranks", [1, 2, 64])
def test_the_exports_give_each_rank_the_threads_the_probes_ranks_had(
    ranks: int, tmp_path: Path
) -> None:
    """The probes' ranks get this node's cores over its ranks as OpenMP threads
    (``rank_environment``); the command export and the torchrun format write the same rule,
    evaluated on the node that runs them (``torchrun`` alone would give one thread, ``accelerate
    launch`` one unless told), and a value the user exported stands in both."""
    from autotune.handoff.launch import Format, render, threads_per_rank
    from autotune.probe.launcher import rank_environment
    from autotune.probe.spec import ProbeSpec

    cores = len(os.sched_getaffinity(0))
    expected = str(threads_per_rank(cores, ranks))
    assert int(expected) == max(1, cores // ranks)
    base = {"PATH": os.environ["PATH"]}
    job = ScriptJob.read(EXAMPLES / "train_torchrun.py", "torchrun", ["--model", "m"])
    launch = launch_of({"engine": "ddp" if ranks > 1 else "single"}, world=ranks)
    for text in (
        shell_text(job_command(job, launch), launch, "s"),
        render(launch, Format.TORCHRUN),
    ):
        assert _shell_environment(text, base, tmp_path)["OMP_NUM_THREADS"] == expected
        mine = _shell_environment(text, {**base, "OMP_NUM_THREADS": "7"}, tmp_path)
        assert mine["OMP_NUM_THREADS"] == "7"
    for device in ("cpu", "cuda"):
        config = TrainConfig(engine=Engine.DDP if ranks > 1 else Engine.SINGLE)
        spec = ProbeSpec(model="tiny", config=config, num_processes=ranks, device=device)
        old = os.environ.pop("OMP_NUM_THREADS", None)
        try:
            assert rank_environment(spec, 0, 29500)["OMP_NUM_THREADS"] == expected
        finally:
            if old is not None:
                os.environ["OMP_NUM_THREADS"] = old
