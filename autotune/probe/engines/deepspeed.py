"""DeepSpeed ZeRO stages 0-3, bf16 or fp16 with loss scaling, optimizer/parameter CPU offload."""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch

from autotune.config import TrainConfig
from autotune.handoff.launch import deepspeed_config
from autotune.probe.engines.base import EngineContext, Trainee
from autotune.probe.modeling import apply_activation_checkpointing, build_model, materialize
from autotune.probe.ops import deepspeed_ops, extensions_dir, load_ops


class _DeepSpeedTrainee(Trainee):
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.model = engine.module

    def forward(self, input_ids: torch.Tensor, *, sync: bool) -> torch.Tensor:
        # The step loop says where the boundary is (a probe's sizes may accumulate
        # differently, where DeepSpeed's own count follows its config's one number).
        self.engine.set_gradient_accumulation_boundary(sync)
        return self.engine(input_ids=input_ids, labels=input_ids).loss

    def backward(self, loss: torch.Tensor, *, sync: bool) -> None:
        self.engine.backward(loss)

    def optimizer_step(self) -> None:
        self.engine.step()

    def discard_gradients(self) -> None:
        self.engine.zero_grad()


def _initialize_partitioned(model: torch.nn.Module) -> None:
    """Run the model's own weight initializer on a ZeRO-3 partitioned model.

    transformers initializes weights at construction, but under ``zero.Init`` the parameters
    are already partitioned (empty) by then, so that initialization does nothing and torch's
    defaults remain (std 1.0 embeddings: a loss near 40 instead of ln(vocab)). Gathering one
    module at a time keeps the transient memory to the largest layer, as in training.
    """
    import deepspeed

    init_weights = getattr(model, "_init_weights", None)
    if not callable(init_weights):
        return
    for module in model.modules():
        params = list(module.parameters(recurse=False))
        if not params:
            continue
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0), torch.no_grad():
            init_weights(module)


def load_deepspeed(config: TrainConfig, device_type: str) -> None:
    """Import DeepSpeed and load the JIT-built ops it will use for ``config``.

    The set-up step of ``autotune run`` has normally built them; they are loaded here under
    the build lock, so DeepSpeed's own loads later reuse them, and a torch build lock left by
    a killed probe is cleared instead of waited on forever.
    """
    import deepspeed  # noqa: F401

    loads = load_ops(
        deepspeed_ops(config, device_type),
        extensions_dir(os.environ),
        wait_s=None,  # the probe's timeout bounds it
        say=lambda line: print(line, flush=True),
    )
    for load in loads:
        if load.action == "built":  # in the probe's time: the set-up step did not run
            print(load.line(), flush=True)


def build_deepspeed(ctx: EngineContext) -> Trainee:
    """``deepspeed.initialize`` on the model; ZeRO-3 builds it partitioned from the start."""
    import deepspeed

    ds_config = deepspeed_config(
        ctx.config,
        micro_batch_size=ctx.micro_batch_size,
        grad_accum=ctx.grad_accum,
        world_size=ctx.world_size,
        hidden_size=ctx.model.hidden_size,
        lr=ctx.lr,
        cpu=ctx.device.type == "cpu",
    )
    # deepspeed.comm wraps the process group the worker already created.
    deepspeed.init_distributed(dist_backend="nccl" if ctx.device.type == "cuda" else "gloo")
    torch.manual_seed(ctx.seed)
    if ctx.config.zero_stage == 3:
        # zero.Init partitions each layer as it is constructed: no rank ever holds the whole
        # model, so no meta detour is needed.
        # The checkpoint wrappers are added after: zero.Init patches the constructor of every
        # module built inside it, and the wrapper's attribute forwarding loops under that patch.
        # torch._dynamo imported first: imported inside zero.Init (transformers' modeling
        # modules import it), its polyfill of Tensor.__new__ meets zero.Init's patched one
        # and raises (DeepSpeed 0.19 with torch 2.13, in a fresh interpreter).
        importlib.import_module("torch._dynamo")

        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = build_model(ctx.model, ctx.config, meta=False, checkpointing=False)
        _initialize_partitioned(model)
        apply_activation_checkpointing(model, ctx.config.ac_every, ctx.config.ac_ops)
    else:
        model = build_model(ctx.model, ctx.config)
        materialize(model, ctx.device, seed=ctx.seed)
    engine, *_ = deepspeed.initialize(
        model=model, config=ds_config, model_parameters=[p for p in model.parameters()]
    )
    return _DeepSpeedTrainee(engine)
