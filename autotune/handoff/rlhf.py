"""An RL iteration's layout in the RL frameworks' own options: TRL's ``GRPOConfig``,
OpenRLHF's ``train_ppo_ray`` flags, verl's Hydra overrides. Pure functions over an
:class:`RLHFLaunch`; ``autotune export --format trl|openrlhf|verl`` writes them.

The trainer's part of TRL's config is the ``hf`` export's ``TrainingArguments`` fields
(:func:`autotune.handoff.launch.hf_fields`: DeepSpeed's JSON, FSDP, checkpointing), since
``GRPOConfig`` extends them. OpenRLHF trains with DeepSpeed ZeRO and verl with FSDP: a layout
of another engine is written with a note of what changes.
"""

from __future__ import annotations

import enum
import json
import re
import shlex
from dataclasses import dataclass
from typing import Any

from autotune.config import ConfigError, Engine, Offload, Precision, TrainConfig
from autotune.handoff.launch import Launch, checkpointing_field, hf_fields
from autotune.tuned.rlhf import Algorithm, Placement

__all__ = ["RLFormat", "RLHFLaunch", "render_rlhf"]


class RLFormat(enum.StrEnum):
    """The RL frameworks ``autotune export`` writes for an RLHF study."""

    TRL = "trl"
    """Keyword arguments of ``trl.GRPOConfig``, as JSON (GRPO only: TRL has no PPO trainer)."""
    OPENRLHF = "openrlhf"
    """The flags of OpenRLHF 0.11's ``openrlhf.cli.train_ppo_ray`` (PPO, or GRPO's group
    norm)."""
    VERL = "verl"
    """Hydra overrides of verl 0.9's ``verl.trainer.main_ppo``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RLHFLaunch:
    """A measured layout of an RL iteration, with what the frameworks' options need."""

    algorithm: Algorithm
    policy: str
    reference: str | None
    critic: str | None
    reward: str | None
    hidden_size: int
    config: TrainConfig
    micro_batch_size: int
    grad_accum: int
    world_size: int
    seq_len: int
    response_len: int
    rollout_batch: int
    share: float
    sleep: bool
    frozen: Placement = Placement.RESIDENT

    @property
    def trainer(self) -> Launch:
        return Launch(
            model=self.policy,
            hidden_size=self.hidden_size,
            config=self.config,
            micro_batch_size=self.micro_batch_size,
            grad_accum=self.grad_accum,
            world_size=self.world_size,
            seq_len=self.seq_len,
        )

    @property
    def group(self) -> int:
        """Samples per prompt written for GRPO: the largest divisor of the rollout batch up to
        8 (TRL's default), at least 2. The group is the user's recipe: its size must divide
        the batch."""
        return max((g for g in range(2, 9) if self.rollout_batch % g == 0), default=2)

    @property
    def samples_per_prompt(self) -> int:
        """Responses generated for each prompt: GRPO's group, one for PPO."""
        return self.group if self.algorithm is Algorithm.GRPO else 1


def render_rlhf(launch: RLHFLaunch, fmt: RLFormat | str) -> tuple[str, list[str]]:
    """The text of ``launch`` in ``fmt`` (ends with a newline) and notes on what the format
    cannot carry.

    Raises:
        ConfigError: An unknown format, or PPO for TRL.
    """
    try:
        chosen = RLFormat(fmt)
    except ValueError:
        choices = ", ".join(f.value for f in RLFormat)
        raise ConfigError(f"unknown RLHF export format {fmt!r}: use one of {choices}") from None
    if chosen is RLFormat.TRL:
        return _trl(launch)
    text, notes = _openrlhf(launch) if chosen is RLFormat.OPENRLHF else _verl(launch)
    return text, notes + _preset_notes(launch)


def _preset_notes(launch: RLHFLaunch) -> list[str]:
    """A note for each model the file names by autotune's preset (the shape the study was
    planned with, ``qwen2.5-1.5b``) where the framework loads a checkpoint: its path or Hugging
    Face id is the user's to write."""
    from autotune.models import preset_names

    presets = set(preset_names())
    roles = {"policy": launch.policy, "critic": launch.critic, "reward model": launch.reward}
    return [
        f"the {role}'s path is written as {name!r}, autotune's name of its shape, not a "
        "checkpoint: replace it with your checkpoint's folder or Hugging Face id"
        for role, name in roles.items()
        if name in presets
    ]


def trl_fields(launch: RLHFLaunch) -> dict[str, Any]:
    """Keyword arguments of ``trl.GRPOConfig`` for ``launch`` (vLLM colocated)."""
    if launch.algorithm is not Algorithm.GRPO:
        raise ConfigError(
            "TRL has no PPO trainer (GRPOConfig, RLOO): use --format openrlhf or verl for PPO"
        )
    _prompts(launch, "TRL")  # its generation batch must be a whole number of groups
    fields = hf_fields(launch.trainer)
    # GRPOConfig checkpoints the model by default (TrainingArguments does not): a layout
    # measured without the model's own checkpointing (none, or FSDP's wrapper) says so.
    fields.setdefault(checkpointing_field(launch.trainer.transformers), False)
    fields.update(
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=launch.share,
        vllm_enable_sleep_mode=launch.sleep,
        vllm_tensor_parallel_size=1,
        vllm_max_model_length=launch.seq_len,
        max_completion_length=launch.response_len,
        # One generation feeds the accumulation window: the rollout batch, over all GPUs.
        steps_per_generation=launch.grad_accum,
        num_generations=launch.group,
    )
    return fields


def _trl(launch: RLHFLaunch) -> tuple[str, list[str]]:
    notes = [
        f"num_generations {launch.group}: the samples per prompt are your recipe's; TRL needs "
        f"them to divide the rollout batch of {launch.rollout_batch}",
    ]
    if launch.reward:
        notes.append(f"the reward model {launch.reward}: pass it to GRPOTrainer(reward_funcs=...)")
    if launch.reference:
        notes.append(
            f"the layout holds the reference {launch.reference}, which TRL loads only with "
            "beta above 0 (its default is 0: no KL term, no reference): set beta, your KL "
            "coefficient, to train as measured"
        )
    if launch.frozen is Placement.OFFLOAD:
        notes.append("TRL keeps the reference on the GPUs: it has no offload of it between uses")
    return json.dumps(trl_fields(launch), indent=2) + "\n", notes


OPENRLHF_VERSION = "0.11"
"""The OpenRLHF release whose flags ``--format openrlhf`` writes (its flags are dotted by role:
``--actor.model_name_or_path``, ``--train.colocate_all``...; releases before 0.11 read others)."""
VERL_VERSION = "0.9"
"""The verl release whose configuration keys ``--format verl`` writes."""


def _prompts(launch: RLHFLaunch, framework: str) -> int:
    """The rollout batch in prompts, as OpenRLHF and verl count it (and TRL's generation batch
    must be): the sequences over the samples per prompt.

    Raises:
        ConfigError: The sequences are not a whole number of prompts.
    """
    samples = launch.samples_per_prompt
    if launch.rollout_batch % samples:
        raise ConfigError(
            f"{framework} counts its rollout batch in prompts of {samples} samples each, and the "
            f"study's rollout batch of {launch.rollout_batch} sequences is not a multiple of "
            f"{samples}: run autotune run --rlhf {launch.algorithm.value} again with a "
            "--rollout-batch that is a multiple of 2 to 8 (the samples per prompt)"
        )
    return launch.rollout_batch // samples


def openrlhf_args(launch: RLHFLaunch) -> list[str]:
    """The ``python -m openrlhf.cli.train_ppo_ray`` command line (OpenRLHF 0.11) for
    ``launch``: the hybrid engine, every model and vLLM colocated on the same GPUs, one vLLM
    engine a GPU; one optimizer step of the rollout's sequences.

    Raises:
        ConfigError: The rollout batch is not a whole number of prompts.
    """
    config = launch.config
    gpus = str(launch.world_size)
    args = [
        "python", "-m", "openrlhf.cli.train_ppo_ray",
        *_flag("--actor.model_name_or_path", launch.policy),
        "--actor.num_nodes", "1", "--actor.num_gpus_per_node", gpus,
    ]  # fmt: skip
    if launch.reference:
        # Loaded while the KL coefficient is above 0 (its default): on the actor's GPUs.
        args += ["--ref.num_nodes", "1", "--ref.num_gpus_per_node", gpus]
    else:
        args += ["--algo.kl.init_coef", "0"]
    if launch.critic:
        args += _flag("--critic.model_name_or_path", launch.critic)
        args += ["--critic.num_nodes", "1", "--critic.num_gpus_per_node", gpus]
    if launch.reward:
        args += _flag("--reward.model_name_or_path", launch.reward)
        args += ["--reward.num_nodes", "1", "--reward.num_gpus_per_node", gpus]
    args += [
        "--train.colocate_all",
        "--vllm.num_engines", gpus,
        "--vllm.tensor_parallel_size", "1",
        "--vllm.gpu_memory_utilization", f"{launch.share:g}",
        "--ds.zero_stage", str(config.zero_stage if config.engine is Engine.DEEPSPEED else 3),
        "--ds.param_dtype", "fp16" if config.precision is Precision.FP16_MIXED else "bf16",
        "--algo.advantage.estimator",
        "group_norm" if launch.algorithm is Algorithm.GRPO else "gae",
        "--rollout.n_samples_per_prompt", str(launch.samples_per_prompt),
        # Prompts a rollout; sequences an optimizer step: one step of the rollout's sequences.
        "--rollout.batch_size", str(_prompts(launch, "OpenRLHF")),
        "--rollout.micro_batch_size", str(launch.micro_batch_size),
        "--train.batch_size", str(launch.rollout_batch),
        "--train.micro_batch_size", str(launch.micro_batch_size),
        "--data.max_len", str(launch.seq_len),
        "--rollout.max_new_tokens", str(launch.response_len),
    ]  # fmt: skip
    if config.ac_every:
        args.append("--actor.gradient_checkpointing_enable")  # the critic's too
    if config.offload is not Offload.NONE:
        args.append("--ds.adam_offload")
    if launch.sleep:
        args += ["--vllm.enable_sleep", "--ds.enable_sleep"]
    if launch.frozen is Placement.OFFLOAD:
        args += ["--ref.offload"] if launch.reference else []
        args += ["--reward.offload"] if launch.reward else []
    return args


def _flag(flag: str, value: str) -> list[str]:
    """A flag and a path, as argparse reads them back: a value that starts with ``-`` would
    read as a flag of its own, so it is joined to its flag with ``=``."""
    return [f"{flag}={value}"] if value.startswith("-") else [flag, value]


def _openrlhf(launch: RLHFLaunch) -> tuple[str, list[str]]:
    line = _lines(openrlhf_args(launch))
    notes = [_group_note(launch, "--rollout.n_samples_per_prompt", "--rollout.batch_size")]
    config = launch.config
    if config.engine is not Engine.DEEPSPEED:
        notes.append(
            f"OpenRLHF trains with DeepSpeed ZeRO: the measured {config.engine.value} "
            "layout is written as ZeRO-3"
        )
    if config.ac_every > 1:
        notes.append("OpenRLHF checkpoints every block: every-k checkpointing is written as every")
    if config.precision is Precision.FP32:
        notes.append("OpenRLHF trains in bf16 or fp16: the fp32 layout is written as bf16")
    if config.offload is Offload.PARAMS:
        notes.append(
            "OpenRLHF offloads the optimizer only (--ds.adam_offload): the layout's parameter "
            "offload is written as that"
        )
    if launch.reference:
        notes.append(
            "the layout holds the reference, which OpenRLHF loads while "
            "--algo.kl.init_coef, your KL coefficient, is above 0 (its default, 0.01)"
        )
    else:
        notes.append("the layout holds no reference: --algo.kl.init_coef 0 loads none")
    if not launch.reward:
        notes.append(
            "the layout holds no reward model: give OpenRLHF your reward function "
            "(--reward.remote_url or --train.agent_func_path)"
        )
    return f"# autotune: {config.label()} (OpenRLHF {OPENRLHF_VERSION})\n{line}\n", notes


def _group_note(launch: RLHFLaunch, samples: str, prompts: str) -> str:
    """What the export made of the rollout batch: its prompts and their samples."""
    if launch.algorithm is not Algorithm.GRPO:
        return (
            f"{prompts} {launch.rollout_batch}: the rollout batch, one response a prompt, "
            "trained in one optimizer step"
        )
    return (
        f"{samples} {launch.group}: the samples per prompt are your recipe's; the rollout "
        f"batch of {launch.rollout_batch} sequences is {prompts} "
        f"{launch.rollout_batch // launch.group} prompts, trained in one optimizer step"
    )


def _lines(args: list[str]) -> str:
    """A command line, a flag and its value on each continued line."""
    lines: list[list[str]] = []
    for arg in args:
        joins = lines and not arg.startswith("--")
        if joins and (lines[-1][-1].startswith("--") or lines[-1][0] == "python"):
            lines[-1].append(arg)
        else:
            lines.append([arg])
    return " \\\n    ".join(" ".join(shlex.quote(a) for a in line) for line in lines)


def verl_overrides(launch: RLHFLaunch) -> list[str]:
    """Hydra overrides of ``python -m verl.trainer.main_ppo`` (verl 0.9) for ``launch``: FSDP
    workers and the vLLM rollout colocated; one optimizer step of the rollout's sequences.

    verl counts its batches in prompts (``data.train_batch_size``, ``ppo_mini_batch_size``;
    times ``rollout.n`` in sequences) and its micro-batches in sequences a GPU. It loads the
    reference only for a KL term (``actor.use_kl_loss`` or ``algorithm.use_kl_in_reward``):
    the KL loss is on exactly where the layout counted a reference.

    Raises:
        ConfigError: The rollout batch is not a whole number of prompts.
    """
    config = launch.config
    offload = config.offload is not Offload.NONE
    micro = launch.micro_batch_size
    prompts = _prompts(launch, "verl")
    ref = "actor_rollout_ref"
    items: dict[str, object] = {
        "algorithm.adv_estimator": "grpo" if launch.algorithm is Algorithm.GRPO else "gae",
        "algorithm.use_kl_in_reward": False,
        "data.train_batch_size": prompts,
        "data.max_prompt_length": launch.seq_len - launch.response_len,
        "data.max_response_length": launch.response_len,
        f"{ref}.model.path": launch.policy,
        f"{ref}.model.enable_gradient_checkpointing": bool(config.ac_every),
        f"{ref}.actor.ppo_mini_batch_size": prompts,
        f"{ref}.actor.ppo_micro_batch_size_per_gpu": micro,
        f"{ref}.actor.use_kl_loss": launch.reference is not None,
        f"{ref}.actor.fsdp_config.param_offload": config.offload is Offload.PARAMS,
        f"{ref}.actor.fsdp_config.optimizer_offload": offload,
        f"{ref}.rollout.name": "vllm",
        f"{ref}.rollout.n": launch.samples_per_prompt,
        f"{ref}.rollout.tensor_model_parallel_size": 1,
        f"{ref}.rollout.gpu_memory_utilization": launch.share,
        f"{ref}.rollout.free_cache_engine": launch.sleep,
        f"{ref}.rollout.log_prob_micro_batch_size_per_gpu": micro,
    }
    if launch.reference:
        items[f"{ref}.ref.log_prob_micro_batch_size_per_gpu"] = micro
        items[f"{ref}.ref.fsdp_config.param_offload"] = launch.frozen is Placement.OFFLOAD
    items["critic.enable"] = launch.critic is not None
    if launch.critic:
        items.update(
            {
                "critic.model.path": launch.critic,
                "critic.model.enable_gradient_checkpointing": bool(config.ac_every),
                "critic.ppo_mini_batch_size": prompts,
                "critic.ppo_micro_batch_size_per_gpu": micro,
                "critic.fsdp.param_offload": config.offload is Offload.PARAMS,
                "critic.fsdp.optimizer_offload": offload,
            }
        )
    if launch.reward:
        items.update(
            {
                "reward.reward_model.enable": True,
                "reward.reward_model.model_path": launch.reward,
                "reward.reward_model.rollout.name": "vllm",
                "reward.reward_model.rollout.tensor_model_parallel_size": 1,
                "reward.reward_model.rollout.free_cache_engine": True,
            }
        )
    items["trainer.n_gpus_per_node"] = launch.world_size
    items["trainer.nnodes"] = 1
    return [f"{key}={_hydra(value)}" for key, value in items.items()]


_HYDRA_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
"""What Hydra's override grammar reads as one plain word, a string (its ``ID`` token), but
for its keywords."""
_HYDRA_KEYWORDS = {"true", "false", "null", "nan", "inf"}
"""Words Hydra's grammar reads as a boolean, None or a float, in any case."""


def _hydra(value: object) -> str:
    """``value`` as the value of a Hydra override, read back as itself: a boolean or a number
    as a word, a string as is where the grammar reads it as one plain word, else quoted
    (a path with a comma would be a sweep, ``${...}`` an interpolation, a space or ``=`` a
    syntax error)."""
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, int | float):
        return str(value)
    text = _omegaconf_literal(str(value))
    if _HYDRA_WORD.fullmatch(text) and text.lower() not in _HYDRA_KEYWORDS:
        return text
    return _hydra_quoted(text)


def _omegaconf_literal(text: str) -> str:
    """``text`` as an OmegaConf string that resolves to itself: each ``${`` (an
    interpolation) escaped with a backslash, the backslashes before it doubled."""
    return re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", text)


def _hydra_quoted(text: str) -> str:
    """``text`` in double quotes, as Hydra's grammar un-escapes a quoted value: backslashes
    stand for themselves except a run of them before a quote, the closing one included,
    which is doubled; a quote inside is escaped with one more backslash."""
    inner = re.sub(r'(\\*)"', lambda m: m.group(1) * 2 + '\\"', text)
    inner = re.sub(r"(\\+)\Z", lambda m: m.group(1) * 2, inner)
    return f'"{inner}"'


def _verl(launch: RLHFLaunch) -> tuple[str, list[str]]:
    body = " \\\n    ".join(shlex.quote(o) for o in verl_overrides(launch))
    notes = [_group_note(launch, "actor_rollout_ref.rollout.n", "data.train_batch_size")]
    if launch.config.engine is Engine.DEEPSPEED:
        notes.append(
            "verl's workers use FSDP: the measured DeepSpeed layout is written with FSDP's "
            "offload settings"
        )
    if launch.reference:
        notes.append(
            "the layout holds the reference, which verl loads for a KL "
            "term: the export turns on its KL loss (actor_rollout_ref.actor.use_kl_loss, "
            "kl_loss_coef your coefficient); algorithm.use_kl_in_reward=True instead loads it too"
        )
    else:
        notes.append(
            "the layout holds no reference: no KL term is on (with one, verl loads a reference "
            "the layout did not count)"
        )
    if launch.reward:
        notes.append(
            "verl serves the reward model with an inference engine of its own "
            "(reward.reward_model.rollout), asleep between uses: its gpu_memory_utilization "
            "(default 0.5) was not measured; the layout counted the model's weights alone"
        )
    else:
        notes.append(
            "the layout holds no reward model: verl scores with your reward function "
            "(reward.custom_reward_function)"
        )
    return (
        f"# autotune: {launch.config.label()} (verl {VERL_VERSION})\n"
        f"python3 -m verl.trainer.main_ppo \\\n    {body}\n",
        notes,
    )
