"""The probe's loss: the model's own, the chunked cross-entropy of ``--loss chunked``, or
Liger-Kernel's fused linear cross-entropy (``--loss fused``, on a CUDA GPU).

A causal LM's loss needs the logits of every token: batch × sequence × vocabulary values, made
in the compute dtype, upcast to fp32 and kept (as log-probabilities) for the backward. With a
large vocabulary that is the largest activation of a step (Qwen2.5's 152k entries: 1.5 MB a
token). The chunked loss never holds more than one chunk's logits: it runs the output layer
and the cross-entropy on :data:`~autotune.config.LOSS_CHUNK_TOKENS` tokens at a time, each
under non-reentrant activation checkpointing, so that what a chunk saves for the backward is
its slice of the hidden states, and its logits are made again in the backward. The cost is one
more forward of the output layer. The same idea, with the gradients computed in the forward
instead of a recomputation, is Liger-Kernel's fused linear cross-entropy (Hsu et al. 2024,
"Liger Kernel: Efficient Triton Kernels for LLM Training", section 3.4) and Apple's Cut
Cross-Entropy (Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary Language Models").

The loss equals the model's own: the mean over every predicted token of the cross-entropy of
the fp32 logits, position t predicting the label at t + 1 (transformers' ``ForCausalLMLoss``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from autotune.config import LOSS_CHUNK_TOKENS, Loss

__all__ = ["IGNORE_INDEX", "apply_loss", "chunked_cross_entropy", "fused_cross_entropy"]

IGNORE_INDEX = -100
"""A label that counts in no loss (transformers' and torch's convention)."""


def _next_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Each position's target, flat: the next token's label, none (ignored) after the last."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)


def _chunk_loss(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy(
    head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """Mean next-token cross-entropy of ``head(hidden)`` against ``labels``, a chunk at a time.

    Args:
        head: The output layer (hidden size to vocabulary).
        hidden: The last hidden states, batch × sequence × hidden.
        labels: Token ids, batch × sequence; position t is scored against ``labels[t + 1]``,
            and :data:`IGNORE_INDEX` counts nowhere.
        chunk_tokens: Tokens per chunk.

    Returns:
        The fp32 scalar loss, as the model's own would be.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, not {chunk_tokens}")
    targets = _next_tokens(labels)
    flat = hidden.reshape(-1, hidden.size(-1))
    counted = (targets != IGNORE_INDEX).sum()
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, flat.size(0), chunk_tokens):
        stop = start + chunk_tokens
        total = total + checkpoint(
            _chunk_loss, head, flat[start:stop], targets[start:stop], use_reentrant=False
        )
    return total / counted.clamp(min=1)


def fused_cross_entropy(
    head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """:func:`chunked_cross_entropy`'s loss through Liger-Kernel's fused linear cross-entropy
    (its Triton kernels: a CUDA GPU and ``liger-kernel``), which computes both gradients in
    the forward, chunk by chunk, and keeps no logits."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    fused = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)
    return fused(head.weight, hidden.reshape(-1, hidden.size(-1)), _next_tokens(labels))


def apply_loss(model: nn.Module, loss: Loss | str) -> None:
    """Make ``model(input_ids=..., labels=...).loss`` the loss ``loss`` names (``"full"``,
    ``"chunked"`` or ``"fused"``): the probe's way, and the way every export tells users.

    The full loss is the model's own forward. The chunked and fused ones replace this
    instance's forward (not its class's) with the base model, then :func:`chunked_cross_entropy`
    or :func:`fused_cross_entropy` through the model's output layer. Called before the model is
    wrapped, the engines' wrappers and hooks (DDP's gradient all-reduce, FSDP2's gathers,
    DeepSpeed's engine) call the instance's forward and so see the whole loss; calling the base
    model and the output layer from the training step instead would go around them.

    A ``num_items_in_batch`` keyword (the Hugging Face Trainer's, under accumulation) divides
    the summed loss, as the model's own loss does with it.

    Raises:
        ValueError: For a name that is not a loss.
    """
    chosen = Loss(loss)
    if chosen is Loss.FULL:
        return
    from transformers.modeling_outputs import CausalLMOutputWithPast

    base: nn.Module = model.base_model  # type: ignore[assignment]
    head: nn.Module = model.get_output_embeddings()  # type: ignore[operator]
    fused = chosen is Loss.FUSED
    own = inspect.signature(model.forward)

    def forward(input_ids: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> Any:
        items = kwargs.pop("num_items_in_batch", None)
        hidden = base(input_ids=input_ids, **kwargs).last_hidden_state
        if fused:
            value = fused_cross_entropy(head, hidden, labels)
        else:
            value = chunked_cross_entropy(head, hidden, labels, LOSS_CHUNK_TOKENS)
        if items is not None:  # the mean over this micro-batch, made a share of the step's
            counted = (_next_tokens(labels) != IGNORE_INDEX).sum().clamp(min=1)
            value = value * counted / torch.as_tensor(items, device=value.device)
        return CausalLMOutputWithPast(loss=value)

    # The model's own parameters, as callers that read the signature see them: the Trainer
    # keeps only the dataset's columns that the forward names (attention_mask among them).
    forward.__signature__ = own  # type: ignore[attr-defined]
    model.forward = forward
