"""DeepSpeed ZeRO stages 0-3, bf16 or fp16 with loss scaling, optimizer/parameter CPU offload."""

from __future__ import annotations

import os
from typing import Any

import torch

from autotune.config import Offload, Precision, TrainConfig
from autotune.probe.engines.base import EngineContext, Trainee
from autotune.probe.modeling import apply_activation_checkpointing, build_model, materialize
from autotune.probe.ops import deepspeed_ops, extensions_dir, load_ops


def deepspeed_config(
    config: TrainConfig,
    *,
    micro_batch_size: int,
    grad_accum: int,
    world_size: int,
    hidden_size: int,
    lr: float = 1e-4,
    cpu: bool = False,
) -> dict[str, Any]:
    """The DeepSpeed JSON for a configuration (also what the exporter writes for users).

    Bucket sizes follow the Hugging Face integration's ``auto`` values, which scale with the
    model's hidden size instead of DeepSpeed's fixed 500M-element defaults (a 1 GB bf16 buffer
    even for a small model).

    On the CPU, ``torch_adam`` keeps DeepSpeed from JIT-building its fused and CPU Adam ops
    (about a minute each); on GPUs DeepSpeed's own optimizers are used, as in training.
    """
    zero: dict[str, Any] = {"stage": config.zero_stage}
    if config.zero_stage >= 1:
        zero.update(
            overlap_comm=not cpu,
            contiguous_gradients=True,
            reduce_bucket_size=hidden_size * hidden_size,
            allgather_bucket_size=hidden_size * hidden_size,
        )
    if config.zero_stage == 3:
        zero.update(
            stage3_prefetch_bucket_size=int(0.9 * hidden_size * hidden_size),
            stage3_param_persistence_threshold=10 * hidden_size,
        )
    pin = not cpu
    if config.offload in (Offload.OPTIMIZER, Offload.PARAMS):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if config.offload is Offload.PARAMS:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    optimizer_params: dict[str, Any] = {"lr": lr, "betas": [0.9, 0.95], "weight_decay": 0.0}
    if cpu:
        optimizer_params["torch_adam"] = True
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch_size * grad_accum * world_size,
        "bf16": {"enabled": config.precision is Precision.BF16_MIXED},
        "fp16": {
            "enabled": config.precision is Precision.FP16_MIXED,
            "loss_scale": 0,  # dynamic
            "initial_scale_power": 16,
        },
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": optimizer_params},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


class _DeepSpeedTrainee(Trainee):
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.model = engine.module

    def forward(self, input_ids: torch.Tensor, *, sync: bool) -> torch.Tensor:
        return self.engine(input_ids=input_ids, labels=input_ids).loss

    def backward(self, loss: torch.Tensor, *, sync: bool) -> None:
        self.engine.backward(loss)
        if not sync:
            # DeepSpeed counts micro-steps in step(): on accumulation steps it only advances.
            self.engine.step()

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
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = build_model(ctx.model, ctx.config, meta=False, checkpointing=False)
        _initialize_partitioned(model)
        apply_activation_checkpointing(model, ctx.config.ac_every)
    else:
        model = build_model(ctx.model, ctx.config)
        materialize(model, ctx.device, seed=ctx.seed)
    engine, *_ = deepspeed.initialize(
        model=model, config=ds_config, model_parameters=[p for p in model.parameters()]
    )
    return _DeepSpeedTrainee(engine)
