"""A script's own flags for the knobs (``--batch-flag``, ``--accum-flag``,
``--checkpointing-flag``): a job written without autotune in mind, tuned unedited (their bad
input: tests/test_bad_input.py).

``examples/train_torchrun_plain.py`` takes its micro-batch, accumulation and checkpointing from
flags of its own and imports nothing of autotune. Probed with its flags named, the measurement
layer (which checks the batches fed, the micro-steps per optimizer step and the checkpointed
blocks against what autotune asked) finds it training as asked; the same probe without the
flags is refused with the layer's one line, as the script then trains its defaults.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from autotune import prepare, trials
from autotune.config import ConfigError, Engine, Knobs, LossDtype, TrainConfig
from autotune.estimator.memory import estimate_memory
from autotune.handoff.launch import Launch
from autotune.handoff.script import job_command
from autotune.models import resolve_model
from autotune.probe.forkserver import ForkServer
from autotune.probe.outcome import Outcome
from autotune.probe.scriptprobe import launch_script_probe
from autotune.probe.spec import ProbeSpec
from autotune.space import configurations
from autotune.study.measurement import Measurement
from autotune.tuned.script import ScriptJob, declared_flags, reads_job_config, recognised_flags

PLAIN = Path(__file__).resolve().parents[2] / "examples" / "train_torchrun_plain.py"
FLAGS = {
    "batch_flag": "--batch-size",
    "accum_flag": "--grad-accum",
    "checkpointing_flag": "--activation-checkpointing",
}


def _launch(config: TrainConfig, *, micro_batch: int = 2, accum: int = 3) -> Launch:
    return Launch(
        model="tiny",
        hidden_size=64,
        config=config,
        micro_batch_size=micro_batch,
        grad_accum=accum,
        world_size=2,
        seq_len=64,
    )


def test_the_scripts_own_flags_carry_the_configuration() -> None:
    """The user's own values of the named flags are replaced (``--flag v``, ``--flag=v``, a
    switch and its ``--no-`` form), the others kept as given; the switch is given exactly
    where every block is checkpointed, and a configuration it cannot express is refused."""
    user = (
        "--model", "m", "--batch-size", "8", "--grad-accum=4", "--no-activation-checkpointing",
        "--lr", "3e-4",
    )  # fmt: skip
    job = ScriptJob.read(PLAIN, "torchrun", user, **FLAGS)
    every = job_command(job, _launch(TrainConfig(engine=Engine.DDP, ac_every=1))).target
    assert every[1:] == (
        "--model", "m", "--lr", "3e-4", "--batch-size", "2", "--grad-accum", "3",
        "--activation-checkpointing",
    )  # fmt: skip
    off = job_command(job, _launch(TrainConfig(engine=Engine.DDP))).target
    assert "--activation-checkpointing" not in off and "--no-activation-checkpointing" not in off
    with pytest.raises(ConfigError, match="checkpoints every block or none"):
        job_command(job, _launch(TrainConfig(engine=Engine.DDP, ac_every=2)))
    text = json.dumps(job.to_dict())
    assert ScriptJob.from_dict(json.loads(text)) == job
    # A job without the new flags keeps the key (and so the study) it had.
    old = ScriptJob.read(PLAIN, "torchrun", user, batch_flag="--batch-size")
    assert old.key != job.key
    assert old.key == ScriptJob.from_dict({**old.to_dict(), "accum_flag": None}).key


@pytest.mark.parametrize(
    ("declared", "found"),
    [
        (
            'p.add_argument("--batch_size", type=int)\n'
            'p.add_argument("--gradient-accumulation-steps", type=int)\n'
            'p.add_argument("--grad-ckpt", action="store_true")',
            {"batch": "--batch_size", "accum": "--gradient-accumulation-steps",
             "checkpointing": "--grad-ckpt"},
        ),
        # Two options a knob could take: neither; a checkpointing flag that takes a value
        # and a batch switch are not the knobs' forms.
        (
            'p.add_argument("--batch-size")\np.add_argument("--micro-batch-size")\n'
            'p.add_argument("--gradient-checkpointing", type=bool)',
            {},
        ),
        ('p.add_argument("--mbs", action="store_true")', {}),
        # One option under two names (aliases) is one candidate; two options are two.
        (
            'p.add_argument("--micro-batch-size", "--per-device-batch-size", type=int)\n'
            'p.add_argument("--grad-ckpt", "--activation-checkpointing", action="store_true")',
            {"batch": "--micro-batch-size", "checkpointing": "--grad-ckpt"},
        ),
        ("this is not Python (", {}),
    ],
)  # fmt: skip
def test_a_scripts_own_flags_are_recognised_by_their_names_in_its_source(
    declared: str, found: dict[str, str]
) -> None:
    assert recognised_flags(declared_flags(declared)) == found


def test_recognised_flags_tune_an_unedited_script_unless_it_reads_autotune(
    tmp_path: Path,
) -> None:
    """The plain script's flags are found without being named; ``none`` disowns one; a
    script that reads ``autotune.job_config()`` gets none (the configuration reaches it
    whole, every k-th block included)."""
    job = ScriptJob.read(PLAIN, "torchrun", recognise=True)
    assert (job.batch_flag, job.accum_flag, job.checkpointing_flag) == tuple(FLAGS.values())
    disowned = ScriptJob.read(PLAIN, "torchrun", recognise=True, accum_flag="none")
    assert disowned.accum_flag is None and disowned.batch_flag == "--batch-size"
    assert ScriptJob.read(PLAIN, "torchrun").batch_flag is None  # only when asked
    reader = PLAIN.with_name("train_torchrun.py")
    assert reads_job_config(reader.read_text())
    assert "--batch-size" in declared_flags(reader.read_text())
    kept = ScriptJob.read(reader, "torchrun", recognise=True)
    assert (kept.batch_flag, kept.accum_flag, kept.checkpointing_flag) == (None, None, None)


def test_a_job_without_a_checkpointing_switch_leaves_checkpointing_out_of_the_space(
    tmp_path: Path,
) -> None:
    """A script with no switch for checkpointing and no ``autotune.job_config()`` cannot
    checkpoint (``--checkpointing-flag none`` says so of one whose switch is not for this);
    its space holds no configuration that checkpoints. A script that reads the job's
    configuration checkpoints as it says."""
    from autotune.values import knobs_for

    bare = tmp_path / "bare.py"
    bare.write_text(
        "import argparse\np = argparse.ArgumentParser()\np.add_argument('--batch-size')\n"
    )
    for job in (
        ScriptJob.read(bare, "torchrun", recognise=True),
        ScriptJob.read(PLAIN, "torchrun", recognise=True, checkpointing_flag="none"),
    ):
        assert not job.checkpoints
        assert ScriptJob.from_dict(json.loads(json.dumps(job.to_dict()))) == job
        knobs = knobs_for(job, None, False, None, device="cpu")
        tried = {(c.ac_every, c.ac_ops) for c in configurations(world_size=2, num_layers=8,
                                                                 knobs=knobs)}  # fmt: skip
        assert tried == {(0, False)}
    assert ScriptJob.read(PLAIN, "torchrun", recognise=True).checkpoints
    reader = ScriptJob.read(PLAIN.with_name("train_torchrun.py"), "torchrun", recognise=True)
    assert reader.checkpoints and reader.checkpointing_flag is None
    # Another search space, another study; a job that can checkpoint keeps its key.
    able = ScriptJob.read(PLAIN, "torchrun")
    assert ScriptJob.from_dict({**able.to_dict(), "checkpoints": False}).key != able.key
    assert "checkpoints" not in able.to_dict()


def test_a_checkpointing_switch_leaves_every_kth_block_out_of_the_space() -> None:
    layers = resolve_model("tiny").num_layers + 4  # room for every 2nd and 4th
    tried = {c.ac_every for c in configurations(world_size=2, num_layers=layers)}
    assert tried == {0, 1, 2, 4}
    switch = {
        c.ac_every
        for c in configurations(world_size=2, num_layers=layers, knobs=Knobs(block_patterns=False))
    }
    assert switch == {0, 1}


@pytest.mark.slow
def test_an_unedited_script_is_probed_through_its_own_flags(
    tmp_path: Path, fork_server: ForkServer
) -> None:
    """Two DDP ranks at micro-batch 2, accumulation 2, every block checkpointed: with its
    flags named the layer measures it; without, it trains its defaults (4 sequences, no
    accumulation, no checkpointing) and the probe says so in one line instead of recording
    an OOM or a speed."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(dict(resolve_model("tiny").config)))
    args = ("--model", str(model), "--seq-len", "64", "--batch-size", "4")

    def probe(job: ScriptJob, name: str) -> object:
        spec = ProbeSpec(
            model=str(model),
            script=job,
            config=TrainConfig(engine=Engine.DDP, ac_every=1),
            micro_batch_sizes=(2,),
            grad_accum=2,
            seq_len=64,
            num_processes=2,
            device="cpu",
            warmup_steps=1,
            timed_steps=2,
            timeout_s=300.0,
        )
        return launch_script_probe(spec, tmp_path / name, warm=fork_server)

    result = probe(ScriptJob.read(PLAIN, "torchrun", args, **FLAGS), "flagged")
    assert result.outcome is Outcome.OK, result.message
    (size,) = result.sizes
    assert size.extra["checkpointed_blocks"] == resolve_model("tiny").num_layers
    result = probe(ScriptJob.read(PLAIN, "torchrun", args), "unflagged")
    assert result.outcome is Outcome.ERROR
    assert "where autotune asked for" in result.message, result.message


def _run(
    tmp_path: Path, script: Path, *options: str, script_args: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """``autotune run --script`` of ``script`` on 1 CPU rank under a 64 MiB cap."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(dict(resolve_model("tiny").config)))
    args = [
        *("run", "--script", str(script), "--framework", "torchrun", "--model", str(model)),
        *("--gpus", "1", "--device", "cpu", "--device-memory", "64MiB", "--seq-len", "64"),
        *("--global-batch", "8", "--budget", "3m"),
        *("--storage", f"sqlite:///{tmp_path}/study.db", "--trials-dir", str(tmp_path / "t")),
        *options,
        *("--", "--model", str(model), "--seq-len", "64", *script_args),
    ]
    return _autotune(*args)


def _autotune(*args: str) -> subprocess.CompletedProcess[str]:
    """The installed ``autotune`` command, run to its end."""
    return subprocess.run(
        [str(Path(sys.executable).with_name("autotune")), *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def _recorded(tmp_path: Path) -> list[dict[str, object]]:
    done = subprocess.run(
        [
            str(Path(sys.executable).with_name("autotune")),
            *("trials", "--json", "--storage", f"sqlite:///{tmp_path}/study.db"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return [trial for study in json.loads(done.stdout) for trial in study["trials"]]


@pytest.mark.slow
def test_a_job_that_ignores_what_autotune_asks_stops_the_run_at_its_first_probe(
    tmp_path: Path,
) -> None:
    """The plain script run with its flags disowned (``none``) trains its own 4 sequences a
    micro-batch: the run stops at its first probe with one line that says what the job fed
    and which flag to name (exit 2), and records nothing against the configuration (no "no
    configuration fits" after a dozen probes, no OOM of a size it never ran)."""
    none = ("--batch-flag", "none", "--accum-flag", "none", "--checkpointing-flag", "none")
    done = _run(tmp_path, PLAIN, "--engine", "single", *none)
    assert done.returncode == 2, done.stdout + done.stderr
    [line] = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert "where autotune asked for" in line and "--batch-flag" in line, line
    assert "nothing was recorded against" in line
    assert all(trial["state"] != "COMPLETE" for trial in _recorded(tmp_path))


@pytest.mark.slow
def test_a_job_that_cannot_checkpoint_is_tuned_without_checkpointing(tmp_path: Path) -> None:
    """The plain script with its checkpointing switch disowned (``none``) trains without
    checkpointing whatever autotune asks: the run says so in its first line, tries no
    configuration that checkpoints, and ends with a best (exit 0)."""
    done = _run(tmp_path, PLAIN, "--engine", "single", "--checkpointing-flag", "none", "--json")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    first = done.stderr.splitlines()[0]
    assert "no checkpointing: it has no switch for it" in first, first
    summary = json.loads(done.stdout)
    assert summary["best"] is not None and summary["mistake"] is None
    assert summary["best"]["label"] == "single ac:off"
    recorded = _recorded(tmp_path)
    assert recorded and all(trial["config"]["ac_every"] == 0 for trial in recorded)
    # The study's launch is the script's own command line; a torchrun line of autotune's
    # stand-in (its engine, precision and optimizer, none of the script's arguments) is not.
    storage = ("--storage", f"sqlite:///{tmp_path}/study.db", "--model", str(tmp_path / "model"))
    stand_in = _autotune("export", "--format", "torchrun", *storage)
    assert stand_in.returncode == 2 and "use --format command" in stand_in.stderr, stand_in.stderr
    command = _autotune("export", "--format", "command", *storage)
    assert command.returncode == 0, command.stderr
    assert str(PLAIN) in command.stdout and "--seq-len 64" in command.stdout
    assert "--activation-checkpointing" not in command.stdout


@pytest.mark.slow
def test_a_job_that_crashes_at_its_first_probe_stops_the_run_quoting_its_error(
    tmp_path: Path,
) -> None:
    script = tmp_path / "crash.py"
    script.write_text("import sys\nsys.exit('cannot find the dataset /data/x')\n")
    done = _run(tmp_path, script)
    assert done.returncode == 2, done.stdout + done.stderr
    [line] = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert "cannot find the dataset /data/x" in line, line
    assert all(trial["state"] != "COMPLETE" for trial in _recorded(tmp_path))


@pytest.mark.slow
def test_a_job_that_hangs_before_its_first_step_stops_the_run_at_its_first_probe(
    tmp_path: Path,
) -> None:
    """A job that waits forever before it trains (a lock, a peer that never comes): the first
    probe's bound ends it, and the run stops there with one line (exit 2) instead of waiting
    out the same bound at every configuration and ending "no configuration fits"."""
    script = tmp_path / "hang.py"
    script.write_text("import time\nprint('waiting for the data server', flush=True)\n"
                      "time.sleep(3600)\n")  # fmt: skip
    done = _run(tmp_path, script)
    assert done.returncode == 2, done.stdout + done.stderr
    [line] = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert "the job hung at the first probe" in line, line
    assert "did not reach its first training step" in line and "waiting for the data" in line
    assert all(trial["state"] != "COMPLETE" for trial in _recorded(tmp_path))


@pytest.mark.slow
def test_an_unedited_script_is_tuned_through_the_flags_found_in_it(tmp_path: Path) -> None:
    """``autotune run --script`` of the plain script with no flag named, in pure bf16 with its
    loss taken from the bf16 logits (its own ``--bf16 --loss-from-logits``): its first line
    names the flags found, and the run ends with a best measured through them (exit 0).

    The first probe sees the loss's dtype; the predictions recorded with every later trial
    count the job's own logits term (no fp32 copy), and the end of the run says so."""
    done = _run(
        tmp_path,
        PLAIN,
        *("--engine", "single", "--precision", "bf16", "--json"),
        script_args=("--bf16", "--loss-from-logits"),
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "its own flags --batch-size (micro-batch), --grad-accum (accumulation)" in done.stderr
    summary = json.loads(done.stdout)
    assert summary["best"] is not None and summary["mistake"] is None
    assert summary["best"]["label"] in ("single ac:off bf16", "single ac:every bf16")
    assert summary["prediction_gap"]["loss_dtype"] == "logits"
    [study] = trials(storage=f"sqlite:///{tmp_path}/study.db")
    measured = sorted((m for m in study.measurements if m.outcome == "ok"), key=lambda m: m.number)
    assert measured and all(m.attrs["loss_dtype"] == "logits" for m in measured)
    first = min(m.attrs["probe_dir"] for m in measured)
    model = resolve_model(str(tmp_path / "model"))

    def predicted(m: Measurement, loss_dtype: LossDtype) -> int:
        return estimate_memory(
            model, m.config, micro_batch_size=m.micro_batch_size, seq_len=64,
            cuda_allocator=False, grad_accum=m.grad_accum, loss_dtype=loss_dtype,
        ).peak_bytes  # fmt: skip

    for m in measured:
        assumed = LossDtype.FP32 if m.attrs["probe_dir"] == first else LossDtype.LOGITS
        assert m.attrs["estimate_peak_bytes"] == predicted(m, assumed), m
    assert len({m.attrs["probe_dir"] for m in measured}) > 1  # a probe after the first
    # The next run of the same job plans with the dtype from its first probe on.
    again = prepare(
        str(tmp_path / "model"),
        script=str(PLAIN),
        framework="torchrun",
        script_args=("--model", str(tmp_path / "model"), "--seq-len", "64", "--bf16",
                     "--loss-from-logits"),
        engines=[Engine.SINGLE], precision="bf16", gpus=1, device="cpu", device_memory="64MiB",
        seq_len=64, global_batch=8, budget="3m", storage=f"sqlite:///{tmp_path}/study.db",
        trials_dir=str(tmp_path / "t"), warm=False,
    )  # fmt: skip
    try:
        assert again.fingerprint.study_name == study.fingerprint.study_name
        assert again.workload.loss_dtype is LossDtype.LOGITS
        assert again.store.estimates[(measured[0].config, measured[0].micro_batch_size)][1] == (
            predicted(measured[0], LossDtype.LOGITS)
        )
    finally:
        again.device.close()


def test_an_accelerate_job_on_the_cpu_is_searched_without_deepspeed(tmp_path: Path) -> None:
    """accelerate's DeepSpeed path is for accelerators: on the CPU (``ACCELERATE_USE_CPU``) its
    ranks train as DDP whatever the config says, so the space holds no DeepSpeed row, and
    ``--engine deepspeed`` is refused in one line rather than blamed on the script."""
    script = PLAIN.with_name("train_accelerate_plain.py")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(dict(resolve_model("tiny").config)))
    common: dict[str, Any] = dict(
        script=str(script), framework="accelerate", script_args=("--model", str(model)),
        gpus=2, device="cpu", device_memory="64MiB", seq_len=64, global_batch=8,
        budget="3m", storage=f"sqlite:///{tmp_path}/study.db", trials_dir=str(tmp_path / "t"),
        warm=False,
    )  # fmt: skip
    tuning = prepare(str(model), **common)
    try:
        engines = {row.config.engine for row in tuning.rows}
        assert engines and Engine.DEEPSPEED not in engines and Engine.DDP in engines
    finally:
        tuning.device.close()
    with pytest.raises(ConfigError, match="accelerate trains no DeepSpeed on the CPU"):
        prepare(str(model), engines=[Engine.DEEPSPEED], **common)
