"""A measured configuration as torchtitan's own configuration: ``autotune export --format
torchtitan``.

torchtitan (0.3) configures a run in Python: ``torchtitan.train --module M --config F`` calls
the function ``F`` of the module ``M`` for a ``Trainer.Config`` and lets its options (tyro's
``--section.field``) override it. The export is such a module: ``apply(config)`` sets on any
``Trainer.Config`` what autotune measured (the model's flavor, the layout's degrees and
schedule, the micro-batch and the global batch, the precision, checkpointing, compile, the
loss), and ``autotune()`` applies it to torchtitan's own preset for the model's shape, whose
data, tokenizer, optimizer and schedule stay the user's. Run as a script, the module starts
``torchrun -m torchtitan.train`` on it.

The mapping, from autotune's configuration to torchtitan's fields:

- the layout: ``tensor_parallel_degree`` with sequence parallelism (autotune's TP probes shard
  the norms' inputs, and compute the loss on the vocabulary-split logits, as torchtitan does),
  ``pipeline_parallel_degree`` and ``pipeline_parallel_schedule`` (``GPipe``, ``1F1B``,
  ``Interleaved1F1B``) with ``module_fqns_per_model_part``: the probe's own split of the blocks
  into ``pp * pp_virtual`` chunks (a chunk a block more where they do not split evenly; the
  embedding on the first, the norm and the output layer on the last), since torchtitan's own
  split counts the embedding and the output layer as a block each; ``context_parallel_degree``;
- the data-parallel rest: FSDP2 shards it (``data_parallel_shard_degree``, resharded after the
  forward under ZeRO-3, ``fsdp_reshard_after_forward = "always"``, kept under ZeRO-2,
  ``"never"``; its parameter offload is ``enable_cpu_offload``), DDP replicates it
  (``data_parallel_replicate_degree``: torchtitan replicates with FSDP2 over a replicate
  mesh, which holds what DDP holds);
- the batch: ``local_batch_size`` the micro-batch (under a pipeline: the micro-batch times the
  microbatches of a step, ``pipeline_parallel_microbatch_size`` the micro-batch), and
  ``global_batch_size`` the step's sequences, so torchtitan accumulates as autotune measured;
- bf16-mixed is FSDP2's bf16 parameters over fp32 weights (``mixed_precision_param``), pure
  bf16 ``training.dtype``; checkpointing every block is ``FullAC``, none is ``None``; compiled
  blocks compile ``model`` alone; the loss is torchtitan's plain ``CrossEntropyLoss`` (fp32
  log-probabilities, as autotune's stand-in), not its presets' chunked wrapper; CUDA graphs
  (on by default in torchtitan 0.3) are off, as measured.

Refused with one line, never written approximately: DeepSpeed, fp16, a model of a shape no
torchtitan llama3 preset has (8B, 70B, 405B: Llama 3.1's), checkpointing every k-th block or
op by op (torchtitan 0.3 checkpoints every block or none, and its selective policy recomputes
every second matmul, which autotune did not measure), and the knobs that change the Hugging
Face model's code (another attention kernel, the chunked or fused loss, 8-bit AdamW, LoRA,
activation offload). Pure functions, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autotune.config import (
    ConfigError,
    Engine,
    Offload,
    Precision,
    Schedule,
)
from autotune.layouts import chunk_bounds, data_parallel

if TYPE_CHECKING:
    from autotune.handoff.launch import Launch

__all__ = ["CONFIG_FUNCTION", "FLAVORS", "TitanSettings", "torchtitan_notes", "torchtitan_settings"]

FLAVORS: dict[tuple[int, int, int, int, int, int], tuple[str, str]] = {
    (4096, 32, 32, 8, 14336, 128256): ("8B", "llama3_8b"),
    (8192, 80, 64, 8, 28672, 128256): ("70B", "llama3_70b"),
    (16384, 126, 128, 8, 53248, 128256): ("405B", "llama3_405b"),
}
"""torchtitan 0.3's llama3 flavors that have a preset, by shape (hidden size, layers, heads,
key/value heads, MLP width, vocabulary; untied embeddings): the flavor's name for
``torchtitan.models.llama3.model_registry`` and its preset in ``config_registry``
(``torchtitan/models/llama3/__init__.py`` and ``config_registry.py``; tests read them back)."""

CONFIG_FUNCTION = "autotune"
"""The function of the exported module that torchtitan's ``--config`` names."""

SCHEDULES = {
    Schedule.GPIPE: "GPipe",
    Schedule.ONE_F_ONE_B: "1F1B",
    Schedule.INTERLEAVED_1F1B: "Interleaved1F1B",
}
"""torchtitan's names of the pipeline schedules (``torch.distributed.pipelining``'s)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TitanSettings:
    """What the export sets on a torchtitan ``Trainer.Config``: each section's fields by name,
    every value one autotune measured or the layout implies."""

    flavor: str
    """The model's flavor in torchtitan's llama3 registry (``"8B"``)."""
    preset: str
    """torchtitan's preset of that flavor, ``autotune()``'s base (``"llama3_8b"``)."""
    training: dict[str, Any]
    parallelism: dict[str, Any]
    full_checkpointing: bool
    """Every block checkpointed whole (``FullAC``); False: none."""
    compile_blocks: bool
    """Each block compiled (``compile.components = ["model"]``)."""


def _refuse(launch: Launch, why: str, instead: str) -> ConfigError:
    return ConfigError(f"--format torchtitan: {launch.config.label()}: {why}: {instead}")


def _flavor(launch: Launch) -> tuple[str, str]:
    spec = launch.spec
    if spec is None:
        raise _refuse(launch, "the model's shape is unknown", "export from a study of the model")
    shape = (spec.hidden_size, spec.num_layers, spec.num_attention_heads,
             spec.num_key_value_heads, spec.intermediate_size, spec.vocab_size)  # fmt: skip
    found = (
        FLAVORS.get(shape) if spec.model_type == "llama" and not spec.tie_word_embeddings else None
    )
    if found is None:
        raise _refuse(
            launch,
            f"{launch.model} has the shape of no torchtitan llama3 preset (8B, 70B, 405B)",
            "use --format megatron or torchrun",
        )
    return found


def _check(launch: Launch) -> None:
    """Refuse, with one line, what torchtitan cannot run as it was measured."""
    config = launch.config
    # Compiled blocks are torchtitan's own per-block compile; op-level checkpointing is below.
    carried = ("torch_compile", "ac_ops")
    knob = next((name for field, name in config.model_code_knobs() if field not in carried), None)
    if knob is not None:
        raise _refuse(
            launch,
            f"torchtitan's model has no setting for {knob}, which autotune measured",
            "export a configuration without it (autotune trials lists them)",
        )
    if config.engine is Engine.DEEPSPEED:
        raise _refuse(launch, "torchtitan trains without DeepSpeed", "use --format deepspeed")
    if config.precision is Precision.FP16_MIXED:
        raise _refuse(launch, "torchtitan trains in bf16 or fp32, not fp16", "export a bf16 one")
    if config.ac_ops or config.ac_every > 1:
        raise _refuse(
            launch,
            "torchtitan 0.3 checkpoints every block or none (its selective policy recomputes "
            "every second matmul), and autotune measured "
            + ("op-level checkpointing" if config.ac_ops else f"every {config.ac_every}-th block"),
            "export a configuration that checkpoints every block or none",
        )
    _flavor(launch)


def _pipeline_parts(layers: int, chunks: int) -> list[list[str]]:
    """The module names of each pipeline chunk, in torchtitan's llama3 names: the probe's split
    of the blocks (:func:`~autotune.layouts.chunk_bounds`), the embedding on the first chunk,
    the final norm and the output layer on the last."""
    parts = []
    for index, blocks in enumerate(chunk_bounds(layers, chunks)):
        part = [f"layers.{block}" for block in blocks]
        if index == 0:
            part.insert(0, "tok_embeddings")
        if index == chunks - 1:
            part += ["norm", "lm_head"]
        parts.append(part)
    return parts


def torchtitan_settings(launch: Launch) -> TitanSettings:
    """torchtitan's fields for ``launch``.

    Raises:
        ConfigError: Where torchtitan cannot run the configuration as measured (one line, with
            what to export instead).
    """
    _check(launch)
    flavor, preset = _flavor(launch)
    config = launch.config
    spec = launch.spec
    assert spec is not None
    dp = data_parallel(config, launch.world_size)
    pipeline = config.pp > 1
    training: dict[str, Any] = {
        "local_batch_size": launch.micro_batch_size * (launch.grad_accum if pipeline else 1),
        "global_batch_size": launch.global_batch,
        "seq_len": launch.seq_len,
        "dtype": "bfloat16" if config.precision is Precision.BF16 else "float32",
        "mixed_precision_param": "float32" if config.precision is Precision.FP32 else "bfloat16",
        "enable_cpu_offload": config.engine is Engine.FSDP and config.offload is Offload.PARAMS,
        "disable_cuda_graphs": True,
    }
    sharded = config.engine is Engine.FSDP
    parallelism: dict[str, Any] = {
        "data_parallel_shard_degree": dp if sharded else 1,
        "data_parallel_replicate_degree": 1 if sharded else dp,
        "tensor_parallel_degree": config.tp,
        "enable_sequence_parallel": config.tp > 1,
        "pipeline_parallel_degree": config.pp,
        "context_parallel_degree": config.cp,
    }
    if sharded:
        parallelism["fsdp_reshard_after_forward"] = "always" if config.zero_stage == 3 else "never"
    if pipeline:
        parallelism |= {
            "pipeline_parallel_schedule": SCHEDULES[config.pp_schedule],
            "pipeline_parallel_microbatch_size": launch.micro_batch_size,
            "module_fqns_per_model_part": _pipeline_parts(
                spec.num_layers, config.pp * config.pp_virtual
            ),
        }
    return TitanSettings(
        flavor=flavor,
        preset=preset,
        training=training,
        parallelism=parallelism,
        full_checkpointing=config.ac_every == 1,
        compile_blocks=config.torch_compile,
    )


def torchtitan_notes(launch: Launch) -> list[str]:
    """What the export says beside its settings: what torchtitan runs differently from the
    probe, and what the user adds."""
    settings = torchtitan_settings(launch)
    config = launch.config
    notes = [
        f"autotune() starts from torchtitan's {settings.preset} preset: its data, tokenizer "
        "(hf_assets_path), optimizer and schedule are torchtitan's, not measured; set yours as "
        "options (--training.steps 1000) or call apply() on your own Trainer.Config",
        "torchtitan's llama3 attends with FlexAttention (block-causal, per document) where "
        "autotune measured SDPA's causal kernel on the Hugging Face model; both keep no "
        "score matrix, and torchtitan's kernels run at their own speed",
    ]
    spec = launch.spec
    if spec is not None and not spec.config.get("rope_scaling"):
        notes.append(
            f"torchtitan's {settings.flavor} flavor scales its rotary positions as Llama 3.1 "
            f"does, and {launch.model} does not: the same parameters, memory and speed, other "
            "frequencies in the rotary dimensions whose wavelength exceeds 8k tokens"
        )
    if settings.flavor == "405B":
        notes.append(
            "torchtitan's llama3_405b preset builds float8 linears under compile (an SM89+ "
            "GPU to build it at all); apply() replaces them with the bf16 linears autotune "
            "measured and compiles as measured"
        )
    if config.is_layout:
        notes.append(
            "autotune measured torch's tensor-parallel plans and pipelining schedules over the "
            "Hugging Face model, as torchtitan applies them to its own"
        )
    if config.engine is Engine.DDP:
        notes.append(
            "torchtitan replicates over the data-parallel ranks with FSDP2 on a replicate "
            "mesh, not DDP: the same states a rank, its own communication"
        )
    return notes
