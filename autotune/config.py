"""The knobs of one training configuration, as one typed, validated, immutable value.

A :class:`TrainConfig` is a point of the search space without its micro-batch size: the
engine, how model states are sharded and offloaded, the precision, activation checkpointing,
the attention kernel, how the loss meets the logits and the optimizer. Changing any of these
needs a new probe process; the micro-batch size does not, so it travels beside the
configuration (see :class:`autotune.probe.ProbeSpec`).

Invalid combinations are rejected here, with a message that says what to do instead, so that
nothing above this layer ever launches a probe that cannot start.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar


class Engine(enum.StrEnum):
    """Which training engine wraps the model."""

    SINGLE = "single"
    """One process, no torch.distributed."""
    DDP = "ddp"
    """DistributedDataParallel: full replica per rank, gradients all-reduced."""
    FSDP = "fsdp"
    """PyTorch FSDP2 (``fully_shard``), applied per decoder block and to the root."""
    DEEPSPEED = "deepspeed"
    """DeepSpeed ZeRO stages 0-3 with optional CPU offload."""


class Precision(enum.StrEnum):
    """Numeric format of parameters, compute and optimizer state."""

    BF16_MIXED = "bf16-mixed"
    """bf16 compute, fp32 master weights and optimizer state."""
    BF16 = "bf16"
    """Everything in bf16, optimizer state included (half the model-state memory)."""
    FP16_MIXED = "fp16-mixed"
    """fp16 compute with dynamic loss scaling, fp32 master weights (pre-Ampere GPUs)."""
    FP32 = "fp32"
    """No reduced precision at all."""

    @property
    def is_mixed(self) -> bool:
        """16-bit compute over fp32 weights under autocast (bf16-mixed, fp16-mixed)."""
        return self in (Precision.BF16_MIXED, Precision.FP16_MIXED)

    @property
    def compute_dtype(self) -> str:
        """The dtype the matmuls run in (``bf16``, ``fp16``, ``fp32``): the key of a GPU's
        peak FLOP/s and of the torch dtype a probe computes in."""
        return self.value.removesuffix("-mixed")

    @property
    def compute_bytes(self) -> int:
        """Bytes of an element in :attr:`compute_dtype`: 4 in fp32, else 2."""
        return 4 if self is Precision.FP32 else 2


class Offload(enum.StrEnum):
    """Which model states live in host memory instead of device memory."""

    NONE = "none"
    OPTIMIZER = "optimizer"
    """Optimizer state (and the optimizer step) on the CPU."""
    PARAMS = "params"
    """Optimizer state and parameters on the CPU, streamed to the device per layer."""


class Attention(enum.StrEnum):
    """Attention kernel, as Hugging Face's ``attn_implementation``."""

    SDPA = "sdpa"
    """``scaled_dot_product_attention``: flash / memory-efficient kernels when available."""
    EAGER = "eager"
    """Plain matmul-softmax-matmul: materializes the seq x seq score matrix."""
    FLASH = "flash_attention_2"
    """The ``flash-attn`` package's FlashAttention-2 kernels (Dao 2023): a CUDA GPU of the
    Ampere generation or newer, 16-bit compute and ``flash-attn`` installed. It keeps what
    ``sdpa``'s flash kernel keeps (docs/attention.md)."""


class Loss(enum.StrEnum):
    """How the loss is computed from the last hidden states."""

    FULL = "full"
    """The model's own: the whole batch's logits at once, upcast to fp32 for the cross-entropy
    (the largest activation of a model with a large vocabulary)."""
    CHUNKED = "chunked"
    """Cross-entropy over :data:`LOSS_CHUNK_TOKENS` tokens at a time, each chunk's logits
    recomputed in the backward: no more than one chunk's logits ever exist, for one more
    forward of the output layer."""
    FUSED = "fused"
    """Liger-Kernel's fused linear cross-entropy (a CUDA GPU and ``liger-kernel``): chunk by
    chunk, the output layer, the loss and both gradients in the forward, in Triton kernels;
    no logits kept, nothing recomputed."""


class LossDtype(enum.StrEnum):
    """The dtype the training job's loss takes the logits in: a property of the job (its
    framework's loss), not a knob. It sets memory only where the logits are made in 16 bits
    outside autocast (pure bf16 training, FSDP2 and DeepSpeed in their 16-bit compute): under
    autocast, ``cross_entropy`` and ``log_softmax`` run in fp32 whatever the job asks (they are
    on autocast's fp32 list), and in fp32 training the logits are fp32 already."""

    FP32 = "fp32"
    """The logits copied to fp32 before the log-softmax, whose fp32 output is kept for the
    backward: transformers' ``ForCausalLMLoss`` (``logits.float()``) and torchtitan's
    ``cross_entropy_loss`` (``pred.flatten(0, 1).float()``), so autotune's stand-in and every
    export it writes; the default."""
    LOGITS = "logits"
    """In the logits' own dtype: no fp32 copy, the log-probabilities and their gradients in 16
    bits (``F.cross_entropy`` on bf16 logits outside autocast, as a plain loop writes it). The
    job holds the logits it made the loss from through the backward."""


class Schedule(enum.StrEnum):
    """How a pipeline-parallel layout orders its microbatches' forwards and backwards."""

    GPIPE = "gpipe"
    """Every microbatch's forward, then every backward (Huang et al. 2019, "GPipe"): a stage
    holds all the step's microbatches' activations."""
    ONE_F_ONE_B = "1f1b"
    """One forward, one backward once the pipeline is full (Narayanan et al. 2019,
    "PipeDream"; Megatron-LM's non-interleaved schedule): the first stage holds ``pp``
    microbatches' activations."""
    INTERLEAVED_1F1B = "interleaved-1f1b"
    """1F1B over ``pp_virtual`` model chunks a rank (Narayanan et al. 2021, "Efficient
    Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", section 2.2.2): the
    bubble divided by the chunks, the first stage holding ``1 + (pp - 1) / (pp * v)`` times
    1F1B's activations."""


class Optimizer(enum.StrEnum):
    """The optimizer and the bytes of its state."""

    ADAMW = "adamw"
    """torch's fused AdamW: two moments in the master weights' dtype (fp32, or bf16 in pure
    bf16), one kernel per parameter group (Hugging Face's ``adamw_torch_fused``)."""
    ADAMW_8BIT = "adamw-8bit"
    """torchao's ``AdamW8bit``: both moments as 8-bit codes with an fp32 scale per
    :data:`OPTIMIZER_8BIT_BLOCK` values (block-wise quantization, Dettmers et al. 2022), about
    a quarter of fp32 moments; the weights and their update stay in full precision. Tensors
    under 4,096 values keep plain moments. Needs ``torchao``; not with DeepSpeed nor offload."""


DEFAULT_OPTIMIZERS = (Optimizer.ADAMW, Optimizer.ADAMW_8BIT)
"""The optimizers a plan tries unless told (``--optimizer``); ``run`` searches fused AdamW
unless told (``autotune.api.SEARCHED_KNOBS``)."""

ADAMW_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {"lr": 5e-5, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
)
"""The AdamW hyperparameters autotune writes where a format must hold values (the DeepSpeed
JSON's optimizer block, the FSDP2 module's ``build_optimizer``), and the probes' betas, eps
and weight decay: the Hugging Face Trainer's defaults (``TrainingArguments``' learning_rate,
adam_beta1, adam_beta2, adam_epsilon and weight_decay), one set for every format. They change
neither memory nor speed, which is all a probe measures: every export that writes them says
they are the user's to set. Formats that take the trainer's own values write ``"auto"``."""

OPTIMIZER_8BIT_BLOCK = 256
"""Values per fp32 scale of the 8-bit moments (torchao's and bitsandbytes' default block)."""
OPTIMIZER_8BIT_MIN_VALUES = 4096
"""Tensors (a rank's shard, under FSDP2) of fewer values keep plain moments in 8-bit AdamW, as
do those whose size is not a whole number of blocks (torchao ``optim/adam.py``, after
bitsandbytes)."""


LORA_RANK = 16
"""The adapters' rank ``r`` when LoRA is allowed (``--allow lora``; ``--lora-rank`` to set it)."""
LORA_TARGETS = "all-linear"
"""What LoRA adapts: peft's ``all-linear``, every linear layer of the decoder blocks
(attention's projections and the MLP's), not the output layer (Dettmers et al. 2023, QLoRA,
section 4: adapters on every linear layer match full fine-tuning where attention-only ones do
not)."""


def lora_alpha(rank: int) -> int:
    """The adapters' scale numerator, ``2 r`` (the scale ``alpha / r`` is then 2, as in
    peft's examples); it sets no memory nor time, only the update's size."""
    return 2 * rank


DEFAULT_LOSSES = (Loss.FULL, Loss.CHUNKED)
"""The losses a plan tries unless told (``--loss``); ``run`` searches the model's own unless
told (``autotune.api.SEARCHED_KNOBS``)."""

LOSS_CHUNK_TOKENS = 1024
"""Tokens per chunk of the chunked loss: the probe's chunk and the estimator's. A chunk's
logits of a 152k vocabulary (Qwen2.5) in fp32 are 0.6 GiB, against 9.3 GiB for a micro-batch of
8 sequences of 2048 tokens at once; the output layer's matmul of 1024 rows keeps the GPU busy."""


SELECTIVE_SAVED_OPS = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attn_forward",
)
"""The aten operators whose outputs op-level selective checkpointing (``ac_ops``) keeps: the
matmuls and the attention kernels, the compute-bound ops; everything else a block computes is
recomputed in the backward. torchtitan's op-level policy, less its every-other-matmul
refinement. The probe and the FSDP2 export apply it; the estimator counts its outputs."""


# NOTE: which zero stages each engine understands. For FSDP2, stage 3 is FULL_SHARD
# (``reshard_after_forward=True``) and stage 2 is SHARD_GRAD_OP (parameters stay gathered
# between forward and backward); FSDP2 has no optimizer-only sharding (stage 1).
_ENGINE_STAGES: dict[Engine, tuple[int, ...]] = {
    Engine.SINGLE: (0,),
    Engine.DDP: (0,),
    Engine.FSDP: (2, 3),
    Engine.DEEPSPEED: (0, 1, 2, 3),
}


def checkpointed_fraction(num_layers: int, every: int) -> float:
    """Fraction of decoder blocks recomputed in the backward (for hardware FLOPs): blocks
    0, k, 2k, ... are checkpointed with ``ac_every=k``."""
    if every <= 0:
        return 0.0
    return len(range(0, num_layers, every)) / num_layers


DEVICES = ("auto", "cuda", "cpu")
"""Where probes run (``--device``): the GPUs here, the CPU, or the GPUs if any."""


class ConfigError(ValueError):
    """A configuration that cannot run; the message says what to change."""


class NothingFits(ConfigError):
    """The workload is predicted to fit no configuration of the hardware: not a mistyped
    option but an answer (the command exits 1, as a run that found nothing that fits)."""


_Choice = TypeVar("_Choice", bound=enum.Enum)


def parse_choice(kind: type[_Choice], value: _Choice | str | None, what: str) -> _Choice | None:
    """One of an option's choices (``Engine``, ``Precision``, ...), given as itself or by its
    name (a job file's text); None stays None.

    Raises:
        ConfigError: ``unknown precision 'fp8': use one of ...``.
    """
    if value is None or isinstance(value, kind):
        return value
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(str(c.value) for c in kind)
        raise ConfigError(f"unknown {what} {value!r}: use one of {choices}") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """One rung of the ladder: everything about a probe except its micro-batch size."""

    engine: Engine = Engine.SINGLE
    """Training engine that wraps the model."""
    zero_stage: int = 0
    """0 none, 1 optimizer state, 2 + gradients, 3 + parameters sharded over the ranks."""
    precision: Precision = Precision.BF16_MIXED
    """Numeric format of parameters, compute and optimizer state."""
    ac_every: int = 0
    """Activation checkpointing: 0 off, 1 every decoder block, k every k-th block."""
    ac_ops: bool = False
    """Op-level selective checkpointing of the blocks not checkpointed whole: each keeps its
    matmul and attention outputs and recomputes the rest (norms, rotary embeddings,
    activation functions, casts) in the backward."""
    offload: Offload = Offload.NONE
    """Model states kept in host memory."""
    attention: Attention = Attention.SDPA
    """Attention kernel."""
    loss: Loss = Loss.FULL
    """How the cross-entropy meets the logits."""
    optimizer: Optimizer = Optimizer.ADAMW
    """The optimizer, which sets the bytes of its state."""
    lora_rank: int = 0
    """0: every weight is trained. r > 0: LoRA (Hu et al. 2021) with rank-r adapters on every
    linear layer of the blocks (:data:`LORA_TARGETS`, peft), the rest frozen in the compute
    dtype: another training than full fine-tuning, searched only where the user allows it
    (``--allow lora``)."""
    torch_compile: bool = False
    """Each decoder block compiled with ``torch.compile`` (after checkpointing, as torchtitan
    does): the min-cut partitioner chooses what the backward keeps, inductor fuses the rest."""
    act_offload: bool = False
    """Activation offload: what the decoder blocks save for the backward (a checkpointed
    block's input, every other block's saved tensors but its weights) kept in pinned host
    memory from the forward to the backward, copied over the host link both ways."""
    tp: int = 1
    """Tensor-parallel degree: each block's attention heads and MLP columns split over ``tp``
    ranks (Shoeybi et al. 2019, "Megatron-LM"), with sequence parallelism (Korthikanti et al.
    2022): the norms' and the residual stream's activations split along the sequence, so
    every activation of a block is divided by ``tp``. 1: none."""
    pp: int = 1
    """Pipeline-parallel degree: the blocks split into ``pp`` stages (``pp * pp_virtual``
    chunks), the micro-steps of a step flowing through them as microbatches. 1: none."""
    pp_schedule: Schedule = Schedule.ONE_F_ONE_B
    """The pipeline's schedule (with ``pp`` > 1)."""
    pp_virtual: int = 1
    """Model chunks a rank holds under the interleaved schedule (Megatron's virtual stages)."""
    cp: int = 1
    """Context-parallel degree: each sequence split into ``cp`` shards, attention exchanging
    keys and values around a ring (Liu et al. 2023, "Ring Attention"). 1: none."""

    def __post_init__(self) -> None:
        # Accept plain strings from JSON, the CLI or an Optuna trial.
        for name, kind in (
            ("engine", Engine),
            ("precision", Precision),
            ("offload", Offload),
            ("attention", Attention),
            ("loss", Loss),
            ("optimizer", Optimizer),
            ("pp_schedule", Schedule),
        ):
            value = getattr(self, name)
            if not isinstance(value, kind):
                try:
                    object.__setattr__(self, name, kind(value))
                except ValueError:
                    choices = ", ".join(k.value for k in kind)
                    raise ConfigError(f"unknown {name} {value!r}: use one of {choices}") from None
        for name in ("ac_ops", "act_offload", "torch_compile"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                if value not in (0, 1):
                    raise ConfigError(
                        f"invalid {name.replace('_', '-')} {value!r}: use true or false"
                    )
                object.__setattr__(self, name, bool(value))
        for name in ("zero_stage", "ac_every", "lora_rank", *LAYOUT_DEGREES):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                try:
                    object.__setattr__(self, name, int(value))
                except (TypeError, ValueError):
                    raise ConfigError(
                        f"invalid {name.replace('_', '-')} {value!r}: use a whole number"
                    ) from None
        self._validate()

    def _validate(self) -> None:
        stages = _ENGINE_STAGES[self.engine]
        if self.zero_stage not in stages:
            hint = {
                Engine.SINGLE: "use --engine deepspeed or fsdp to shard",
                Engine.DDP: "use --engine deepspeed or fsdp to shard",
                Engine.FSDP: "FSDP2 has no optimizer-only sharding; use --engine deepspeed",
                Engine.DEEPSPEED: "use --zero-stage 0, 1, 2 or 3",
            }[self.engine]
            raise ConfigError(
                f"zero stage {self.zero_stage} is not available with engine "
                f"{self.engine.value} (it takes {', '.join(map(str, stages))}): {hint}"
            )
        if self.ac_every < 0:
            raise ConfigError(
                f"activation checkpointing every {self.ac_every} blocks: use off, every, or N >= 1"
            )
        if self.ac_ops and self.ac_every == 1:
            raise ConfigError(
                "every block is checkpointed whole, so op-level checkpointing has none left: "
                "use --ac every, or --ac ops (every-N+ops for both)"
            )
        if self.offload is not Offload.NONE:
            if self.engine in (Engine.SINGLE, Engine.DDP):
                raise ConfigError(
                    f"offload {self.offload.value} needs a sharding engine: "
                    "use --engine deepspeed or fsdp"
                )
            if self.engine is Engine.FSDP and self.offload is Offload.OPTIMIZER:
                raise ConfigError(
                    "FSDP2 offloads parameters, gradients and optimizer state together: "
                    "use --offload params with fsdp, or --engine deepspeed for optimizer-only"
                )
            if self.engine is Engine.DEEPSPEED:
                if self.zero_stage == 0:
                    needed = 3 if self.offload is Offload.PARAMS else 1
                    raise ConfigError(
                        f"DeepSpeed {self.offload.value} offload needs ZeRO stage {needed} or "
                        f"higher: add --zero-stage {needed}"
                    )
                if self.offload is Offload.PARAMS and self.zero_stage != 3:
                    raise ConfigError(
                        "DeepSpeed parameter offload needs ZeRO stage 3: use --zero-stage 3 "
                        "or --offload optimizer"
                    )
        if self.loss is Loss.FUSED and self.engine is Engine.DEEPSPEED and self.zero_stage == 3:
            raise ConfigError(
                "the fused loss reads the output layer's weight outside the layer, where ZeRO-3 "
                "holds only a partition of it: use --loss chunked with ZeRO-3, or --zero-stage 2"
            )
        if self.optimizer is Optimizer.ADAMW_8BIT:
            if self.engine is Engine.DEEPSPEED:
                raise ConfigError(
                    "DeepSpeed's ZeRO steps its own optimizer over flat fp32 partitions: use "
                    "--optimizer adamw-8bit with --engine fsdp, ddp or single, or --optimizer "
                    "adamw with deepspeed"
                )
            if self.offload is not Offload.NONE:
                raise ConfigError(
                    "8-bit AdamW keeps its moments on the device, where offload would move "
                    "them to the host: use --optimizer adamw with offload, or no offload"
                )
        if self.is_layout:
            self._validate_layout()
        if self.lora_rank:
            self._validate_lora()
        if self.act_offload:
            self._validate_act_offload()
        if self.torch_compile:
            self._validate_compile()
        if self.attention is Attention.FLASH and self.precision is Precision.FP32:
            raise ConfigError(
                "flash attention computes in bf16 or fp16: use --precision bf16-mixed, or "
                "--attention sdpa in fp32"
            )
        if self.engine is Engine.DEEPSPEED and self.precision is Precision.BF16:
            raise ConfigError(
                "DeepSpeed keeps fp32 master weights: use --precision bf16-mixed with deepspeed"
            )
        if self.engine is Engine.FSDP and self.precision is Precision.FP16_MIXED:
            raise ConfigError(
                "fp16 loss scaling is not wired for FSDP2: use bf16-mixed, or --engine deepspeed "
                "for fp16"
            )

    def _validate_layout(self) -> None:
        """The layout's own rules; those that need the world or the model (degrees dividing
        them) are :func:`autotune.layouts.check_layout`'s."""
        for name in LAYOUT_DEGREES:
            if getattr(self, name) < 1:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} {getattr(self, name)}: use 1 or more")
        if self.pp == 1 and (self.pp_virtual > 1 or self.pp_schedule is not Schedule.ONE_F_ONE_B):
            raise ConfigError(
                "a pipeline schedule needs pipeline stages: add --pp 2 or more, or leave out "
                "--pp-schedule and --pp-virtual"
            )
        interleaved = self.pp_schedule is Schedule.INTERLEAVED_1F1B
        if interleaved != (self.pp_virtual > 1):
            raise ConfigError(
                "the interleaved schedule runs 2 or more model chunks a rank, and only it does: "
                "use --pp-schedule interleaved-1f1b with --pp-virtual 2 or more"
            )
        if self.engine is Engine.DEEPSPEED:
            raise ConfigError(
                "tensor, pipeline and context parallel layouts are planned with FSDP2 or DDP "
                "for the data-parallel degree: use --engine fsdp or ddp, or --tp/--pp/--cp 1"
            )
        not_yet = [
            ("offload", self.offload is not Offload.NONE),
            ("activation offload", self.act_offload),
            ("LoRA", bool(self.lora_rank)),
            ("the 8-bit optimizer", self.optimizer is Optimizer.ADAMW_8BIT),
            (f"the {self.loss.value} loss", self.loss is not Loss.FULL),
            ("compiled blocks", self.torch_compile),
        ]
        named = [what for what, on in not_yet if on]
        if named:
            raise ConfigError(
                f"{named[0]} is not planned with tensor, pipeline or context parallelism: "
                "leave it out, or use --tp/--pp/--cp 1"
            )
        if self.cp > 1 and self.attention is Attention.FLASH:
            raise ConfigError(
                "context parallelism runs torch's scaled-dot-product attention around the "
                "ring: use --attention sdpa with --cp"
            )

    @property
    def is_layout(self) -> bool:
        """Whether the configuration is more than data parallelism: tensor, pipeline or
        context parallel (any layout field off its default)."""
        return any(getattr(self, name) != value for name, value in _LAYOUT_DEFAULTS.items())

    @property
    def model_parallel(self) -> int:
        """Ranks that hold one replica of the model between them: ``tp * pp * cp``."""
        return self.tp * self.pp * self.cp

    def _validate_lora(self) -> None:
        """What LoRA is modelled and probed with: the plain engines, the model's own loss,
        block checkpointing, fused AdamW (its moments are the adapters' alone)."""
        if self.lora_rank < 0:
            raise ConfigError(f"LoRA rank {self.lora_rank}: use a rank of 1 or more, or 0 for none")
        if self.engine not in (Engine.SINGLE, Engine.DDP):
            raise ConfigError(
                "LoRA trains adapters too small to shard: use --engine single or ddp with LoRA"
            )
        if self.ac_ops:
            raise ConfigError(
                "op-level checkpointing is not modelled with LoRA yet: use --ac off, every or "
                "every-N with LoRA"
            )
        if self.loss is not Loss.FULL:
            raise ConfigError(
                f"the {self.loss.value} loss is not modelled with LoRA yet: use --loss full "
                "with LoRA"
            )
        if self.optimizer is not Optimizer.ADAMW:
            raise ConfigError(
                "LoRA's optimizer holds the adapters' moments alone, which 8-bit AdamW would "
                "not shrink: use --optimizer adamw with LoRA"
            )

    def _validate_act_offload(self) -> None:
        """What activation offload is modelled and probed with: the plain engines and FSDP2,
        block checkpointing, full fine-tuning."""
        if self.engine is Engine.DEEPSPEED:
            raise ConfigError(
                "activation offload is not wired for DeepSpeed (its cpu_checkpointing takes "
                "its own checkpointing API): use --engine fsdp, ddp or single with it"
            )
        if self.ac_ops:
            raise ConfigError(
                "op-level checkpointing keeps its saved tensors in a cache of its own, which "
                "activation offload cannot move: use --ac off, every or every-N with it"
            )
        if self.lora_rank:
            raise ConfigError(
                "activation offload is not modelled with LoRA yet: use one or the other"
            )

    def _validate_compile(self) -> None:
        """What compiled blocks are modelled and probed with: the plain engines and FSDP2,
        block checkpointing, full fine-tuning."""
        if self.engine is Engine.DEEPSPEED:
            raise ConfigError(
                "compiled blocks are not wired for DeepSpeed (its engine compiles through a "
                "config section of its own): use --engine fsdp, ddp or single with --compile"
            )
        if self.ac_ops:
            raise ConfigError(
                "op-level checkpointing is not modelled with compiled blocks yet: use --ac off, "
                "every or every-N with --compile"
            )
        if self.act_offload:
            raise ConfigError(
                "activation offload's saved-tensor hooks are not modelled with compiled blocks: "
                "use one or the other"
            )
        if self.lora_rank:
            raise ConfigError(
                "compiled blocks are not modelled with LoRA yet: use one or the other"
            )

    @property
    def is_lora(self) -> bool:
        """Whether only LoRA adapters are trained."""
        return self.lora_rank > 0

    def model_code_knobs(self) -> list[tuple[str, str]]:
        """The knobs of this configuration that change the Hugging Face model's code (what a
        framework with a model of its own, Megatron-LM's or torchtitan's, cannot carry as
        such): each its field's name and its name for a message (``("loss", "the chunked
        loss")``)."""
        knobs = (
            ("ac_ops", self.ac_ops, "op-level selective checkpointing"),
            ("attention", self.attention is not Attention.SDPA,
             f"the {self.attention.value} attention kernel"),
            ("loss", self.loss is not Loss.FULL, f"the {self.loss.value} loss"),
            ("optimizer", self.optimizer is not Optimizer.ADAMW,
             f"the {self.optimizer.value} optimizer"),
            ("lora_rank", self.is_lora, "LoRA"),
            ("torch_compile", self.torch_compile, "compiled blocks"),
            ("act_offload", self.act_offload, "activation offload"),
        )  # fmt: skip
        return [(field, name) for field, present, name in knobs if present]

    @property
    def is_distributed(self) -> bool:
        """Whether the engine or the layout needs torch.distributed (even with one process)."""
        return self.engine is not Engine.SINGLE or self.model_parallel > 1

    def label(self) -> str:
        """A short human-readable name, e.g. ``deepspeed z3 +off:optimizer ac:1``."""
        parts = [self.engine.value]
        if self.zero_stage:
            parts.append(f"z{self.zero_stage}")
        if self.offload is not Offload.NONE:
            parts.append(f"off:{self.offload.value}")
        parts.append(f"ac:{ac_to_text(self.ac_every, self.ac_ops)}")
        if self.precision is not Precision.BF16_MIXED:
            parts.append(self.precision.value)
        if self.attention is not Attention.SDPA:
            parts.append(self.attention.value)
        if self.loss is not Loss.FULL:
            parts.append(f"loss:{self.loss.value}")
        if self.optimizer is not Optimizer.ADAMW:
            parts.append(f"optim:{self.optimizer.value}")
        if self.lora_rank:
            parts.append(f"lora:r{self.lora_rank}")
        if self.torch_compile:
            parts.append("compile")
        if self.act_offload:
            parts.append("act:host")
        if self.tp > 1:
            parts.append(f"tp{self.tp}")
        if self.pp > 1:
            virtual = f"x{self.pp_virtual}" if self.pp_virtual > 1 else ""
            parts.append(f"pp{self.pp}{virtual}:{self.pp_schedule.value}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (enums as their values); the layout's fields only where they
        are not data parallelism's (a data-parallel configuration's dict, and so its recorded
        trials, read as before the layouts)."""
        return {
            f.name: (v.value if isinstance(v, enum.Enum) else v)
            for f in dataclasses.fields(self)
            for v in [getattr(self, f.name)]
            if f.name not in _LAYOUT_DEFAULTS or v != _LAYOUT_DEFAULTS[f.name]
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Inverse of :meth:`to_dict`; unknown keys are an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown configuration keys: {', '.join(sorted(unknown))}")
        return cls(**data)


LAYOUT_DEGREES = ("tp", "pp", "pp_virtual", "cp")
"""The layout's degrees (:class:`TrainConfig`), each a whole number of 1 or more."""

_LAYOUT_DEFAULTS: dict[str, object] = {
    "tp": 1,
    "pp": 1,
    "pp_schedule": Schedule.ONE_F_ONE_B.value,
    "pp_virtual": 1,
    "cp": 1,
}


def parse_losses(value: str | Iterable[Loss | str] | None) -> tuple[Loss, ...] | None:
    """The losses to try, from ``full,chunked`` (the CLI, a job file) or a list; None: all.

    Raises:
        ConfigError: ``unknown loss in 'liger': use full or chunked or fused, comma-separated``.
    """
    return _parse_list(Loss, value, "loss")


def parse_optimizers(
    value: str | Iterable[Optimizer | str] | None,
) -> tuple[Optimizer, ...] | None:
    """The optimizers to try, from ``adamw,adamw-8bit`` (the CLI, a job file) or a list; None:
    the default.

    Raises:
        ConfigError: ``unknown optimizer in 'adam8': use adamw or adamw-8bit, comma-separated``.
    """
    return _parse_list(Optimizer, value, "optimizer")


def _parse_list(
    kind: type[_Choice], value: str | Iterable[Any] | None, what: str
) -> tuple[_Choice, ...] | None:
    if value is None:
        return None
    names = value.split(",") if isinstance(value, str) else list(value)
    choices = " or ".join(str(x.value) for x in kind)
    try:
        chosen = tuple(dict.fromkeys(kind(str(name).strip()) for name in names))
    except ValueError:
        raise ConfigError(f"unknown {what} in {value!r}: use {choices}, comma-separated") from None
    if not chosen:
        raise ConfigError(f"no {what} named: use {choices}")
    return chosen


@dataclass(frozen=True, kw_only=True, slots=True)
class Knobs:
    """The knobs beyond the ladder a search space tries (``--loss``, ``--ac-ops``,
    ``--optimizer``, ``--act-offload``): every rung of the ladder with every combination of
    them that is valid (the planner keeps a combination only where it pays)."""

    losses: tuple[Loss, ...] = DEFAULT_LOSSES
    op_checkpointing: bool = True
    """Op-level selective checkpointing (``ac:ops``) as a rung between none and every 4th
    block."""
    optimizers: tuple[Optimizer, ...] = DEFAULT_OPTIMIZERS
    lora_rank: int = 0
    """LoRA at this rank beside full fine-tuning (``plan --allow lora``); 0: full fine-tuning
    alone. LoRA trains another model than full fine-tuning: its rows rank after the full
    ones that fit."""
    activation_offload: bool = True
    """Activation offload (``act:host``) beside each configuration it is valid with."""
    block_patterns: bool = True
    """Checkpointing every 4th and every 2nd block as rungs between none and every block
    (False: a user's script whose own switch checkpoints every block or none)."""
    block_checkpointing: bool = True
    """Checkpointing blocks at all (False: a user's job that cannot: no configuration that
    checkpoints is tried)."""

    def __post_init__(self) -> None:
        if self.lora_rank < 0:
            raise ConfigError(f"LoRA rank {self.lora_rank}: use a rank of 1 or more")
        object.__setattr__(self, "losses", tuple(dict.fromkeys(map(Loss, self.losses))))
        object.__setattr__(
            self, "optimizers", tuple(dict.fromkeys(map(Optimizer, self.optimizers)))
        )
        if not self.losses:
            raise ConfigError(f"no loss to try: use --loss {' or '.join(x.value for x in Loss)}")
        if not self.optimizers:
            choices = " or ".join(x.value for x in Optimizer)
            raise ConfigError(f"no optimizer to try: use --optimizer {choices}")


KNOB_OFF: Mapping[str, Any] = MappingProxyType(
    {
        "loss": Loss.FULL,
        "ac_ops": False,
        "optimizer": Optimizer.ADAMW,
        "lora_rank": 0,
        "act_offload": False,
        "torch_compile": False,
    }
)
"""Each :class:`TrainConfig` field beyond the ladder at its off value: a configuration with
all of them off is a rung of the ladder, and one with a knob on has, per knob, a twin with it
off (what the planner weighs a knob that trades time for memory against, and what the
simulated GPU draws its error from)."""

LADDER_ONLY = Knobs(
    losses=(KNOB_OFF["loss"],),
    op_checkpointing=KNOB_OFF["ac_ops"],
    optimizers=(KNOB_OFF["optimizer"],),
    activation_offload=KNOB_OFF["act_offload"],
)
"""The ladder's rungs alone: the model's own loss, block checkpointing, fused AdamW."""

PLANNED_KNOBS = Knobs()
"""What ``plan`` tries unless told: every loss that runs everywhere, op-level checkpointing,
both optimizers and activation offload, each kept where it pays."""


_AC_PATTERN = re.compile(r"^(?:every-?)?(\d+)$")


def parse_ac_ops(text: str) -> tuple[int, bool]:
    """Parse ``--ac``: :func:`parse_ac`'s forms, ``ops`` (op-level selective checkpointing of
    every block) or ``every-N+ops`` (every N-th block whole, the others op-level), into
    (:attr:`TrainConfig.ac_every`, :attr:`TrainConfig.ac_ops`)."""
    value = text.strip().lower()
    if value in ("ops", "selective", "off+ops"):
        return 0, True
    if value.endswith("+ops"):
        return parse_ac(value.removesuffix("+ops")), True
    return parse_ac(value), False


def parse_ac(text: str) -> int:
    """Parse ``off``, ``every``, ``every-2`` or ``2`` into :attr:`TrainConfig.ac_every`."""
    value = text.strip().lower()
    if value in ("off", "none", "0", "no", "false"):
        return 0
    if value in ("every", "full", "all", "1"):
        return 1
    match = _AC_PATTERN.match(value)
    if match and int(match.group(1)) >= 1:
        return int(match.group(1))
    raise ConfigError(
        f"invalid activation checkpointing {text!r}: use off, every, every-N (every N-th "
        "block), ops (op-level in every block) or every-N+ops"
    )


def ac_to_text(ac_every: int, ac_ops: bool = False) -> str:
    """Inverse of :func:`parse_ac` (and with ``ac_ops``, of :func:`parse_ac_ops`)."""
    blocks = {0: "off", 1: "every"}.get(ac_every, f"every-{ac_every}")
    if not ac_ops:
        return blocks
    return "ops" if ac_every == 0 else f"{blocks}+ops"
