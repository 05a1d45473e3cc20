"""The token ids a probe trains on: random, and the same for the same seed on every machine."""

from __future__ import annotations

import torch

from autotune.models import ModelSpec

__all__ = ["synthetic_batch"]


def synthetic_batch(
    spec: ModelSpec,
    micro_batch_size: int,
    seq_len: int,
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """Random token ids for a probe step, the same for the same seed on every machine.

    The ids are drawn on the CPU generator and then moved, because CUDA generators give other
    numbers for the same seed and would make probes on different GPUs see different data.

    Args:
        spec: The model whose vocabulary bounds the ids.
        micro_batch_size: Sequences per micro-batch.
        seq_len: Tokens per sequence.
        seed: Generator seed.
        device: Where the returned tensor lives.

    Returns:
        An int64 tensor of shape ``(micro_batch_size, seq_len)``.

    Raises:
        ValueError: If a size is not positive or ``seq_len`` exceeds the model's context.
    """
    if micro_batch_size < 1 or seq_len < 1:
        raise ValueError(f"micro_batch_size {micro_batch_size} and seq_len {seq_len} must be >= 1")
    if seq_len > spec.max_position_embeddings:
        raise ValueError(
            f"seq_len {seq_len} exceeds the {spec.max_position_embeddings} positions "
            f"model {spec.name!r} supports (max_position_embeddings)"
        )
    generator = torch.Generator(device="cpu").manual_seed(seed)
    shape = (micro_batch_size, seq_len)
    return torch.randint(0, spec.vocab_size, shape, generator=generator).to(device)
