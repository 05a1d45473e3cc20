"""Tensor parallelism with sequence parallelism (torch's DTensor plans), alone or under FSDP2
over the data-parallel ranks: the layout ``tp`` of a configuration.

The ranks form a ``(dp, tp)`` mesh, a TP group being ``tp`` consecutive ranks. Each decoder
block's q/k/v and gate/up projections are split by columns and o/down by rows (Shoeybi et al.
2019, "Megatron-LM"); the norms run on the TP group's share of the sequence and the residual
stream stays sharded along it between blocks (sequence parallelism, Korthikanti et al.
2022): the block's input is all-gathered before the attention and the MLP, and their outputs
reduce-scattered back. The embedding is split by rows, the output layer by vocabulary, and
the loss is computed on the vocabulary-split logits (torch's ``loss_parallel``), as torchtitan
does. The plan is applied before checkpointing and FSDP2, in torchtitan's order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from autotune.config import Engine, Precision
from autotune.probe.engines.base import (
    EngineContext,
    TorchTrainee,
    Trainee,
    torch_dtype,
)
from autotune.probe.modeling import (
    apply_activation_checkpointing,
    build_model,
    decoder_blocks,
    materialize,
)


def _block_plan() -> dict[str, object]:
    """One llama-style decoder block's plan, by Hugging Face's module names."""
    return {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
        ),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        # DTensor outputs between blocks: the model reads the sequence length off them.
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Split ``model`` (a Hugging Face llama, mistral or qwen2 causal LM) over ``mesh``."""
    parallelize_module(
        model,
        mesh,
        {
            "model.embed_tokens": RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
            ),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(
                input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
            ),
        },
    )
    for block in decoder_blocks(model):
        parallelize_module(block, mesh, _block_plan())  # type: ignore[arg-type]


class _TensorParallelTrainee(TorchTrainee):
    """The loss on the vocabulary-split logits, forward and backward under ``loss_parallel``."""

    def prepare_sync(self, sync: bool) -> None:
        if self._config.engine is Engine.FSDP:  # FSDP2 over the data-parallel ranks
            self.model.set_requires_gradient_sync(sync)  # type: ignore[operator]

    def forward(self, input_ids: torch.Tensor, *, sync: bool) -> torch.Tensor:
        self.prepare_sync(sync)
        with self.casting():
            logits = self.model(input_ids=input_ids).logits
        shifted = logits[:, :-1].flatten(0, 1).float()
        with loss_parallel():
            return F.cross_entropy(shifted, input_ids[:, 1:].flatten())

    def backward(self, loss: torch.Tensor, *, sync: bool) -> None:
        with loss_parallel():
            super().backward(loss, sync=sync)


def build_tensor_parallel(ctx: EngineContext) -> Trainee:
    """The model split over its TP group, its blocks checkpointed as configured, sharded
    over the data-parallel ranks by FSDP2 (engine ``fsdp``) or alone in its group (``single``:
    no data-parallel rank)."""
    config = ctx.config
    tp = config.tp
    dp = ctx.world_size // tp
    mesh = init_device_mesh(ctx.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    model = build_model(ctx.model, config, checkpointing=False)
    apply_tensor_parallel(model, mesh["tp"])
    apply_activation_checkpointing(model, config.ac_every, config.ac_ops)
    fsdp = config.engine is Engine.FSDP
    if fsdp:
        mixed = config.precision is Precision.BF16_MIXED
        policy = MixedPrecisionPolicy(
            param_dtype=torch_dtype(config.precision) if mixed else None,
            reduce_dtype=torch.float32 if mixed else None,
        )
        reshard = config.zero_stage == 3
        for block in decoder_blocks(model):
            fully_shard(block, mesh=mesh["dp"], mp_policy=policy, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh["dp"], mp_policy=policy, reshard_after_forward=False)
    materialize(model, ctx.device, seed=ctx.seed)
    return _TensorParallelTrainee(model, model.parameters(), ctx, autocast=not fsdp)
