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

from autotune.config import Attention, TrainConfig
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
    model.config.use_cache = False
    model.train()
    apply_loss(model, config)
    if checkpointing:
        apply_activation_checkpointing(model, config.ac_every)
    return model


def _attn_implementation(attention: Attention) -> str:
    return "sdpa" if attention is Attention.SDPA else "eager"


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


def apply_activation_checkpointing(model: nn.Module, every: int) -> int:
    """Wrap every ``every``-th decoder block (1: all of them) in non-reentrant checkpointing.

    Only each block's input is kept through the forward; its activations are recomputed in
    the backward. Returns how many blocks were wrapped.
    """
    if every <= 0:
        return 0
    blocks = decoder_blocks(model)
    wrapped = 0
    for index, block in enumerate(blocks):
        if index % every == 0:
            blocks[index] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
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
