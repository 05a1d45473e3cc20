"""The plain engines: one process (``single``) or full replicas with DDP (``ddp``)."""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel

from autotune.config import Engine
from autotune.probe.engines.base import (
    EngineContext,
    TorchTrainee,
    Trainee,
    cast_weights,
    trainable,
)
from autotune.probe.modeling import build_model, materialize


class _DdpTrainee(TorchTrainee):
    def prepare_sync(self, sync: bool) -> None:
        # What ``DistributedDataParallel.no_sync()`` toggles: skip the all-reduce on
        # accumulation micro-steps.
        if isinstance(self.model, DistributedDataParallel):
            self.model.require_backward_grad_sync = sync


def build_ddp(ctx: EngineContext) -> Trainee:
    """The model on one device, replicated with DDP unless the engine is ``single``."""
    model = build_model(ctx.model, ctx.config)
    materialize(model, ctx.device, seed=ctx.seed)
    cast_weights(model, ctx.config)
    params = trainable(model)
    if ctx.config.engine is Engine.DDP:
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        model = DistributedDataParallel(model, device_ids=device_ids)
    return _DdpTrainee(model, params, ctx, autocast=True)
