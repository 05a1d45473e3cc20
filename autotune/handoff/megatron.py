"""A measured configuration as Megatron-LM's arguments: ``autotune export --format megatron``.

Megatron-LM (``pretrain_gpt.py``) takes its layout as command-line arguments, most of them the
fields of megatron-core's ``TransformerConfig`` written ``--field-name`` (Megatron-LM builds
those options from the dataclass): ``--tensor-model-parallel-size``, ``--sequence-parallel``,
``--pipeline-model-parallel-size``, ``--num-layers-per-virtual-pipeline-stage``,
``--context-parallel-size``, ``--recompute-granularity``/``--recompute-method``/
``--recompute-num-layers``, the micro and global batch, ``--bf16``, and the model's shape.
The export is a shell script that starts ``pretrain_gpt.py`` under ``torchrun`` with them,
and the user's own arguments (tokenizer, data, schedule) after.

What Megatron-LM cannot run as measured is refused with one line, never written approximately:
DeepSpeed (another project's engine), offload (Megatron's ``--optimizer-cpu-offload`` is
another optimizer), GPipe (Megatron's pipelines run 1F1B and interleaved 1F1B), FSDP2 under a
pipeline or with ZeRO-2 or tied embeddings (Megatron-LM's ``--use-torch-fsdp2`` refuses a
pipeline and tied embeddings and always reshards), pure bf16 weights, layers that do not split
evenly over the stages (Megatron-LM asserts it), models other than the llama-style ones
(rotary positions, RMSNorm, SwiGLU), and the knobs that are a change of the Hugging Face
model's code (op-level checkpointing, another attention kernel, the chunked or fused loss,
8-bit AdamW, LoRA, compiled blocks, activation offload).

What the probe measured and Megatron-LM runs differently is said in the file: autotune
measured torch's tensor-parallel linears (which keep a projection's all-gathered input for the
backward; Megatron's gather it again) and torch's pipelining schedules over the Hugging Face
model, so Megatron's peak is the measured one or lower, and its kernels run at their own
speed. Pure functions, no torch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from autotune.config import (
    ConfigError,
    Engine,
    Offload,
    Precision,
    Schedule,
)

if TYPE_CHECKING:
    from autotune.handoff.launch import Launch

__all__ = [
    "CONNECTIONS",
    "FAMILIES",
    "SCRIPT_VARIABLE",
    "megatron_arguments",
    "megatron_environment",
    "megatron_notes",
]

FAMILIES = ("llama", "mistral", "qwen2")
"""The ``model_type`` values whose architecture Megatron-LM's GPT model builds with rotary
positions, RMSNorm and SwiGLU (the rest of a model's arguments are the user's)."""

SCRIPT_VARIABLE = "PRETRAIN_GPT"
"""The variable that names Megatron-LM's training script (``pretrain_gpt.py`` by default)."""


def _refuse(launch: Launch, why: str, instead: str) -> ConfigError:
    return ConfigError(f"--format megatron: {launch.config.label()}: {why}: {instead}")


def _check(launch: Launch) -> None:
    """Refuse, with one line, what Megatron-LM cannot run as it was measured."""
    config, spec = launch.config, launch.spec
    if spec is None:
        raise _refuse(launch, "the model's shape is unknown", "export from a study of the model")
    if spec.model_type not in FAMILIES:
        raise _refuse(
            launch,
            f"{launch.model} is a {spec.model_type} model, and the export writes llama-style "
            f"ones ({', '.join(FAMILIES)})",
            "use --format torchrun",
        )
    knob = next((name for _, name in config.model_code_knobs()), None)
    if knob is not None:
        raise _refuse(
            launch,
            f"Megatron-LM's model has no setting for {knob}, which autotune measured",
            "export a configuration without it (autotune trials lists them)",
        )
    if config.engine is Engine.DEEPSPEED:
        raise _refuse(launch, "Megatron-LM trains without DeepSpeed", "use --format deepspeed")
    if config.offload is not Offload.NONE:
        raise _refuse(
            launch,
            "Megatron-LM has no ZeRO offload (its --optimizer-cpu-offload is another optimizer)",
            "use --format fsdp or deepspeed",
        )
    if config.precision is Precision.BF16:
        raise _refuse(
            launch,
            "Megatron-LM's --bf16 keeps fp32 main weights, and this configuration measured bf16 "
            "weights alone",
            "export a bf16-mixed configuration",
        )
    if config.engine is Engine.FSDP:
        why = (
            "Megatron-LM's FSDP2 (--use-torch-fsdp2) runs no pipeline"
            if config.pp > 1
            else "Megatron-LM's FSDP2 always reshards after the forward (ZeRO-3)"
            if config.zero_stage != 3
            else "Megatron-LM's FSDP2 needs untied embeddings"
            if spec.tie_word_embeddings
            else None
        )
        if why:
            raise _refuse(launch, why, "export a DDP configuration, or use --format fsdp")
    if config.pp_schedule is Schedule.GPIPE and config.pp > 1:
        raise _refuse(
            launch,
            "Megatron-LM's pipelines run 1F1B or interleaved 1F1B, not GPipe",
            "export a 1F1B configuration",
        )
    chunks = config.pp * config.pp_virtual
    if spec.num_layers % chunks:
        raise _refuse(
            launch,
            f"Megatron-LM splits the {spec.num_layers} layers evenly, and they do not split "
            f"into {chunks} pipeline chunks",
            "export a layout whose stages divide the layers",
        )


def _recompute(launch: Launch) -> list[str]:
    """Whole-block checkpointing as Megatron-LM's recompute options: every block, or (every
    k-th block measured) the same number of blocks in each pipeline chunk, its first ones."""
    every = launch.config.ac_every
    if not every:
        return []
    if every == 1:
        return ["--recompute-granularity", "full", "--recompute-method", "uniform",
                "--recompute-num-layers", "1"]  # fmt: skip
    assert launch.spec is not None
    chunk = launch.spec.num_layers // (launch.config.pp * launch.config.pp_virtual)
    return ["--recompute-granularity", "full", "--recompute-method", "block",
            "--recompute-num-layers", str(math.ceil(chunk / every))]  # fmt: skip


def megatron_arguments(launch: Launch) -> list[str]:
    """Megatron-LM's arguments for ``launch``: the model's shape, the layout, the batch, the
    precision and the recomputation (each option one item, each value the next).

    Raises:
        ConfigError: Where Megatron-LM cannot run the configuration as measured (one line,
            with what to export instead).
    """
    _check(launch)
    config, spec = launch.config, launch.spec
    assert spec is not None
    args = [
        "--num-layers", str(spec.num_layers),
        "--hidden-size", str(spec.hidden_size),
        "--ffn-hidden-size", str(spec.intermediate_size),
        "--num-attention-heads", str(spec.num_attention_heads),
        "--kv-channels", str(spec.head_dim),
    ]  # fmt: skip
    if spec.num_key_value_heads != spec.num_attention_heads:
        args += ["--group-query-attention", "--num-query-groups", str(spec.num_key_value_heads)]
    args += [
        "--seq-length", str(launch.seq_len),
        "--max-position-embeddings", str(max(launch.seq_len, _max_positions(launch))),
        "--position-embedding-type", "rope",
        "--normalization", "RMSNorm",
        "--swiglu",
        "--disable-bias-linear",
    ]  # fmt: skip
    if spec.model_type == "qwen2":
        args.append("--add-qkv-bias")
    if not spec.tie_word_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    args += ["--tensor-model-parallel-size", str(config.tp)]
    if config.tp > 1:
        args.append("--sequence-parallel")  # as autotune's TP probes shard the norms' inputs
    args += ["--pipeline-model-parallel-size", str(config.pp)]
    if config.pp > 1 and config.pp_schedule is Schedule.INTERLEAVED_1F1B:
        per_chunk = spec.num_layers // (config.pp * config.pp_virtual)
        args += ["--num-layers-per-virtual-pipeline-stage", str(per_chunk)]
    args += ["--context-parallel-size", str(config.cp)]
    if config.engine is Engine.FSDP:
        # Megatron-LM's validate_args refuses FSDP2 with its default fused gradient
        # accumulation (core_v0.16.1: "--use-torch-fsdp2 is not supported with gradient
        # accumulation fusion").
        args += ["--use-torch-fsdp2", "--no-gradient-accumulation-fusion"]
    args += [
        "--micro-batch-size", str(launch.micro_batch_size),
        "--global-batch-size", str(launch.global_batch),
    ]  # fmt: skip
    if config.precision is Precision.BF16_MIXED:
        args.append("--bf16")
    return args + _recompute(launch)


CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"
"""The variable Megatron-LM's ``validate_args`` (core_v0.16.1) asks of a layout: ``1`` under
tensor or context parallelism before Blackwell (so a collective's kernel runs in order with the
GEMM it feeds), never ``1`` under FSDP2."""


def megatron_environment(launch: Launch) -> dict[str, str | None]:
    """The environment Megatron-LM's argument checks ask of ``launch``'s layout (None: the
    variable unset): :data:`CONNECTIONS` ``1`` for tensor or context parallelism over DDP,
    unset for FSDP2 (which refuses ``1``); empty for plain data parallelism."""
    config = launch.config
    if config.engine is Engine.FSDP:
        return {CONNECTIONS: None}
    if config.tp > 1 or config.cp > 1:
        return {CONNECTIONS: "1"}
    return {}


def _max_positions(launch: Launch) -> int:
    assert launch.spec is not None
    value = launch.spec.config.get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else launch.seq_len


def megatron_notes(launch: Launch) -> list[str]:
    """What the export says beside its arguments: what Megatron-LM runs differently from the
    probe, and what the user adds."""
    config = launch.config
    notes = [
        "add your tokenizer, data, learning-rate schedule and the model's other settings "
        "(its rotary base and scaling, norm epsilon, vocabulary) after this script's "
        "arguments, as in Megatron-LM's example for the model",
    ]
    if config.is_layout:
        notes.append(
            "autotune measured torch's tensor-parallel linears and pipelining schedules over the "
            "Hugging Face model: Megatron-LM's tensor parallelism gathers a projection's input "
            "again in the backward where torch's keeps it, and its kernels are its own, so "
            "its peak is the measured one or lower and its speed its own"
        )
    if config.ac_every > 1:
        notes.append(
            f"autotune checkpointed every {config.ac_every}-th block; Megatron-LM's block "
            "method recomputes the same number of blocks in each pipeline chunk, its first ones"
        )
    return notes
