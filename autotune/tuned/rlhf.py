"""An RLHF workload: the models of one PPO or GRPO iteration and the rollout engine beside them.

One iteration of online RL generates a batch of responses with a rollout engine (vLLM), scores
them with the frozen models (the reference's log-probabilities, the reward model's scores) and
the critic's values, then trains the policy (and, for PPO, the critic) on them. In colocate
mode every model and the engine share the training GPUs: the engine claims its share of each
GPU (vLLM's ``gpu_memory_utilization``, a fraction of the GPU's whole memory) for its weights,
its workspace and the KV cache that sets how many sequences decode at once, and may sleep
during training (vLLM's sleep mode: weights to the host, KV cache freed). This module holds
what the user chooses, validated; :mod:`autotune.estimator.rlhf` predicts each phase's memory
and time. Pure: no torch.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from autotune.config import ConfigError, Engine, TrainConfig
from autotune.models import ModelSpec

__all__ = [
    "GRPO_HAS_NO_CRITIC",
    "PPO_NEEDS_A_CRITIC",
    "SHARES",
    "Algorithm",
    "Placement",
    "RLHFModels",
    "RLHFProbe",
    "RLHFWorkload",
    "check_critic",
    "check_share",
    "is_absent",
    "parse_placements",
    "parse_shares",
    "role_names",
    "sharded",
]

GRPO_HAS_NO_CRITIC = (
    "GRPO has no critic (its advantages come from each prompt's group of samples): leave out "
    "--critic, or use --rlhf ppo"
)
PPO_NEEDS_A_CRITIC = "PPO trains a critic: leave out --critic none, or use --rlhf grpo"
SHARES = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
"""The engine shares a plan tries when none is given (vLLM's default is 0.9)."""


class Algorithm(enum.StrEnum):
    """The RL algorithm, which sets the models an iteration needs."""

    PPO = "ppo"
    """Policy and critic trained; reference and reward model frozen (Ouyang et al. 2022)."""
    GRPO = "grpo"
    """Policy trained, advantages from a group of samples per prompt: no critic (Shao et al.
    2024, "DeepSeekMath")."""


class Placement(enum.StrEnum):
    """Where a frozen model waits between its uses."""

    RESIDENT = "gpu"
    """Its weights stay on the training GPUs all iteration (sharded as the trainer's are)."""
    OFFLOAD = "host"
    """Its weights wait in host memory and come to the GPU for its forward of each iteration
    (OpenRLHF's ``--ref_reward_offload``, verl's ``param_offload`` of the reference)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RLHFModels:
    """The models of an iteration. None: absent (GRPO has no critic; a rule-based reward, or a
    verifier, has no model)."""

    policy: ModelSpec
    reference: ModelSpec | None
    critic: ModelSpec | None
    reward: ModelSpec | None

    def frozen(self) -> list[tuple[str, ModelSpec]]:
        """The frozen models present, by role."""
        return [(n, m) for n, m in (("reference", self.reference), ("reward", self.reward)) if m]

    def trained(self) -> list[tuple[str, ModelSpec]]:
        """The trained models: the policy, and the critic where there is one."""
        return [(n, m) for n, m in (("policy", self.policy), ("critic", self.critic)) if m]


@dataclass(frozen=True, kw_only=True, slots=True)
class RLHFWorkload:
    """One RL iteration on ``world_size`` GPUs, fixed for a whole plan or search."""

    algorithm: Algorithm
    models: RLHFModels
    seq_len: int
    """Tokens of a sequence: its prompt and its response (vLLM's ``max_model_len``)."""
    response_len: int
    """Tokens generated per sequence (the rest of ``seq_len`` is the prompt)."""
    rollout_batch: int
    """Sequences generated, scored and trained on per iteration, over all GPUs (prompts times
    samples per prompt: GRPO's group)."""
    world_size: int

    def __post_init__(self) -> None:
        for name in ("seq_len", "response_len", "rollout_batch", "world_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be at least 1")
        if self.response_len >= self.seq_len:
            raise ConfigError(
                f"--response-len {self.response_len} leaves no prompt in --seq-len "
                f"{self.seq_len}: use a response shorter than the sequence"
            )
        if self.rollout_batch % self.world_size:
            raise ConfigError(
                f"--rollout-batch {self.rollout_batch} is not a multiple of {self.world_size} "
                f"GPUs: use a rollout batch divisible by {self.world_size}"
            )
        check_models(self.algorithm, self.models)

    @property
    def prompt_len(self) -> int:
        return self.seq_len - self.response_len

    @property
    def per_rank(self) -> int:
        """Sequences each GPU generates and trains on per iteration."""
        return self.rollout_batch // self.world_size


def check_models(algorithm: Algorithm, models: RLHFModels) -> None:
    """Refuse, in one line, models that cannot make this algorithm's iteration.

    The reference's log-probabilities are compared token by token with the policy's: its
    vocabulary must be the policy's. The critic and the reward model read the policy's token
    ids: an embedding table smaller than the policy's vocabulary cannot (a reward model of
    another tokenizer needs the text decoded and encoded again, which autotune does not plan).

    Raises:
        ConfigError: A critic for GRPO, no critic for PPO, or vocabularies that cannot pair.
    """
    check_critic(algorithm, models.critic is not None)
    vocab = models.policy.vocab_size
    ref = models.reference
    if ref is not None and ref.vocab_size != vocab:
        raise ConfigError(
            f"the reference {ref.name} has a vocabulary of {ref.vocab_size:,} tokens, the policy "
            f"{models.policy.name} {vocab:,}: their log-probabilities cannot pair; use the "
            "policy's own checkpoint (or one of its tokenizer) as the reference"
        )
    for role, other in (("critic", models.critic), ("reward", models.reward)):
        if other is not None and other.vocab_size < vocab:
            raise ConfigError(
                f"the {role} model {other.name} embeds {other.vocab_size:,} tokens, fewer than "
                f"the policy {models.policy.name}'s {vocab:,}: it cannot read the policy's "
                f"token ids; use a {role} model of the policy's tokenizer"
            )


def check_critic(algorithm: Algorithm, has_critic: bool) -> None:
    """Refuse, in one line, a critic for GRPO or none for PPO."""
    if algorithm is Algorithm.GRPO and has_critic:
        raise ConfigError(GRPO_HAS_NO_CRITIC)
    if algorithm is Algorithm.PPO and not has_critic:
        raise ConfigError(PPO_NEEDS_A_CRITIC)


def is_absent(value: object) -> bool:
    """Whether a role's model is given as ``none``: absent (a rule-based reward, say)."""
    return isinstance(value, str) and value.strip().lower() == "none"


def role_names(
    algorithm: Algorithm,
    policy: str,
    *,
    reference: str | None,
    critic: str | None,
    reward: str | None,
) -> dict[str, str | None]:
    """Each role's model as the user named it (a preset or a config.json path): as given,
    the policy's where not given (GRPO: no critic), None where given as ``none``."""

    def named(given: str | None, default: str | None) -> str | None:
        if given is None:
            return default
        return None if is_absent(given) else given

    return {
        "reference": named(reference, policy),
        "critic": named(critic, policy if algorithm is Algorithm.PPO else None),
        "reward": named(reward, policy),
    }


def sharded(config: TrainConfig) -> bool:
    """Whether a trainer of ``config`` shards its parameters over its ranks (ZeRO-3, FSDP's
    full shard): its frozen models' weights are sharded alike (OpenRLHF's and verl's engines
    for the reference)."""
    return config.engine in (Engine.DEEPSPEED, Engine.FSDP) and config.zero_stage == 3


def check_share(share: float) -> float:
    """``share`` as a fraction of a GPU the rollout engine may take; one line outside (0, 1)."""
    if not 0.0 < share < 1.0:
        raise ConfigError(
            f"--rollout-share {share:g}: use a fraction of the GPU strictly between 0 and 1 "
            "(vLLM's gpu_memory_utilization, e.g. 0.5)"
        )
    return share


def parse_shares(text: str | float | None) -> tuple[float, ...]:
    """``--rollout-share``: one fraction (``0.5``, ``50%``), a list (``0.4,0.6``) or None
    for :data:`SHARES`."""
    if text is None:
        return SHARES
    if isinstance(text, float | int):
        return (check_share(float(text)),)
    shares = []
    for part in text.split(","):
        item = part.strip()
        try:
            value = float(item[:-1]) / 100 if item.endswith("%") else float(item)
        except ValueError:
            raise ConfigError(
                f"--rollout-share {text!r}: use fractions such as 0.5 or 50%, comma-separated"
            ) from None
        shares.append(check_share(value))
    return tuple(sorted(set(shares)))


def parse_placements(text: str | None) -> tuple[Placement, ...]:
    """``--frozen``: ``gpu``, ``host`` or both (``gpu,host``, the default)."""
    if text is None:
        return tuple(Placement)
    found = []
    for part in text.split(","):
        try:
            found.append(Placement(part.strip()))
        except ValueError:
            raise ConfigError(
                f"--frozen {text!r}: use gpu (the frozen models stay on the GPUs), host "
                "(offloaded between uses) or gpu,host"
            ) from None
    return tuple(dict.fromkeys(found))


@dataclass(frozen=True, kw_only=True, slots=True)
class RLHFProbe:
    """What a probe of an RL iteration adds to a training probe (``ProbeSpec.rlhf``): the
    other models, by preset name or config.json path (None: absent), and the engine's layout.
    The policy is the probe's model; the trainer its configuration."""

    algorithm: Algorithm
    reference: str | None
    critic: str | None
    reward: str | None
    share: float
    """The engine's share of the device: held as one allocated block of ``share`` times the
    device's memory (the emulated cap, or the GPU's), an emulated reservation (vLLM does not
    run in a probe)."""
    sleep: bool = False
    """Whether the engine's reservation is freed during scoring and training."""
    frozen: Placement = Placement.RESIDENT
    """Where the frozen models wait between their forwards."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "algorithm", Algorithm(self.algorithm))
        object.__setattr__(self, "frozen", Placement(self.frozen))
        check_share(self.share)
        check_critic(self.algorithm, self.critic is not None)

    def to_dict(self) -> dict[str, object]:
        """JSON-able (enums as their values); :meth:`from_dict` reads it back."""
        return {
            f.name: (v.value if isinstance(v, enum.Enum) else v)
            for f in dataclasses.fields(self)
            for v in [getattr(self, f.name)]
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> RLHFProbe:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})  # type: ignore[arg-type]
