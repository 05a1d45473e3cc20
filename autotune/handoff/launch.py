"""A measured configuration as a trainer's own configuration: the one home of what autotune
hands to DeepSpeed, accelerate, the Hugging Face Trainer, torchrun and a hand-written FSDP2
loop.

Pure functions from a :class:`Launch` (the model, the configuration, the micro-batch size, the
accumulation and the GPUs) to text. The probes build their DeepSpeed engine from the same
:func:`deepspeed_config`, and the ``fsdp`` snippet applies FSDP2 as the probe's engine does,
so what is exported is what was measured. Nothing here imports torch, transformers or
DeepSpeed.
"""

from __future__ import annotations

import copy
import enum
import json
import pprint
import re
import shlex
from dataclasses import dataclass
from typing import Any

from autotune.config import (
    ADAMW_DEFAULTS,
    LORA_TARGETS,
    LOSS_CHUNK_TOKENS,
    OPTIMIZER_8BIT_BLOCK,
    SELECTIVE_SAVED_OPS,
    Attention,
    ConfigError,
    Engine,
    Loss,
    Offload,
    Optimizer,
    Precision,
    TrainConfig,
    lora_alpha,
)
from autotune.handoff.megatron import (
    SCRIPT_VARIABLE,
    megatron_arguments,
    megatron_environment,
    megatron_notes,
)
from autotune.handoff.torchtitan import CONFIG_FUNCTION, torchtitan_notes, torchtitan_settings
from autotune.layouts import data_parallel
from autotune.models import ModelSpec

__all__ = [
    "Format",
    "Launch",
    "checkpointing_field",
    "comment_lines",
    "deepspeed_config",
    "deepspeed_for",
    "hf_fields",
    "hf_offloads",
    "knob_notes",
    "lora_note",
    "one_line",
    "render",
    "thread_lines",
    "threads_per_rank",
    "torchrun_args",
    "value_notes",
]


class Format(enum.StrEnum):
    """What ``autotune export`` writes."""

    DEEPSPEED = "deepspeed"
    """A DeepSpeed config JSON (``ds_config.json``)."""
    ACCELERATE = "accelerate"
    """An ``accelerate launch --config_file`` YAML."""
    HF = "hf"
    """Keyword arguments of ``transformers.TrainingArguments``, as JSON."""
    TORCHRUN = "torchrun"
    """The ``torchrun`` line and its environment, as shell text."""
    FSDP = "fsdp"
    """A Python snippet that applies the FSDP2 settings to a Hugging Face causal LM."""
    COMMAND = "command"
    """The user's own training script, as a study of it ran it: a shell script that writes its
    configuration files and starts it (``autotune.handoff.script``)."""
    MEGATRON = "megatron"
    """Megatron-LM's arguments (layout, batch, recomputation, the model's shape) and the
    ``torchrun`` line that starts ``pretrain_gpt.py`` with them (``autotune.handoff.megatron``)."""
    TORCHTITAN = "torchtitan"
    """A Python module for ``torchtitan.train --module``: what autotune measured, set on
    torchtitan's preset for the model, and the ``torchrun`` line that starts it
    (``autotune.handoff.torchtitan``)."""


LAYOUT_FORMATS = frozenset({Format.MEGATRON, Format.TORCHTITAN})
"""The formats that write a tensor, pipeline or context parallel layout; the others write data
parallelism alone and refuse one."""


def deepspeed_config(
    config: TrainConfig,
    *,
    micro_batch_size: int,
    grad_accum: int,
    world_size: int,
    hidden_size: int,
    lr: float | None = None,
    cpu: bool = False,
) -> dict[str, Any]:
    """The DeepSpeed JSON for a configuration: what a probe starts its engine from, and what
    ``autotune export --format deepspeed`` writes (with ``cpu`` false).

    Bucket sizes follow the Hugging Face integration's ``auto`` values, which scale with the
    model's hidden size instead of DeepSpeed's fixed 500M-element defaults (a 1 GB bf16 buffer
    even for a small model).

    On the CPU, ``torch_adam`` keeps DeepSpeed from JIT-building its fused and CPU Adam ops
    (about a minute each); on GPUs DeepSpeed's own optimizers are used, as in training. The
    optimizer's hyperparameters are :data:`~autotune.config.ADAMW_DEFAULTS` (``lr``: a probe's
    own); no scheduler, and no ``gradient_clipping``, so DeepSpeed clips at its own default
    (norm 1.0, as the probes ran), which changes neither memory nor speed.
    """
    zero: dict[str, Any] = {"stage": config.zero_stage}
    if config.zero_stage >= 1:
        zero.update(
            overlap_comm=not cpu,
            contiguous_gradients=True,
            reduce_bucket_size=hidden_size * hidden_size,
            allgather_bucket_size=hidden_size * hidden_size,
        )
    if config.zero_stage == 3:
        zero.update(
            stage3_prefetch_bucket_size=int(0.9 * hidden_size * hidden_size),
            stage3_param_persistence_threshold=10 * hidden_size,
        )
    pin = not cpu
    if config.offload in (Offload.OPTIMIZER, Offload.PARAMS):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if config.offload is Offload.PARAMS:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    optimizer_params: dict[str, Any] = {
        **ADAMW_DEFAULTS,
        "betas": list(ADAMW_DEFAULTS["betas"]),
        **({} if lr is None else {"lr": lr}),
    }
    if cpu:
        optimizer_params["torch_adam"] = True
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch_size * grad_accum * world_size,
        "bf16": {"enabled": config.precision is Precision.BF16_MIXED},
        "fp16": {
            "enabled": config.precision is Precision.FP16_MIXED,
            "loss_scale": 0,  # dynamic
            "initial_scale_power": 16,
        },
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": optimizer_params},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


@dataclass(frozen=True, kw_only=True, slots=True)
class Launch:
    """One measured configuration, with everything a trainer's configuration needs."""

    model: str
    """The model's name (a preset, or the folder of its config.json)."""
    hidden_size: int
    """The model's hidden size (DeepSpeed's bucket sizes scale with it)."""
    config: TrainConfig
    micro_batch_size: int
    """Sequences per rank per micro-step."""
    grad_accum: int
    """Micro-steps per optimizer step."""
    world_size: int
    """Ranks (GPUs) in all."""
    nodes: int = 1
    seq_len: int
    transformers: str | None = None
    """The transformers version the configuration was measured with (the ``hf`` format's
    field names follow it); None: the newest names."""
    simulated: bool = False
    """Its figures come from a simulated GPU (the estimator), not a run: every format says so."""
    spec: ModelSpec | None = None
    """The model's shape, for the formats that write it (``megatron``); None where unknown."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "micro_batch_size", "grad_accum", "world_size", "nodes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be at least 1")
        if self.world_size % self.nodes:
            raise ConfigError(
                f"{self.world_size} GPUs do not split evenly over {self.nodes} nodes: use a "
                "multiple of the node count"
            )

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over all ranks (each data-parallel rank's micro-batches;
        the tensor, pipeline and context parallel ranks of a replica share theirs)."""
        return self.micro_batch_size * self.grad_accum * data_parallel(self.config, self.world_size)

    @property
    def per_node(self) -> int:
        """Ranks on each node."""
        return self.world_size // self.nodes

    def summary(self) -> str:
        """One line: ``llama-7b: fsdp z3 ac:every at micro-batch 4, accumulation 2 (global
        batch 64 of seq 2048 on 8 GPUs)``."""
        gpus = f"{self.world_size} GPU{'s' if self.world_size > 1 else ''}"
        if self.nodes > 1:
            gpus += f" on {self.nodes} nodes"
        return (
            f"{self.model}: {self.config.label()} at micro-batch {self.micro_batch_size}, "
            f"accumulation {self.grad_accum} (global batch {self.global_batch} of seq "
            f"{self.seq_len} on {gpus}){SIMULATED_NOTE if self.simulated else ''}"
        )


SIMULATED_NOTE = "; SIMULATED: predicted on a simulated GPU, never run"
"""What every export of a simulated study says, where its format allows words."""


def one_line(text: str) -> str:
    """``text`` fit for a comment line of any file autotune writes (shell, YAML, Python): each
    character that is not printable written as its escape in a Python string literal
    (``\\n`` for a newline, ``\\u2028`` for a Unicode line separator). Every character that
    ends a line in one of these formats is unprintable, so a comment that names a model's
    folder or a path ends on its own line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def comment_lines(lines: list[str]) -> list[str]:
    """Comment lines of shell or YAML, one each, whatever the text holds."""
    return [f"# {one_line(line)}" for line in lines]


CHUNKED_LOSS_CALL = 'autotune.probe.loss.apply_loss(model, "chunked")'
"""The code every export gives for the chunked loss: the probe's own way (the instance's
forward replaced before any wrapper), so DDP's all-reduce, FSDP2's gathers and DeepSpeed's
engine see the whole loss, as they did in the probe."""

_CHUNKED_LOSS = (
    f"before the trainer, DDP, fully_shard or deepspeed.initialize wraps the model, call "
    f"{CHUNKED_LOSS_CALL}; model(input_ids=..., labels=...).loss is then the chunked loss under "
    "any engine (Liger-Kernel's fused linear cross-entropy, TrainingArguments("
    "use_liger_kernel=True), is the GPU kernel of the same idea, not measured by this study)"
)


LIGER_FUSED_LOSS_ONLY = {
    "fused_linear_cross_entropy": True,
    "cross_entropy": False,
    "rope": False,
    "rms_norm": False,
    "swiglu": False,
}
"""Liger-Kernel's patches that give the fused loss and nothing else (autotune measured the
loss alone: the norms, rotary embeddings and MLP stay the model's own)."""
_FUSED_LOSS = (
    "liger_kernel.transformers._apply_liger_kernel_to_instance(model=model, "
    + ", ".join(f"{k}={v}" for k, v in LIGER_FUSED_LOSS_ONLY.items())
    + ")"
)


_EIGHT_BIT = (
    "torchao's 8-bit AdamW: optimizer = torchao.optim.AdamW8bit(model.parameters(), lr=..., "
    f"block_size={OPTIMIZER_8BIT_BLOCK}) in place of torch.optim.AdamW"
)


def lora_note(config: TrainConfig) -> str:
    """How to train what autotune measured under LoRA: the adapters and the frozen weights'
    dtype (peft)."""
    rank = config.lora_rank
    frozen = (
        "in fp32"
        if config.precision is Precision.FP32
        else f"in torch.{'float16' if config.precision is Precision.FP16_MIXED else 'bfloat16'}"
    )
    return (
        f"autotune measured LoRA at rank {rank}, the model's weights frozen {frozen} (load it "
        "so), then model = peft.get_peft_model(model, peft.LoraConfig(r="
        f'{rank}, lora_alpha={lora_alpha(rank)}, target_modules="{LORA_TARGETS}", '
        "lora_dropout=0.0)) before the trainer wraps it; this trains adapters, not the model"
    )


ACT_OFFLOAD_NOTE = (
    "after any checkpointing wraps the blocks and before the trainer or fully_shard wraps the "
    "model, call autotune.probe.offload.apply_activation_offload("
    "autotune.probe.modeling.decoder_blocks(model)): each block's saved tensors but its weights "
    "go to pinned host memory in the forward and come back in the backward (TRL's "
    "SFTConfig(activation_offloading=True) does likewise with hooks of its own)"
)
"""How to train with the activation offload autotune measured, in any trainer."""

COMPILE_NOTE = (
    "after any checkpointing wraps the blocks and before the trainer wraps the model, call "
    "block.compile() on each of autotune.probe.modeling.decoder_blocks(model), as autotune "
    "measured (TrainingArguments' torch_compile and accelerate's dynamo_backend compile the "
    "whole model instead)"
)
"""How to train with the compiled blocks autotune measured, in any trainer."""


def knob_notes(launch: Launch, fmt: Format | str) -> list[str]:
    """What ``fmt`` cannot carry of ``launch``'s configuration, each with what to do instead
    (empty when the format says it all). ``autotune export`` prints them beside the file, and
    the formats that take comments carry them too."""
    notes = []
    config = launch.config
    if config.ac_ops and Format(fmt) is not Format.FSDP:  # the FSDP2 snippet applies it
        whole = (
            f"; it checkpoints every {config.ac_every}-th block whole too, in place of the "
            "format's checkpointing"
            if config.ac_every
            else ""
        )
        notes.append(
            f"--format {Format(fmt).value} has no setting for the op-level selective "
            "checkpointing autotune measured (each block keeps its matmul and attention "
            "outputs and recomputes the rest): before the model is wrapped, call "
            "autotune.probe.modeling.apply_activation_checkpointing(model, "
            f"{config.ac_every}, ops=True){whole}"
        )
    if config.attention is not Attention.SDPA:  # the model's loading, in every trainer
        notes.append(
            f"--format {Format(fmt).value} has no setting for the attention kernel: load the "
            f'model with attn_implementation="{config.attention.value}" (from_pretrained or '
            "from_config), as autotune measured it"
        )
    if launch.config.loss is Loss.CHUNKED:
        notes.append(
            f"--format {Format(fmt).value} has no setting for the chunked loss autotune "
            f"measured ({LOSS_CHUNK_TOKENS} tokens a chunk): {_CHUNKED_LOSS}"
        )
    if config.optimizer is Optimizer.ADAMW_8BIT and Format(fmt) not in (Format.HF, Format.FSDP):
        notes.append(
            f"--format {Format(fmt).value} has no setting for the optimizer: autotune measured "
            f'{_EIGHT_BIT} (a Trainer: optim="adamw_torch_8bit")'
        )
    if config.is_lora:  # no trainer format carries the model's adapters
        notes.append(f"--format {Format(fmt).value} has no setting for LoRA: {lora_note(config)}")
    if config.torch_compile:  # the formats' compile options compile the whole model
        notes.append(
            f"--format {Format(fmt).value} has no setting for compiling each decoder block: "
            f"{COMPILE_NOTE}"
        )
    if config.act_offload and not (Format(fmt) is Format.HF and hf_offloads(launch)):
        notes.append(
            f"--format {Format(fmt).value} has no setting for the activation offload autotune "
            f"measured: {ACT_OFFLOAD_NOTE}"
        )
    if launch.config.loss is Loss.FUSED and Format(fmt) is not Format.HF:
        notes.append(
            f"--format {Format(fmt).value} has no setting for Liger-Kernel's fused linear "
            f"cross-entropy: before the model is wrapped, {_FUSED_LOSS} (what the Trainer does "
            "with --format hf's liger_kernel_config)"
        )
    return notes


def _adamw_defaults(*, lr: bool = True) -> str:
    d = ADAMW_DEFAULTS
    return (
        f"lr {d['lr']}, " if lr else ""
    ) + f"betas {d['betas'][0]}/{d['betas'][1]}, eps {d['eps']}, weight decay {d['weight_decay']}"


def value_notes(launch: Launch, fmt: Format | str) -> list[str]:
    """The values ``fmt``'s text holds that neither the user chose nor a probe measured (the
    optimizer's hyperparameters, where the format must hold some), each with where to set the
    user's own. ``autotune export`` prints them beside the file."""
    chosen = Format(fmt)
    if chosen is Format.DEEPSPEED and launch.config.engine is Engine.DEEPSPEED:
        return [
            "the optimizer block holds the Hugging Face Trainer's AdamW defaults "
            f"({_adamw_defaults()}), which change neither memory nor speed: set your own there, "
            "add a scheduler if you train with one, and gradient_clipping: without it "
            "DeepSpeed clips gradients at norm 1.0, its default (as the probes ran; 0: no "
            "clipping); the Trainer, given this file, fills them from its own arguments"
        ]
    if chosen is Format.FSDP and launch.config.engine is Engine.FSDP:
        return [
            "build_optimizer's betas, eps and weight decay default to the Hugging Face "
            f"Trainer's ({_adamw_defaults(lr=False)}): pass your own, with your lr"
        ]
    return []


def render(launch: Launch, fmt: Format | str) -> str:
    """The text of ``launch`` in format ``fmt`` (ends with a newline).

    Raises:
        ConfigError: For an unknown format, or one that cannot express the configuration
            (``deepspeed`` for an FSDP configuration, say).
    """
    try:
        chosen = Format(fmt)
    except ValueError:
        choices = ", ".join(f.value for f in Format)
        raise ConfigError(f"unknown export format {fmt!r}: use one of {choices}") from None
    if chosen is Format.COMMAND:
        raise ConfigError(
            "--format command is the command of your own script, and this study probed "
            "autotune's stand-in: tune it with autotune run --script, or use --format torchrun"
        )
    if launch.config.is_layout and chosen not in LAYOUT_FORMATS:
        layout_formats = ", ".join(sorted(f.value for f in LAYOUT_FORMATS))
        raise ConfigError(
            f"{launch.config.label()}: --format {chosen.value} writes data parallelism alone, "
            f"not a tensor, pipeline or context parallel layout: use --format {layout_formats}"
        )
    return _RENDERERS[chosen](launch)


def _needs(launch: Launch, engine: Engine, fmt: Format) -> None:
    if launch.config.engine is not engine:
        others = [
            f.value
            for f in Format
            if f is not fmt
            and not (f is Format.DEEPSPEED and launch.config.engine is not Engine.DEEPSPEED)
            and not (f is Format.FSDP and launch.config.engine is not Engine.FSDP)
            and f not in (Format.COMMAND, Format.MEGATRON, Format.TORCHTITAN)
        ]
        raise ConfigError(
            f"--format {fmt.value} needs a {engine.value} configuration, and this one is "
            f"{launch.config.label()}: use --format {', '.join(others[:-1])} or {others[-1]}, "
            f"or --engine {engine.value} for the best {engine.value} configuration"
        )


def _json(data: Any) -> str:
    return json.dumps(data, indent=2) + "\n"


def _deepspeed_json(launch: Launch) -> str:
    _needs(launch, Engine.DEEPSPEED, Format.DEEPSPEED)
    data = deepspeed_for(launch)
    if launch.simulated:  # DeepSpeed reads the keys it knows and passes others by
        data = {"autotune": f"{launch.summary()}", **data}
    return _json(data)


def deepspeed_for(launch: Launch, *, cpu: bool = False) -> dict[str, Any]:
    """:func:`deepspeed_config` of a launch (``cpu``: as the CPU probes run it)."""
    return deepspeed_config(
        launch.config,
        micro_batch_size=launch.micro_batch_size,
        grad_accum=launch.grad_accum,
        world_size=launch.world_size,
        hidden_size=launch.hidden_size,
        cpu=cpu,
    )


def _loss_note(loss: Loss) -> str:
    if loss is Loss.FULL:
        return "the model's own (the whole micro-batch's logits at once)"
    if loss is Loss.FUSED:
        return "Liger-Kernel's fused linear cross-entropy (gradients in the forward)"
    return f"chunked cross-entropy, {LOSS_CHUNK_TOKENS} tokens a chunk, recomputed in the backward"


def _optimizer_note(config: TrainConfig) -> str:
    if config.optimizer is Optimizer.ADAMW_8BIT:
        return "torchao's AdamW8bit (8-bit moments, a scale per 256 values)"
    if config.engine is Engine.DEEPSPEED:
        # The DeepSpeed JSON's optimizer block: DeepSpeed builds its own AdamW from it.
        if config.offload is not Offload.NONE:
            return "DeepSpeed's CPU AdamW (DeepSpeedCPUAdam, on the offloaded states)"
        return "DeepSpeed's fused AdamW (FusedAdam)"
    return "torch's fused AdamW"


def _checkpointing_note(ac_every: int, ac_ops: bool = False) -> str:
    ops = "op-level selective (matmul and attention outputs kept, the rest recomputed)"
    if ac_every == 0:
        return f"{ops} in every decoder block" if ac_ops else "none"
    if ac_every == 1:
        return "every decoder block (non-reentrant)"
    whole = (
        f"decoder blocks 0, {ac_every}, {2 * ac_every}, ... (every {ac_every}-th, non-reentrant)"
    )
    return f"{whole}, {ops} in the others" if ac_ops else whole


# ---- accelerate ------------------------------------------------------------------------------

_MIXED_PRECISION = {
    Precision.BF16_MIXED: "bf16",
    Precision.FP16_MIXED: "fp16",
    Precision.BF16: "no",
    Precision.FP32: "no",
}


def _yaml(data: dict[str, Any]) -> str:
    """``data`` as a YAML document, written by PyYAML's serializer (``"no"`` stays a string)."""
    import yaml  # only this format needs it

    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True)


ACCELERATE_DEEPSPEED_FILE_NOTE = (
    "these keys give accelerate's default bucket sizes and the script's optimizer; for the "
    "measured buckets and DeepSpeed's AdamW: autotune export --format deepspeed -o "
    "ds_config.json, then here replace deepspeed_config's keys but zero3_init_flag with "
    "deepspeed_config_file: ds_config.json and delete mixed_precision (the JSON holds both), "
    "and in the script build the optimizer as accelerate.utils.DummyOptim(model.parameters()) "
    "(the JSON's optimizer block holds its values)"
)
"""How an accelerate YAML of a DeepSpeed configuration gets the measured DeepSpeed JSON: the
steps accelerate itself requires (it refuses a config file beside the keys it replaces, the
top-level mixed precision among them, and an optimizer given in both the file and the script)."""


def _accelerate(launch: Launch) -> str:
    config = launch.config
    notes = [f"autotune: {launch.summary()}"]
    data: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": {
            Engine.SINGLE: "NO",
            Engine.DDP: "MULTI_GPU",
            Engine.FSDP: "FSDP",
            Engine.DEEPSPEED: "DEEPSPEED",
        }[config.engine],
        "mixed_precision": _MIXED_PRECISION[config.precision],
        "num_machines": launch.nodes,
        "num_processes": launch.world_size,
        "machine_rank": 0,
        "main_training_function": "main",
        "use_cpu": False,
    }
    if config.precision is Precision.BF16:
        notes.append("pure bf16: cast the model to torch.bfloat16 before accelerator.prepare")
    if config.engine is Engine.DEEPSPEED:
        stage3 = config.zero_stage == 3
        data["deepspeed_config"] = {
            "gradient_accumulation_steps": launch.grad_accum,
            "zero_stage": config.zero_stage,
            "offload_optimizer_device": "cpu" if config.offload is not Offload.NONE else "none",
            "offload_param_device": "cpu" if config.offload is Offload.PARAMS else "none",
            "zero3_init_flag": stage3,
        }
        notes.append(ACCELERATE_DEEPSPEED_FILE_NOTE)
    elif config.engine is Engine.FSDP:
        fsdp: dict[str, Any] = {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_reshard_after_forward": config.zero_stage == 3,
            "fsdp_offload_params": config.offload is Offload.PARAMS,
            "fsdp_activation_checkpointing": config.ac_every == 1,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": True,
        }
        data["fsdp_config"] = fsdp
        if config.precision is Precision.BF16_MIXED:
            notes.append("autotune measured gradients reduced in fp32 (see --format fsdp)")
    if config.engine is not Engine.DEEPSPEED:
        notes.append(
            f"in the script: Accelerator(gradient_accumulation_steps={launch.grad_accum}), "
            f"batch size {launch.micro_batch_size} per process"
        )
    if config.ac_every and not (config.engine is Engine.FSDP and config.ac_every == 1):
        every = f"every_n_layers={config.ac_every}, " if config.ac_every > 1 else ""
        notes.append(
            f"activation checkpointing of {_checkpointing_note(config.ac_every)}: "
            f"model.gradient_checkpointing_enable({every}"
            'gradient_checkpointing_kwargs={"use_reentrant": False})'
        )
    if launch.nodes > 1:
        notes.append("set machine_rank, main_process_ip and main_process_port on each node")
    notes += knob_notes(launch, Format.ACCELERATE)
    return "\n".join(comment_lines(notes)) + "\n" + _yaml(data)


# ---- Hugging Face TrainingArguments -------------------------------------------------------


def _version(text: str | None) -> tuple[int, ...]:
    if text is None:
        return (10**6,)
    return tuple(int(part) for part in re.findall(r"\d+", text)[:2])


_ACTIVATION_CHECKPOINTING_NAMES = (5, 23)
"""The transformers release whose TrainingArguments call it ``activation_checkpointing``
(``gradient_checkpointing`` before, a deprecated alias since)."""


def checkpointing_field(transformers: str | None) -> str:
    """The ``TrainingArguments`` field that turns on activation checkpointing in a
    transformers version (None: the newest)."""
    new = _version(transformers) >= _ACTIVATION_CHECKPOINTING_NAMES
    return "activation_checkpointing" if new else "gradient_checkpointing"


def hf_offloads(launch: Launch) -> bool:
    """Whether the ``hf`` fields carry the configuration's activation offload: with every
    decoder block checkpointed through the model (not FSDP's wrapper), a block saves only its
    input, which is all autotune's offload moves then, and transformers 5.23's
    ``activation_checkpointing_kwargs={"offload": True}`` keeps it in pinned host memory."""
    config = launch.config
    return (
        config.act_offload
        and config.ac_every == 1
        and not config.ac_ops
        and config.engine is not Engine.FSDP
        and checkpointing_field(launch.transformers) == "activation_checkpointing"
    )


HF_OPTIMIZERS = {Optimizer.ADAMW: "adamw_torch_fused", Optimizer.ADAMW_8BIT: "adamw_torch_8bit"}
"""``TrainingArguments.optim`` of each optimizer (``adamw_torch_8bit`` is torchao's
AdamW8bit, block 256). Fused AdamW is the Trainer's default (torch 2.8 and later), so the
export leaves ``optim`` out for it: a study of a user's Trainer script keeps the script's."""


def hf_fields(launch: Launch, *, cpu: bool = False) -> dict[str, Any]:
    """The keyword arguments of ``transformers.TrainingArguments`` for ``launch`` (``cpu``:
    as a CPU probe runs it, DeepSpeed with torch's AdamW)."""
    config = launch.config
    fields: dict[str, Any] = {
        "per_device_train_batch_size": launch.micro_batch_size,
        "gradient_accumulation_steps": launch.grad_accum,
        "bf16": config.precision in (Precision.BF16_MIXED, Precision.BF16),
        "fp16": config.precision is Precision.FP16_MIXED,
    }
    if config.optimizer is not Optimizer.ADAMW:  # fused AdamW: the Trainer's default
        fields["optim"] = HF_OPTIMIZERS[config.optimizer]
    if config.loss is Loss.FUSED:  # the Trainer applies Liger's patches it is given
        fields["use_liger_kernel"] = True
        fields["liger_kernel_config"] = dict(LIGER_FUSED_LOSS_ONLY)
    # FSDP checkpoints every block through its own wrapper (as the probe does); any other
    # pattern through the model's checkpointing.
    fsdp_checkpointing = config.engine is Engine.FSDP and config.ac_every == 1
    if config.ac_every and not fsdp_checkpointing:
        name = checkpointing_field(launch.transformers)
        kwargs: dict[str, Any] = {"use_reentrant": False}
        if config.ac_every > 1:
            kwargs["every_n_layers"] = config.ac_every
        if hf_offloads(launch):
            kwargs["offload"] = True
        fields[name] = True
        fields[f"{name}_kwargs"] = kwargs
    if config.engine is Engine.DEEPSPEED:
        ds = copy.deepcopy(deepspeed_for(launch, cpu=cpu))
        # The Trainer fills "auto" from its own arguments (learning_rate, adam_beta*,
        # adam_epsilon, weight_decay), where a fixed value would have to match them.
        params = ds["optimizer"]["params"]
        auto = dict.fromkeys(ADAMW_DEFAULTS, "auto")
        ds["optimizer"]["params"] = {**auto, **{k: v for k, v in params.items() if k not in auto}}
        fields["deepspeed"] = ds
    elif config.engine is Engine.FSDP:
        fields["fsdp"] = True
        fields["fsdp_config"] = {
            "version": 2,
            "reshard_after_forward": config.zero_stage == 3,
            "cpu_offload": config.offload is Offload.PARAMS,
            "activation_checkpointing": fsdp_checkpointing,
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "state_dict_type": "SHARDED_STATE_DICT",
        }
    return fields


def _hf(launch: Launch) -> str:
    fields = hf_fields(launch)
    if launch.simulated:  # JSON has no comments: the run's name carries the word
        fields["run_name"] = f"autotune {launch.summary()}"
    return _json(fields)


# ---- threads ----------------------------------------------------------------------------------


def threads_per_rank(cores: int, ranks: int) -> int:
    """OpenMP threads of each rank (``OMP_NUM_THREADS``, unless the user set it): the node's
    cores over its ranks, at least one. The probes' ranks get it and every shell export
    writes the same rule, evaluated on the node that runs it (:func:`thread_lines`), so a
    run's CPU work (a data loader's, DeepSpeed's CPU Adam under offload, a CPU rank's
    compute) runs as it was probed: ``torchrun`` alone would give 1 thread, ``accelerate
    launch`` 1 unless told, a rank started bare every core."""
    return max(1, cores // max(1, ranks))


def thread_lines(ranks_per_node: int) -> list[str]:
    """Shell lines that export :func:`threads_per_rank` of the node they run on (``nproc``:
    the cores this process may use), a value the user exported kept."""
    return [
        f'threads=$(( $(nproc) / {int(ranks_per_node)} )); [ "$threads" -ge 1 ] || threads=1',
        'export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$threads}"',
    ]


# ---- torchrun ---------------------------------------------------------------------------------


def torchrun_args(launch: Launch, script: str = "train.py") -> list[str]:
    """The ``torchrun`` command line (``torchrun`` first) that starts every rank of a node."""
    args = ["torchrun", f"--nnodes={launch.nodes}", f"--nproc-per-node={launch.per_node}"]
    if launch.nodes > 1:
        args += [
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=$MASTER_ADDR:29500",
            "--rdzv-id=autotune",
        ]
    return [*args, script]


def _torchrun(launch: Launch) -> str:
    config = launch.config
    line = " ".join(
        arg if arg.startswith("--rdzv-endpoint=$") else shlex.quote(arg)
        for arg in torchrun_args(launch)
    )
    settings = {
        "engine": config.engine.value,
        "zero stage": str(config.zero_stage),
        "precision": config.precision.value,
        "offload": config.offload.value,
        "activation checkpointing": _checkpointing_note(config.ac_every, config.ac_ops),
        "attention": config.attention.value,
        "loss": _loss_note(config.loss),
        "optimizer": _optimizer_note(config),
        "training": (
            f"LoRA, rank {config.lora_rank} (the rest frozen)"
            if config.is_lora
            else "full fine-tuning"
        ),
        "compiled": "each decoder block" if config.torch_compile else "no",
        "activation offload": (
            "saved tensors in pinned host memory" if config.act_offload else "none"
        ),
        "micro-batch per rank": str(launch.micro_batch_size),
        "accumulation steps": str(launch.grad_accum),
    }
    engine_format = {Engine.DEEPSPEED: "deepspeed", Engine.FSDP: "fsdp"}.get(config.engine)
    notes = [
        f"autotune: {launch.summary()}",
        *(f"  {key}: {value}" for key, value in settings.items()),
    ]
    if engine_format:
        notes.append(f"the engine's settings: autotune export --format {engine_format}")
    notes += knob_notes(launch, Format.TORCHRUN)
    if launch.nodes > 1:
        notes.append("run on every node, with MASTER_ADDR the first node's address")
    lines = [
        *comment_lines(notes),
        f"export NNODES={launch.nodes}",
        f"export NPROC_PER_NODE={launch.per_node}",
        *thread_lines(launch.per_node),
        line,
    ]
    return "\n".join(lines) + "\n"


# ---- FSDP2 snippet ----------------------------------------------------------------------------

_FSDP_SNIPPET = '''"""FSDP2 as autotune measured it (MEASURED says what it measured).

On every rank, after torch.distributed.init_process_group:
    model = apply_fsdp(model)
    optimizer = build_optimizer(model, lr)
then train with {micro_batch} sequences per rank per micro-step and {grad_accum} micro-steps per
optimizer step (model.set_requires_gradient_sync(False) on all micro-steps but the last).{notes}
"""

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

MEASURED = {measured}
MICRO_BATCH_SIZE = {micro_batch}
GRAD_ACCUM = {grad_accum}
CHECKPOINT_EVERY = {ac_every}  # checkpoint decoder blocks 0, k, 2k, ...; 0: none
CHECKPOINT_OPS = {ac_ops}  # the other blocks: keep matmul and attention outputs, recompute the rest
SAVED_OPS = {saved_ops}
RESHARD_AFTER_FORWARD = {reshard}  # ZeRO stage {stage}
PURE_BF16 = {pure_bf16}  # the weights themselves in bf16 (else fp32 master weights)
OPTIMIZER = "{optimizer}"  # "adamw": torch's fused AdamW; "adamw-8bit": torchao's AdamW8bit
# build_optimizer's defaults: the Hugging Face Trainer's (they change neither memory nor speed):
# pass your own.
BETAS = {betas}
EPS = {eps}
WEIGHT_DECAY = {weight_decay}


def decoder_blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder blocks of a Hugging Face causal LM (llama, mistral, qwen2, gpt2, ...)."""
    for path in ("model.layers", "transformer.h", "model.decoder.layers", "gpt_neox.layers"):
        module = model
        for part in path.split("."):
            module = getattr(module, part, None)
            if module is None:
                break
        if isinstance(module, torch.nn.ModuleList):
            return module
    raise ValueError(f"cannot find the decoder blocks of {{type(model).__name__}}")


def _selective_policy(ctx, op, *args, **kwargs):
    name = getattr(op, "__name__", "").split(".")[0]
    if name in SAVED_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_selective_policy)


def apply_fsdp(model: torch.nn.Module) -> torch.nn.Module:
    """Checkpoint, then shard each decoder block and the root with fully_shard."""
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False  # as measured: no key-value cache kept while training
    blocks = decoder_blocks(model)
    for index, block in enumerate(blocks):
        if CHECKPOINT_EVERY and index % CHECKPOINT_EVERY == 0:
            blocks[index] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        elif CHECKPOINT_OPS:
            blocks[index] = checkpoint_wrapper(
                block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, context_fn=_selective_context
            )
    if PURE_BF16:
        model.to(torch.bfloat16)
    mp_policy = MixedPrecisionPolicy({mp_args})
    offload = {offload}
    for block in blocks:
        fully_shard(
            block,
            mp_policy=mp_policy,
            offload_policy=offload,
            reshard_after_forward=RESHARD_AFTER_FORWARD,
        )
    # The root's parameters (embeddings, final norm, head) are needed right at the backward's
    # start: never re-sharded after the forward.
    fully_shard(model, mp_policy=mp_policy, offload_policy=offload, reshard_after_forward=False)
    return model


def build_optimizer(
    model: torch.nn.Module,
    lr: float,
    *,
    betas: tuple[float, float] = BETAS,
    eps: float = EPS,
    weight_decay: float = WEIGHT_DECAY,
) -> torch.optim.Optimizer:
    """The optimizer autotune measured, over the sharded parameters."""
    values = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if OPTIMIZER == "adamw-8bit":
        from torchao.optim import AdamW8bit

        return AdamW8bit(model.parameters(), block_size={block}, **values)
    return torch.optim.AdamW(model.parameters(), fused=True, **values)
'''


def _fsdp(launch: Launch) -> str:
    _needs(launch, Engine.FSDP, Format.FSDP)
    config = launch.config
    mixed = config.precision is Precision.BF16_MIXED
    return _FSDP_SNIPPET.format(
        # The model's name is outside text: a Python literal, never in the docstring.
        measured=repr(launch.summary()),
        notes="".join(f"\n\nNote: {note}" for note in knob_notes(launch, Format.FSDP)),
        micro_batch=launch.micro_batch_size,
        grad_accum=launch.grad_accum,
        ac_every=config.ac_every,
        ac_ops=config.ac_ops,
        saved_ops="{" + ", ".join(repr(op) for op in SELECTIVE_SAVED_OPS) + "}",
        reshard=config.zero_stage == 3,
        stage=config.zero_stage,
        pure_bf16=config.precision is Precision.BF16,
        optimizer=config.optimizer.value,
        block=OPTIMIZER_8BIT_BLOCK,
        betas=repr(tuple(ADAMW_DEFAULTS["betas"])),
        eps=repr(ADAMW_DEFAULTS["eps"]),
        weight_decay=repr(ADAMW_DEFAULTS["weight_decay"]),
        # Gradients reduced in fp32, as the probe does.
        mp_args="param_dtype=torch.bfloat16, reduce_dtype=torch.float32" if mixed else "",
        offload=(
            # Pinned host memory needs an accelerator.
            "CPUOffloadPolicy(pin_memory=torch.cuda.is_available())"
            if config.offload is Offload.PARAMS
            else "OffloadPolicy()"
        ),
    )


# ---- Megatron-LM ------------------------------------------------------------------------------


def _megatron(launch: Launch) -> str:
    """The shell script of ``autotune export --format megatron`` (POSIX ``sh``): the
    ``torchrun`` line of a node that starts ``$PRETRAIN_GPT`` (``pretrain_gpt.py`` unless set)
    with Megatron-LM's arguments, an option a line, each word quoted by the shell's rule, then
    the script's own arguments."""
    options: list[str] = []
    for arg in megatron_arguments(launch):
        if arg.startswith("--") or not options:
            options.append(shlex.quote(arg))
        else:
            options[-1] += " " + shlex.quote(arg)
    runner = " ".join(
        arg if arg.startswith("--rdzv-endpoint=$") else shlex.quote(arg)
        for arg in torchrun_args(launch)[:-1]
    )
    notes = [f"autotune: {launch.summary()}", *megatron_notes(launch)]
    if launch.nodes > 1:
        notes.append("run on every node, with MASTER_ADDR the first node's address")
    environment = [
        f"unset {name}" if value is None else f"export {name}={shlex.quote(value)}"
        for name, value in megatron_environment(launch).items()
    ]
    lines = [
        *comment_lines(notes),
        f"export NNODES={launch.nodes}",
        f"export NPROC_PER_NODE={launch.per_node}",
        *thread_lines(launch.per_node),
        *environment,
        f'{runner} "${{{SCRIPT_VARIABLE}:-pretrain_gpt.py}}" \\',
        *(f"    {option} \\" for option in options),
        '    "$@"',
    ]
    return "\n".join(lines) + "\n"


# ---- torchtitan ------------------------------------------------------------------------------

_TORCHTITAN_MODULE = '''"""A run autotune measured, for torchtitan.train --module.

Start it on every node of the run (the file's name, less .py, must be a Python name):

    python3 THIS_FILE [torchtitan's own options, e.g. --training.steps 1000]

which runs torchrun -m torchtitan.train --module THIS_MODULE --config {function} [options]
with this file's folder on PYTHONPATH. In your own config_registry, apply(config) sets what
autotune measured on any Trainer.Config. What it measured, and what to add, is below.
"""

{comments}

from __future__ import annotations

import os
import sys

SUMMARY = {summary}
FLAVOR = {flavor}  # torchtitan.models.llama3.model_registry's name of the model's shape
TRAINING = {training}
PARALLELISM = {parallelism}
FULL_CHECKPOINTING = {full}  # every decoder block checkpointed whole (FullAC); False: none
COMPILE_BLOCKS = {compile_blocks}  # each decoder block compiled
NNODES = {nodes}
NPROC_PER_NODE = {per_node}


def apply(config):
    """Set on a torchtitan Trainer.Config what autotune measured: the model, the layout, the
    batch, the precision, checkpointing, compile and the loss (fp32 log-probabilities)."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.llama3 import model_registry

    config.model_spec = model_registry(FLAVOR)
    config.loss = CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(config.model_spec))
    for name, value in TRAINING.items():
        setattr(config.training, name, value)
    for name, value in PARALLELISM.items():
        setattr(config.parallelism, name, value)
    config.activation_checkpoint = FullAC.Config() if FULL_CHECKPOINTING else None
    config.compile = CompileConfig(enable=COMPILE_BLOCKS, components=["model"])
    return config


def {function}():
    """torchtitan's {preset} preset with what autotune measured (torchtitan's --config)."""
    from torchtitan.models.llama3.config_registry import {preset}

    return apply({preset}())


def main(argv):
    """torchrun over this node's ranks, each running torchtitan.train on this module."""
    here = os.path.dirname(os.path.abspath(__file__))
    module = os.path.splitext(os.path.basename(__file__))[0]
    if not module.isidentifier():
        sys.exit(f"{{module}} is no Python module name: rename the file (letters, digits, _)")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    threads = max(1, len(os.sched_getaffinity(0)) // NPROC_PER_NODE)
    env.setdefault("OMP_NUM_THREADS", str(threads))
    torchrun = ["torchrun", f"--nnodes={{NNODES}}", f"--nproc-per-node={{NPROC_PER_NODE}}"]
    if NNODES > 1:
        address = env.get("MASTER_ADDR")
        if not address:
            sys.exit("set MASTER_ADDR to the first node's address, on every node")
        torchrun += ["--rdzv-backend=c10d", f"--rdzv-endpoint={{address}}:29500",
                     "--rdzv-id=autotune"]
    command = [*torchrun, "-m", "torchtitan.train", "--module", module,
               "--config", {function_literal}, *argv]
    os.execvpe(command[0], command, env)


if __name__ == "__main__":
    main(sys.argv[1:])
'''


def _torchtitan(launch: Launch) -> str:
    """The Python module of ``autotune export --format torchtitan``: every value written by
    Python's own ``repr`` (``pprint``'s, for the dictionaries: a literal of its type), every
    note a comment line."""
    settings = torchtitan_settings(launch)
    notes = [f"autotune: {launch.summary()}", *torchtitan_notes(launch)]
    if launch.nodes > 1:
        notes.append("run on every node, with MASTER_ADDR the first node's address")
    return _TORCHTITAN_MODULE.format(
        function=CONFIG_FUNCTION,
        function_literal=repr(CONFIG_FUNCTION),
        comments="\n".join(comment_lines(notes)),
        summary=repr(launch.summary()),
        flavor=repr(settings.flavor),
        preset=settings.preset,
        training=pprint.pformat(settings.training, width=96, sort_dicts=False),
        parallelism=pprint.pformat(settings.parallelism, width=96, sort_dicts=False),
        full=repr(settings.full_checkpointing),
        compile_blocks=repr(settings.compile_blocks),
        nodes=repr(launch.nodes),
        per_node=repr(launch.per_node),
    )


_RENDERERS = {
    Format.DEEPSPEED: _deepspeed_json,
    Format.ACCELERATE: _accelerate,
    Format.HF: _hf,
    Format.TORCHRUN: _torchrun,
    Format.FSDP: _fsdp,
    Format.MEGATRON: _megatron,
    Format.TORCHTITAN: _torchtitan,
}
