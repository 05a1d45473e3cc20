"""``autotune export --format openrlhf|verl`` read by the frameworks themselves.

Each framework runs in an environment of its own (``tests/envs/frameworks.sh``: OpenRLHF 0.11.2 and
verl 0.9.1 at their own transformers releases, before the project's environment; built on
first use into ``build/framework-envs``). The export's text runs in ``sh`` with ``python`` and
``python3`` defined to print their arguments, so the command lines checked are the shell's
reading of the text. Each framework then checks all of them in one process:

- OpenRLHF (``tests/envs/openrlhf_check.py``): ``openrlhf.cli.train_ppo_ray``'s own parser
  and argument checks, and the asserts of its ``train`` on the GPUs of colocated roles (the
  rest of ``train`` starts Ray and vLLM, which do not run here);
- verl (``tests/envs/verl_check.py``): Hydra composes verl's own ``ppo_trainer.yaml`` with the
  overrides, and ``verl.trainer.main_ppo``'s ``validate_config`` checks it with what verl
  decides to load (``need_reference_policy``, ``need_critic``), as ``main_ppo`` does before it
  starts Ray.

The studies are written through the study's own API, their models a local model folder (a
``config.json`` and a tokenizer: verl's critic config loads both), with the layouts a search
would record.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from autotune.cli import app
from autotune.config import Engine, TrainConfig
from autotune.models import resolve_model
from autotune.study.rlhf import RLHFStudy, RLHFTrial
from autotune.tuned.rlhf import Placement

ENVS = Path(__file__).resolve().parent / "envs"
ROLES = ("reference", "critic", "reward")
FLAGS = {"ref": "reference", "critic": "critic", "reward": "reward"}
"""OpenRLHF's flag prefix of each role."""


def _unavailable(reason: str) -> None:
    if "CI" in os.environ:
        pytest.fail(f"{reason} (CI must run the frameworks' checks)", pytrace=False)
    pytest.skip(reason)


def framework_python(framework: str) -> str:
    """The python of ``framework``'s environment, built on first use."""
    done = subprocess.run(
        ["bash", str(ENVS / "frameworks.sh"), framework, sys.executable],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        _unavailable(f"tests/envs/frameworks.sh {framework} failed: {done.stderr.strip()[-2000:]}")
    return done.stdout.strip().splitlines()[-1]


def model_folder(where: Path) -> Path:
    """The tiny llama preset as a model folder: its ``config.json`` and a word-level tokenizer
    of its vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    where.mkdir(parents=True)
    config = resolve_model("tiny").config
    (where / "config.json").write_text(
        json.dumps({**config, "architectures": ["LlamaForCausalLM"]})
    )
    vocab = {f"t{index}": index for index in range(config["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="t0", pad_token="t0", bos_token="t1", eos_token="t2"
    ).save_pretrained(where)
    return where


CASES: dict[str, dict[str, Any]] = {
    # PPO, all four models, 2 GPUs, FSDP without the model's checkpointing, frozen models on
    # the host: one optimizer step of 8 sequences, 2 a micro-step a GPU.
    "ppo": {
        "workload": {"algorithm": "ppo", "gpus": 2, "rollout_batch": 8},
        "roles": ("reference", "critic", "reward"),
        "config": TrainConfig(engine=Engine.FSDP, zero_stage=3),
        "frozen": Placement.OFFLOAD,
    },
    # GRPO with a reference and a rule-based reward: 16 sequences, 8 a prompt.
    "grpo": {
        "workload": {"algorithm": "grpo", "gpus": 1, "rollout_batch": 16},
        "roles": ("reference",),
        "config": TrainConfig(engine=Engine.DEEPSPEED, zero_stage=2, ac_every=1),
        "frozen": Placement.RESIDENT,
    },
    # GRPO without a reference, with a reward model, 2 GPUs: 12 sequences, 6 a prompt.
    "grpo-no-reference": {
        "workload": {"algorithm": "grpo", "gpus": 2, "rollout_batch": 12},
        "roles": ("reward",),
        "config": TrainConfig(engine=Engine.FSDP, zero_stage=3, ac_every=1),
        "frozen": Placement.RESIDENT,
    },
}


def study(storage: str, model: Path, case: dict[str, Any]) -> None:
    """An RLHF study of ``model`` whose best layout is ``case``'s at share 0.6, micro-batch 2."""
    roles = {role: str(model) if role in case["roles"] else None for role in ROLES}
    workload = {
        "policy": str(model), "policy_model": str(model), "models": roles, "seq_len": 256,
        "response_len": 192, "hardware": "1xcpu-cap64MiB", "device": "cpu", **case["workload"],
    }  # fmt: skip
    rlhf = RLHFStudy(workload, storage=storage)
    for share, outcome, speed in ((0.9, "oom", 0.0), (0.6, "ok", 3.5)):
        rlhf.record(
            RLHFTrial(
                config=case["config"],
                share=share,
                sleep=True,
                frozen=case["frozen"],
                micro_batch_size=2,
                outcome=outcome,
                samples_per_second=speed,
            )
        )


def command_line(text: str) -> list[str]:
    """The arguments the shell gives ``python``/``python3`` when it runs ``text``."""
    printed = 'python() { printf "%s\\0" "$@"; }\npython3() { printf "%s\\0" "$@"; }\n'
    done = subprocess.run(
        ["sh", "-c", printed + text], capture_output=True, text=True, check=True, timeout=30
    )
    return done.stdout.split("\0")[:-1]


def framework_check(framework: str, texts: dict[str, str]) -> dict[str, dict[str, Any]]:
    """``framework``'s own check of each export, by case."""
    python = framework_python(framework)
    commands = [command_line(text) for text in texts.values()]
    done = subprocess.run(
        [python, str(ENVS / f"{framework}_check.py")],
        input=json.dumps(commands),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(zip(texts, json.loads(done.stdout), strict=True))


def checked(framework: str, where: Path) -> dict[str, dict[str, Any]]:
    """``framework``'s own check of each case's ``autotune export --format FRAMEWORK``, by
    case: what the framework read, every export accepted."""
    model = model_folder(where / "tiny-model")
    texts = {}
    for index, (name, case) in enumerate(CASES.items()):
        storage = f"sqlite:///{where}/study-{index}.db"
        study(storage, model, case)
        result = CliRunner().invoke(app, ["export", "--format", framework, "--storage", storage])
        assert result.exit_code == 0, result.stderr
        texts[name] = result.stdout
    found = framework_check(framework, texts)
    refused = {name: result["error"] for name, result in found.items() if "error" in result}
    assert not refused, refused
    return found


def gpus(name: str) -> int:
    return int(CASES[name]["workload"]["gpus"])


def arr(found: dict[str, Any]) -> dict[str, Any]:
    """verl's ``actor_rollout_ref`` section of a checked export."""
    return found["config"]["actor_rollout_ref"]


def test_openrlhf_parses_and_checks_every_export(tmp_path: Path) -> None:
    """OpenRLHF 0.11's parser reads every flag of every export (its flags are dotted by role)
    and its checks pass, with the layout's values: each role the layout holds, and the vLLM
    engines, on the layout's GPUs (its default of 8 a role fails its own check on any other
    count); the rollout in prompts; a reference loaded where the layout counted one."""
    args = {name: found["args"] for name, found in checked("openrlhf", tmp_path).items()}
    for name, parsed in args.items():
        assert parsed["train"]["colocate_all"] is True, name
        assert parsed["vllm"]["gpu_memory_utilization"] == 0.6, name
        assert parsed["vllm"]["enable_sleep"] is parsed["ds"]["enable_sleep"] is True, name
        assert parsed["train"]["micro_batch_size"] == parsed["rollout"]["micro_batch_size"] == 2
        assert parsed["data"]["max_len"] == 256 and parsed["rollout"]["max_new_tokens"] == 192
        assert parsed["actor"]["model_name_or_path"].endswith("tiny-model"), name
    assert args["ppo"]["ds"]["zero_stage"] == 3 and args["grpo"]["ds"]["zero_stage"] == 2
    assert args["ppo"]["actor"]["gradient_checkpointing_enable"] is False
    assert args["grpo"]["actor"]["gradient_checkpointing_enable"] is True
    assert args["ppo"]["critic"]["model_name_or_path"].endswith("tiny-model")
    assert args["ppo"]["ref"]["offload"] is args["ppo"]["reward"]["offload"] is True

    # The GPUs of every role the layout holds, and of the vLLM engines.
    for name, parsed in args.items():
        held = [flag for flag, role in FLAGS.items() if role in CASES[name]["roles"]]
        for role in ["actor", *held]:
            assert parsed[role]["num_nodes"] == 1, (name, role)
            assert parsed[role]["num_gpus_per_node"] == gpus(name), (name, role)
        vllm = parsed["vllm"]
        assert vllm["num_engines"] * vllm["tensor_parallel_size"] == gpus(name), name

    # --rollout.batch_size counts prompts: times the samples per prompt, the study's rollout;
    # --train.batch_size counts sequences: one optimizer step of the rollout.
    for name, parsed in args.items():
        prompts, samples = (
            parsed["rollout"]["batch_size"],
            parsed["rollout"]["n_samples_per_prompt"],
        )
        rollout = CASES[name]["workload"]["rollout_batch"]
        assert prompts * samples == parsed["train"]["batch_size"] == rollout, name
    assert args["grpo"]["rollout"]["n_samples_per_prompt"] == 8
    assert args["grpo"]["algo"]["advantage"]["estimator"] == "group_norm"
    assert args["ppo"]["rollout"]["n_samples_per_prompt"] == 1
    assert args["ppo"]["algo"]["advantage"]["estimator"] == "gae"

    # The reference is loaded while the KL coefficient is above 0: kept at its default where
    # the layout holds one, 0 where it holds none.
    assert (
        args["grpo"]["algo"]["kl"]["init_coef"] > 0 and args["ppo"]["algo"]["kl"]["init_coef"] > 0
    )
    assert args["grpo-no-reference"]["algo"]["kl"]["init_coef"] == 0


def test_verl_validates_every_export(tmp_path: Path) -> None:
    """verl 0.9's ``validate_config`` passes every export, with the layout's values: batches
    counted as verl counts them (``data.train_batch_size`` and ``ppo_mini_batch_size`` in
    prompts, times ``rollout.n`` the study's rollout: one optimizer step; micro-batches in
    sequences a GPU, the log-probability forwards' too); the critic trained as measured (verl's
    checkpointing default is on); the reference loaded exactly where the layout counted one."""
    found = checked("verl", tmp_path)
    for name, result in found.items():
        config, rollout = result["config"], CASES[name]["workload"]["rollout_batch"]
        actor, sampling = arr(result)["actor"], arr(result)["rollout"]
        assert config["data"]["train_batch_size"] * sampling["n"] == rollout, name
        assert actor["ppo_mini_batch_size"] * sampling["n"] == rollout, name
        assert actor["ppo_micro_batch_size_per_gpu"] == 2, name
        assert sampling["log_prob_micro_batch_size_per_gpu"] == 2, name
        assert sampling["gpu_memory_utilization"] == 0.6 and sampling["free_cache_engine"], name
        assert config["trainer"]["n_gpus_per_node"] == gpus(name), name
    assert arr(found["grpo"])["rollout"]["n"] == 8
    assert found["grpo"]["config"]["algorithm"]["adv_estimator"] == "grpo"

    # The critic, where the layout has one, with the layout's checkpointing (none in the PPO
    # layout), offload and batches.
    assert found["ppo"]["use_critic"] is True
    assert found["grpo"]["use_critic"] is found["grpo-no-reference"]["use_critic"] is False
    critic = found["ppo"]["config"]["critic"]
    assert critic["model"]["enable_gradient_checkpointing"] is False
    assert arr(found["ppo"])["model"]["enable_gradient_checkpointing"] is False
    assert critic["model"]["path"].endswith("tiny-model")
    assert critic["ppo_micro_batch_size_per_gpu"] == 2
    assert critic["ppo_mini_batch_size"] * critic["rollout_n"] == 8
    assert critic["fsdp"]["param_offload"] is critic["fsdp"]["optimizer_offload"] is False

    # The reference, for a KL term, exactly where the layout counted one; the frozen models'
    # offload as the layout's (the PPO layout's wait on the host).
    assert found["ppo"]["use_reference_policy"] is found["grpo"]["use_reference_policy"] is True
    assert found["grpo-no-reference"]["use_reference_policy"] is False
    ref = arr(found["ppo"])["ref"]
    assert ref["log_prob_micro_batch_size_per_gpu"] == 2
    assert ref["fsdp_config"]["param_offload"] is True
    assert arr(found["grpo"])["ref"]["fsdp_config"]["param_offload"] is False
    assert found["ppo"]["use_reward_model"] is found["grpo-no-reference"]["use_reward_model"]
    assert found["ppo"]["use_reward_model"] is True and found["grpo"]["use_reward_model"] is False
    assert found["ppo"]["config"]["reward"]["reward_model"]["model_path"].endswith("tiny-model")
