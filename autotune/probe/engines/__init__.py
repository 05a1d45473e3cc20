"""Training engines: one module each, one public ``build_*`` function each."""

from __future__ import annotations

import functools

from autotune.config import Engine, TrainConfig
from autotune.probe.engines.base import EngineContext, Trainee


@functools.cache
def load_engine(config: TrainConfig, device_type: str) -> None:
    """Import the engine ``config`` names, with the libraries and compiled ops it loads (part
    of a rank's start-up, so that :func:`build_trainee` measures the build alone); once per
    process and configuration."""
    if config.pp > 1:
        import autotune.probe.engines.pipeline
    elif config.tp > 1:
        import autotune.probe.engines.tensor
    elif config.engine is Engine.DEEPSPEED:
        from autotune.probe.engines.deepspeed import load_deepspeed

        load_deepspeed(config, device_type)
    elif config.engine is Engine.FSDP:
        import autotune.probe.engines.fsdp
    else:
        import autotune.probe.engines.ddp  # noqa: F401


def build_trainee(ctx: EngineContext) -> Trainee:
    """Build the engine named by ``ctx.config.engine`` (imports only that engine)."""
    load_engine(ctx.config, ctx.device.type)
    engine = ctx.config.engine
    if ctx.config.pp > 1:
        from autotune.probe.engines.pipeline import build_pipeline

        return build_pipeline(ctx)
    if ctx.config.tp > 1:
        from autotune.probe.engines.tensor import build_tensor_parallel

        return build_tensor_parallel(ctx)
    if engine in (Engine.SINGLE, Engine.DDP):
        from autotune.probe.engines.ddp import build_ddp

        return build_ddp(ctx)
    if engine is Engine.FSDP:
        from autotune.probe.engines.fsdp import build_fsdp

        return build_fsdp(ctx)
    from autotune.probe.engines.deepspeed import build_deepspeed

    return build_deepspeed(ctx)


__all__ = ["EngineContext", "Trainee", "build_trainee", "load_engine"]
