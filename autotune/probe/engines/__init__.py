"""Training engines: one module each, one public ``build_*`` function each."""

from __future__ import annotations

from autotune.config import Engine
from autotune.probe.engines.base import EngineContext, Trainee


def build_trainee(ctx: EngineContext) -> Trainee:
    """Build the engine named by ``ctx.config.engine`` (imports only that engine)."""
    engine = ctx.config.engine
    if engine in (Engine.SINGLE, Engine.DDP):
        from autotune.probe.engines.ddp import build_ddp

        return build_ddp(ctx)
    if engine is Engine.FSDP:
        from autotune.probe.engines.fsdp import build_fsdp

        return build_fsdp(ctx)
    from autotune.probe.engines.deepspeed import build_deepspeed

    return build_deepspeed(ctx)


__all__ = ["EngineContext", "Trainee", "build_trainee"]
