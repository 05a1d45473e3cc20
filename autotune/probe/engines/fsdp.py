"""PyTorch FSDP2 (``fully_shard``): each decoder block is one all-gather unit, the root another.

zero_stage 3 is FULL_SHARD (parameters re-sharded after the forward and gathered again for
the backward), zero_stage 2 is SHARD_GRAD_OP (kept gathered between the two: more memory, one
all-gather less). ``--offload params`` moves parameters, gradients and the optimizer step to
the CPU (CPUOffloadPolicy).
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from autotune.config import Offload, Precision
from autotune.probe.engines.base import (
    EngineContext,
    TorchTrainee,
    Trainee,
    cast_weights,
    torch_dtype,
)
from autotune.probe.modeling import build_model, decoder_blocks, materialize


class _FsdpTrainee(TorchTrainee):
    def prepare_sync(self, sync: bool) -> None:
        self.model.set_requires_gradient_sync(sync)  # type: ignore[operator]


def build_fsdp(ctx: EngineContext) -> Trainee:
    """Shard the meta model block by block, then materialize only each rank's shard."""
    model = build_model(ctx.model, ctx.config)
    cast_weights(model, ctx.config)
    mixed = ctx.config.precision is Precision.BF16_MIXED
    mp_policy = MixedPrecisionPolicy(
        param_dtype=torch_dtype(ctx.config.precision) if mixed else None,
        # NOTE: gradients are reduced in fp32, as torchtitan does, for accuracy at scale.
        reduce_dtype=torch.float32 if mixed else None,
    )
    offload: OffloadPolicy = (
        # Pinned host memory needs an accelerator; on the CPU it is plain memory.
        CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda")
        if ctx.config.offload is Offload.PARAMS
        else OffloadPolicy()
    )
    reshard = ctx.config.zero_stage == 3
    for block in decoder_blocks(model):
        fully_shard(
            block, mp_policy=mp_policy, offload_policy=offload, reshard_after_forward=reshard
        )
    # The root's parameters (embeddings, final norm, head) are needed right at the backward's
    # start: never re-shard them after the forward.
    fully_shard(model, mp_policy=mp_policy, offload_policy=offload, reshard_after_forward=False)
    init_device = torch.device("cpu") if ctx.config.offload is Offload.PARAMS else ctx.device
    materialize(model, init_device, seed=ctx.seed)
    return _FsdpTrainee(model, model.parameters(), ctx, autocast=False)
