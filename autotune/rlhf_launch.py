"""An RL iteration's layout in the RL frameworks' own options: TRL's ``GRPOConfig``,
OpenRLHF's ``train_ppo_ray`` flags, verl's Hydra overrides. Pure functions over an
:class:`RLHFLaunch`; ``autotune export --format trl|openrlhf|verl`` writes them.

The trainer's part of TRL's config is the ``hf`` export's ``TrainingArguments`` fields
(:func:`autotune.launch.hf_fields`: DeepSpeed's JSON, FSDP, checkpointing), since
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
from autotune.launch import Launch, checkpointing_field, hf_fields
from autotune.rlhf import Algorithm, Placement

__all__ = ["RLFormat", "RLHFLaunch", "render_rlhf"]


class RLFormat(enum.StrEnum):
    """The RL frameworks ``autotune export`` writes for an RLHF study."""

    TRL = "trl"
    """Keyword arguments of ``trl.GRPOConfig``, as JSON (GRPO only: TRL has no PPO trainer)."""
    OPENRLHF = "openrlhf"
    """The flags of OpenRLHF's ``openrlhf.cli.train_ppo_ray`` (PPO, or GRPO's group norm)."""
    VERL = "verl"
    """Hydra overrides of verl's ``verl.trainer.main_ppo``."""


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
    if chosen is RLFormat.OPENRLHF:
        return _openrlhf(launch)
    return _verl(launch)


def trl_fields(launch: RLHFLaunch) -> dict[str, Any]:
    """Keyword arguments of ``trl.GRPOConfig`` for ``launch`` (vLLM colocated)."""
    if launch.algorithm is not Algorithm.GRPO:
        raise ConfigError(
            "TRL has no PPO trainer (GRPOConfig, RLOO): use --format openrlhf or verl for PPO"
        )
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


def openrlhf_args(launch: RLHFLaunch) -> list[str]:
    """The ``python -m openrlhf.cli.train_ppo_ray`` command line for ``launch``, hybrid engine
    (every model and vLLM colocated)."""
    config = launch.config
    args = [
        "python", "-m", "openrlhf.cli.train_ppo_ray",
        *_flag("--pretrain", launch.policy),
        "--colocate_all_models",
        "--vllm_num_engines", str(launch.world_size),
        "--vllm_tensor_parallel_size", "1",
        "--vllm_gpu_memory_utilization", f"{launch.share:g}",
        "--zero_stage", str(config.zero_stage if config.engine is Engine.DEEPSPEED else 3),
        "--micro_train_batch_size", str(launch.micro_batch_size),
        "--train_batch_size", str(launch.rollout_batch),
        "--micro_rollout_batch_size", str(launch.micro_batch_size),
        "--rollout_batch_size", str(launch.rollout_batch),
        "--prompt_max_len", str(launch.seq_len - launch.response_len),
        "--generate_max_len", str(launch.response_len),
    ]  # fmt: skip
    if launch.reward:
        args += _flag("--reward_pretrain", launch.reward)
    if launch.critic:
        args += _flag("--critic_pretrain", launch.critic)
    if launch.algorithm is Algorithm.GRPO:
        args += ["--advantage_estimator", "group_norm", "--n_samples_per_prompt", str(launch.group)]
    if config.precision in (Precision.BF16_MIXED, Precision.BF16):
        args.append("--bf16")
    if config.ac_every:
        args.append("--gradient_checkpointing")
    if config.offload is not Offload.NONE:
        args.append("--adam_offload")
    if launch.sleep:
        args += ["--vllm_enable_sleep", "--deepspeed_enable_sleep"]
    if launch.frozen is Placement.OFFLOAD:
        args.append("--ref_reward_offload")
    return args


def _flag(flag: str, value: str) -> list[str]:
    """A flag and a path, as argparse reads them back: a value that starts with ``-`` would
    read as a flag of its own, so it is joined to its flag with ``=``."""
    return [f"{flag}={value}"] if value.startswith("-") else [flag, value]


def _openrlhf(launch: RLHFLaunch) -> tuple[str, list[str]]:
    notes = []
    if launch.config.engine is not Engine.DEEPSPEED:
        notes.append(
            f"OpenRLHF trains with DeepSpeed ZeRO: the measured {launch.config.engine.value} "
            "layout is written as ZeRO-3"
        )
    if launch.config.ac_every > 1:
        notes.append("OpenRLHF checkpoints every block: every-k checkpointing is written as every")
    line = _lines(openrlhf_args(launch))
    return f"# autotune: {launch.config.label()}\n{line}\n", notes


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
    """Hydra overrides of ``python -m verl.trainer.main_ppo`` for ``launch`` (FSDP workers,
    vLLM rollout colocated)."""
    config = launch.config
    offload = config.offload is not Offload.NONE
    ref = "actor_rollout_ref"
    items = {
        "algorithm.adv_estimator": "grpo" if launch.algorithm is Algorithm.GRPO else "gae",
        "data.train_batch_size": launch.rollout_batch
        // (launch.group if launch.algorithm is Algorithm.GRPO else 1),
        "data.max_prompt_length": launch.seq_len - launch.response_len,
        "data.max_response_length": launch.response_len,
        f"{ref}.model.path": launch.policy,
        f"{ref}.model.enable_gradient_checkpointing": bool(config.ac_every),
        f"{ref}.actor.ppo_mini_batch_size": launch.rollout_batch,
        f"{ref}.actor.ppo_micro_batch_size_per_gpu": launch.micro_batch_size,
        f"{ref}.actor.fsdp_config.param_offload": config.offload is Offload.PARAMS,
        f"{ref}.actor.fsdp_config.optimizer_offload": offload,
        f"{ref}.rollout.name": "vllm",
        f"{ref}.rollout.tensor_model_parallel_size": 1,
        f"{ref}.rollout.gpu_memory_utilization": launch.share,
        f"{ref}.rollout.free_cache_engine": launch.sleep,
        f"{ref}.ref.fsdp_config.param_offload": launch.frozen is Placement.OFFLOAD,
        "trainer.n_gpus_per_node": launch.world_size,
        "trainer.nnodes": 1,
    }
    if launch.algorithm is Algorithm.GRPO:
        items[f"{ref}.rollout.n"] = launch.group
    if launch.critic:
        items["critic.model.path"] = launch.critic
        items["critic.ppo_micro_batch_size_per_gpu"] = launch.micro_batch_size
    if launch.reward:
        items["reward_model.enable"] = True
        items["reward_model.model.path"] = launch.reward
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
    notes = []
    if launch.config.engine is Engine.DEEPSPEED:
        notes.append(
            "verl's workers use FSDP: the measured DeepSpeed layout is written with FSDP's "
            "offload settings"
        )
    body = " \\\n    ".join(shlex.quote(o) for o in verl_overrides(launch))
    return (
        f"# autotune: {launch.config.label()}\npython3 -m verl.trainer.main_ppo \\\n    {body}\n",
        notes,
    )
