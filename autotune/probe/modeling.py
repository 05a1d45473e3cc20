"""Building the model inside a probe: on the meta device, then straight onto the target device.

A 7B model must never be initialized on the host first: it is built with no storage at all
(meta), wrapped (checkpointing, sharding), and only then given memory on its device and
random weights there. Random weights are all a probe needs: memory and speed do not depend on
their values, and the loss only has to be finite and falling.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.distributed.tensor import DTensor

from autotune.config import (
    LORA_TARGETS,
    SELECTIVE_SAVED_OPS,
    Attention,
    TrainConfig,
    lora_alpha,
)
from autotune.models import ModelSpec
from autotune.probe.loss import apply_loss

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def hf_config(spec: ModelSpec) -> PretrainedConfig:
    """The transformers config the probes build ``spec``'s model from.

    The family's config class fills in the fields the spec leaves out, exactly as when it reads
    a ``config.json`` (``rope_theta``: transformers 5 folds it into ``rope_parameters``).
    ``use_cache`` is off whatever the fields say: probes train, and a KV cache would only hold
    memory that the search would then blame on the configuration.

    Args:
        spec: The model shape.

    Returns:
        A new config object, free to change.
    """
    from transformers import AutoConfig

    fields = spec.config_dict()
    fields["use_cache"] = False
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def build_model(
    spec: ModelSpec, config: TrainConfig, *, meta: bool = True, checkpointing: bool = True
) -> nn.Module:
    """The causal LM of ``spec`` in fp32, on meta unless told not, checkpointed as configured."""
    from transformers import AutoModelForCausalLM

    context = torch.device("meta") if meta else contextlib.nullcontext()
    with context, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(
            hf_config(spec), attn_implementation=_attn_implementation(config.attention)
        )
        if config.is_lora:
            apply_lora(model, config.lora_rank)
    model.config.use_cache = False
    model.train()
    apply_loss(model, config.loss)
    if checkpointing:
        apply_activation_checkpointing(model, config.ac_every, config.ac_ops)
    if config.act_offload:
        from autotune.probe.offload import apply_activation_offload

        apply_activation_offload(decoder_blocks(model))
    if config.torch_compile:
        from autotune.probe.compile import apply_compile

        apply_compile(decoder_blocks(model))
    return model


def apply_lora(model: nn.Module, rank: int) -> None:
    """Freeze ``model`` and give every linear layer of its blocks rank-``rank`` LoRA adapters
    (peft's ``inject_adapter_in_model`` with ``target_modules="all-linear"``, dropout 0),
    in place: built where the model is (on meta, they get memory with it)."""
    from peft import LoraConfig, inject_adapter_in_model

    lora = LoraConfig(
        r=rank, lora_alpha=lora_alpha(rank), target_modules=LORA_TARGETS, lora_dropout=0.0
    )
    inject_adapter_in_model(lora, model)


def _attn_implementation(attention: Attention) -> str:
    return attention.value  # Hugging Face's names: sdpa, eager, flash_attention_2


def decoder_blocks(model: nn.Module) -> nn.ModuleList:
    """The list of decoder blocks of a Hugging Face causal LM (llama/qwen/mistral or gpt2)."""
    for path in ("model.layers", "transformer.h", "model.decoder.layers", "gpt_neox.layers"):
        module: object = model
        for part in path.split("."):
            module = getattr(module, part, None)
            if module is None:
                break
        if isinstance(module, nn.ModuleList):
            return module
    raise ValueError(
        f"cannot find the decoder blocks of {type(model).__name__}: "
        "autotune supports llama, mistral, qwen2 and gpt2-style causal LMs"
    )


def _selective_policy(ctx: object, op: object, *args: object, **kwargs: object) -> object:
    from torch.utils.checkpoint import CheckpointPolicy

    name = getattr(op, "__name__", "").split(".")[0]
    return (
        CheckpointPolicy.MUST_SAVE
        if name in SELECTIVE_SAVED_OPS
        else CheckpointPolicy.PREFER_RECOMPUTE
    )


def _selective_context() -> tuple[object, object]:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_selective_policy)


def apply_activation_checkpointing(model: nn.Module, every: int, ops: bool = False) -> int:
    """Wrap every ``every``-th decoder block (1: all of them) in non-reentrant checkpointing,
    and with ``ops`` every other block in op-level selective checkpointing.

    Only a checkpointed block's input is kept through the forward; its activations are
    recomputed in the backward. A selectively checkpointed block keeps its input and the
    outputs of its matmuls and attention kernel (``SELECTIVE_SAVED_OPS``) and recomputes the
    rest.
    Returns how many blocks were wrapped.
    """
    if every <= 0 and not ops:
        return 0
    blocks = decoder_blocks(model)
    wrapped = 0
    for index, block in enumerate(blocks):
        if every > 0 and index % every == 0:
            blocks[index] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        elif ops:
            blocks[index] = checkpoint_wrapper(
                block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, context_fn=_selective_context
            )
        else:
            continue
        wrapped += 1
    return wrapped


def materialize(model: nn.Module, device: torch.device, *, seed: int) -> None:
    """Give a meta model storage on ``device`` and initialize its weights and buffers there.

    Works on plain and FSDP2-sharded (DTensor) parameters alike. Buffers computed at
    construction (RoPE frequencies) are recomputed by the model's own initializer: after
    ``to_empty`` they hold garbage.
    """
    torch.manual_seed(seed)
    model.to_empty(device=device)
    with torch.no_grad():
        _initialize(model)
    tie_weights = getattr(model, "tie_weights", None)
    if callable(tie_weights):
        tie_weights()
    for name, buffer in _named_float_buffers(model):
        if not torch.isfinite(buffer).all():
            raise RuntimeError(f"buffer {name} is not finite after initialization")


def _initialize(model: nn.Module) -> None:
    initialize = getattr(model, "initialize_weights", None)
    if callable(initialize):
        initialize()
        return
    # Not a transformers model: torch's own per-layer defaults.
    for module in model.modules():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()


def _named_float_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for name, buffer in model.named_buffers():
        if buffer.is_floating_point() and buffer.numel() and buffer.device.type != "meta":
            yield name, buffer.to_local() if isinstance(buffer, DTensor) else buffer
