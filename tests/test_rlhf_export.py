"""``autotune export --format trl|openrlhf|verl``: an RLHF study's best layout in the RL
frameworks' options. TRL's is read by TRL's own ``GRPOConfig`` (TRL is installed here), which
derives its generation batch from the fields: it must come out as the study's rollout batch.
OpenRLHF's and verl's text is checked here for the layout's values; their own parser and
validation read it in ``tests/test_rlhf_export_frameworks.py``.

The studies here are written through the study's own API with the layout a search would
record (a real ``run --rlhf`` is ``tests/search/test_rlhf_run.py``'s)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autotune import api
from autotune.cli import app
from autotune.config import ConfigError, Engine, TrainConfig
from autotune.study.rlhf import RLHFStudy, RLHFTrial

WORKLOAD = {
    "algorithm": "grpo",
    "policy": "tiny",
    "policy_model": "tiny",
    "models": {"reference": "tiny", "critic": None, "reward": None},
    "seq_len": 256,
    "response_len": 192,
    "rollout_batch": 8,
    "hardware": "1xcpu-cap64MiB",
    "device": "cpu",
}


def study_with(tmp_path: Path, config: TrainConfig, **workload: object) -> str:
    storage = f"sqlite:///{tmp_path}/t.db"
    study = RLHFStudy({**WORKLOAD, **workload}, storage=storage)
    for share, outcome, speed in ((0.9, "oom", 0.0), (0.6, "ok", 3.5), (0.5, "ok", 3.1)):
        study.record(
            RLHFTrial(
                config=config,
                share=share,
                sleep=True,
                micro_batch_size=2,
                outcome=outcome,
                samples_per_second=speed,
            )
        )
    return storage


def export(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["export", *args])
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize(
    "config",
    [
        TrainConfig(ac_every=1),
        TrainConfig(engine=Engine.DEEPSPEED, zero_stage=3, ac_every=2),
    ],
    ids=lambda c: c.label(),
)
def test_trl_reads_the_grpo_export(tmp_path: Path, config: TrainConfig) -> None:
    from trl import GRPOConfig

    storage = study_with(tmp_path, config)
    code, out, err = export("--format", "trl", "--model", "tiny", "--storage", storage)
    assert code == 0, err
    fields = json.loads(out)
    parsed = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, **fields)
    assert parsed.use_vllm and parsed.vllm_mode == "colocate"
    assert parsed.vllm_gpu_memory_utilization == 0.6  # the best layout's, not the OOM's 0.9
    assert parsed.vllm_enable_sleep_mode is True
    assert parsed.per_device_train_batch_size == 2
    assert parsed.gradient_accumulation_steps == 4
    # TRL derives one generation's batch: the study's rollout batch.
    assert parsed.generation_batch_size == WORKLOAD["rollout_batch"]
    assert parsed.generation_batch_size % parsed.num_generations == 0
    assert parsed.max_completion_length == 192 and parsed.vllm_max_model_length == 256
    assert parsed.gradient_checkpointing
    if config.engine is Engine.DEEPSPEED:
        assert parsed.deepspeed["zero_optimization"]["stage"] == 3
    assert "num_generations" in err  # the group is the user's: a note says so


def test_openrlhf_and_verl_carry_the_layout(tmp_path: Path) -> None:
    storage = study_with(
        tmp_path,
        TrainConfig(engine=Engine.DEEPSPEED, zero_stage=3, ac_every=1),
        algorithm="ppo",
        models={"reference": "tiny", "critic": "tiny", "reward": "tiny"},
    )
    code, out, err = export("--format", "openrlhf", "--model", "tiny", "--storage", storage)
    assert code == 0, err
    for flag in (
        "--train.colocate_all",
        "--vllm.gpu_memory_utilization 0.6",
        "--vllm.enable_sleep",
        "--ds.zero_stage 3",
        "--train.micro_batch_size 2",
        "--rollout.batch_size 8",
        "--critic.model_name_or_path tiny",
        "--actor.gradient_checkpointing_enable",
    ):
        assert flag in out, flag
    code, out, err = export("--format", "verl", "--model", "tiny", "--storage", storage)
    assert code == 0, err
    for item in (
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "actor_rollout_ref.rollout.free_cache_engine=True",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "critic.model.path=tiny",
    ):
        assert item in out, item
    assert "FSDP" in err  # verl's workers are FSDP's: a note says what changed
    # Each model is named by autotune's preset (the study's shape), not a checkpoint: a note
    # for each role says so, in both formats.
    for fmt in ("openrlhf", "verl"):
        code, out, err = export("--format", fmt, "--model", "tiny", "--storage", storage)
        said = " ".join(err.split())  # the lines as a terminal of any width wraps them
        for role in ("policy", "critic", "reward model"):
            assert f"the {role}'s path is written as 'tiny'" in said, (fmt, role, err)
    # TRL has no PPO trainer (the command line's one line and exit 2: tests/test_bad_input.py).
    with pytest.raises(ConfigError, match="TRL has no PPO trainer"):
        api.export_rlhf("trl", model="tiny", storage=storage)


def test_a_study_over_two_gpus_exports_their_accumulation(tmp_path: Path) -> None:
    """A search over 2 ranks: 8 sequences an iteration at 2 a rank is 2 micro-steps, on two
    GPUs, in every format."""
    storage = study_with(tmp_path, TrainConfig(engine=Engine.FSDP, zero_stage=3), gpus=2)
    code, out, err = export("--format", "trl", "--model", "tiny", "--storage", storage)
    assert code == 0, err
    fields = json.loads(out)
    assert fields["per_device_train_batch_size"] == 2
    assert fields["gradient_accumulation_steps"] == fields["steps_per_generation"] == 2
    code, out, err = export("--format", "openrlhf", "--model", "tiny", "--storage", storage)
    assert code == 0 and "--vllm.num_engines 2" in out, err
    code, out, err = export("--format", "verl", "--model", "tiny", "--storage", storage)
    assert code == 0 and "trainer.n_gpus_per_node=2" in out, err


@pytest.mark.parametrize("fmt", ["openrlhf", "verl", "trl"])
def test_a_rollout_of_no_whole_number_of_prompts_is_refused(
    tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """OpenRLHF and verl count the rollout batch in prompts, and TRL's GRPOConfig refuses a
    generation batch of no whole number of groups: a GRPO study of 11 sequences, which no
    group of 2 to 8 samples a prompt divides, is refused in one line that says what to do
    (exit 2), not written as another batch."""
    from tests.test_bad_input import one_line, run_main

    storage = study_with(tmp_path, TrainConfig(engine=Engine.FSDP, zero_stage=3), rollout_batch=11)
    args = ("export", "--format", fmt, "--model", "tiny", "--storage", storage)
    code, err = run_main(args, tmp_path, monkeypatch, capsys)
    line = one_line(err)
    assert code == 2, err
    assert "rollout batch of 11 sequences is not a multiple of 2" in line
    assert "--rollout-batch that is a multiple" in line


def test_the_newest_study_with_a_layout_that_fitted_is_exported(tmp_path: Path) -> None:
    """A newer study of the same policy that holds no probe yet (a run stopped before its
    first) neither hides the older one's best nor gets the advice of a study where nothing
    fitted; alone, it says it holds no probe."""
    storage = study_with(tmp_path, TrainConfig(engine=Engine.FSDP, zero_stage=3))
    RLHFStudy({**WORKLOAD, "rollout_batch": 16}, storage=storage)  # newer, empty
    found = api.export_rlhf("trl", model="tiny", storage=storage)
    assert found.launch.rollout_batch == 8 and found.trial.share == 0.6
    alone = f"sqlite:///{tmp_path}/alone.db"
    RLHFStudy(WORKLOAD, storage=alone)
    with pytest.raises(ConfigError, match="holds no probe yet") as raised:
        api.export_rlhf("trl", model="tiny", storage=alone)
    assert "--rollout-share" not in str(raised.value)


def test_export_help_names_every_format() -> None:
    """``autotune export --help`` names the script study's format too."""
    from autotune.handoff.launch import Format
    from autotune.handoff.rlhf import RLFormat

    shown = " ".join(CliRunner().invoke(app, ["export", "--help"]).stdout.split())
    for fmt in (*Format, *RLFormat):
        assert fmt.value in shown, fmt


@pytest.mark.parametrize(
    "config",
    [TrainConfig(), TrainConfig(engine=Engine.FSDP, zero_stage=3, ac_every=1)],
    ids=lambda c: c.label(),
)
def test_trl_trains_without_the_models_checkpointing_where_the_layout_did(
    tmp_path: Path, config: TrainConfig
) -> None:
    """GRPOConfig checkpoints by default: an ``ac:off`` layout (and FSDP's own wrapper, which
    checkpoints every block itself) is exported with the model's checkpointing off, as TRL
    reads it; the reference the layout counted is named, with what TRL needs to load it."""
    from trl import GRPOConfig

    storage = study_with(tmp_path, config)
    code, out, err = export("--format", "trl", "--model", "tiny", "--storage", storage)
    assert code == 0, err
    parsed = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, **json.loads(out))
    assert parsed.gradient_checkpointing is False
    assert "beta above 0" in " ".join(err.split())
