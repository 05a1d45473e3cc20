"""Pipeline parallelism (torch's ``torch.distributed.pipelining``): the layout ``pp`` of a
configuration, one pipeline over all ranks.

The decoder blocks split into ``pp * pp_virtual`` chunks of consecutive blocks (a chunk holds
a block more than another where they do not split evenly); rank ``r`` holds chunks ``r``,
``r + pp``, ... (the interleaved schedule's loop placement, as torchtitan places them), the
first chunk the embedding, the last the final norm and the output layer. Each chunk is a
stage module over the model's own blocks, so the blocks are checkpointed as configured and
initialized as the whole model would be. A step is one call of the schedule (GPipe, 1F1B or
interleaved 1F1B) over the step's microbatches; the loss is the model's (the fp32 upcast of
the logits) on the last stage, its microbatches' mean broadcast to every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from autotune.config import Schedule
from autotune.layouts import chunk_bounds
from autotune.probe.engines.base import (
    EngineContext,
    TorchTrainee,
    cast_weights,
)
from autotune.probe.modeling import (
    apply_activation_checkpointing,
    build_model,
    decoder_blocks,
    materialize,
)

_SCHEDULES = {Schedule.GPIPE: ScheduleGPipe, Schedule.ONE_F_ONE_B: Schedule1F1B}


class _Chunk(nn.Module):
    """One stage's share of a Hugging Face llama-style causal LM."""

    embed_tokens: Any
    norm: Any
    lm_head: Any

    def __init__(self, model: Any, blocks: Sequence[nn.Module], first: bool, last: bool):
        super().__init__()
        inner = model.model
        self.embed_tokens = inner.embed_tokens if first else None
        self.rotary_emb: Any = inner.rotary_emb
        self.blocks = nn.ModuleList(blocks)
        self.norm = inner.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            hidden = self.embed_tokens(hidden)
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        rotary = self.rotary_emb(hidden, positions)
        for block in self.blocks:
            # No mask: torch's SDPA runs causal, as the whole model without padding does.
            hidden = block(
                hidden, attention_mask=None, position_ids=positions, position_embeddings=rotary
            )
        if self.norm is not None and self.lm_head is not None:
            hidden = self.lm_head(self.norm(hidden))
        return hidden


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The model's own loss: next-token cross-entropy on the fp32 upcast of the logits."""
    shifted = logits[:, :-1].flatten(0, 1).float()
    return F.cross_entropy(shifted, labels[:, 1:].flatten())


class PipelineTrainee(TorchTrainee):
    """A rank's chunks and, for each micro-batch size, the stages and schedule that run a
    step's microbatches through them (a stage's buffers are sized by its first batch)."""

    pipelined = True

    def __init__(
        self, ctx: EngineContext, chunks: Sequence[tuple[int, nn.Module]], count: int
    ) -> None:
        modules = [module for _, module in chunks]
        params = [param for module in modules for param in module.parameters()]
        super().__init__(nn.ModuleList(modules), params, ctx, autocast=True)
        self._chunks = list(chunks)
        self._count = count
        self._first = any(index == 0 for index, _ in chunks)
        self._last = any(index == count - 1 for index, _ in chunks)
        self._last_rank = (count - 1) % ctx.config.pp  # loop placement
        self._schedules: dict[tuple[int, int], Any] = {}

    def _schedule(self, microbatches: int, size: int) -> Any:
        key = (microbatches, size)
        if key not in self._schedules:
            self._schedules.clear()  # one size at a time: the last size's buffers go
            stages: list[Any] = [
                PipelineStage(module, index, self._count, self._device)
                for index, module in self._chunks
            ]
            kind = self._config.pp_schedule
            if kind is Schedule.INTERLEAVED_1F1B:
                made: Any = ScheduleInterleaved1F1B(
                    stages, n_microbatches=microbatches, loss_fn=_loss
                )
            else:
                made = _SCHEDULES[kind](stages[0], n_microbatches=microbatches, loss_fn=_loss)
            self._schedules[key] = made
        return self._schedules[key]

    def forward(self, input_ids: torch.Tensor, *, sync: bool) -> torch.Tensor:
        raise NotImplementedError("a pipeline runs a whole step: pipeline_step()")

    def pipeline_step(self, input_ids: torch.Tensor, microbatches: int) -> torch.Tensor:
        """Forward and backward of ``microbatches`` micro-batches of ``input_ids`` through
        the pipeline; their mean loss, on every rank."""
        schedule = self._schedule(microbatches, input_ids.shape[0])
        batch = torch.cat([input_ids] * microbatches)
        losses: list[torch.Tensor] = []
        # A trainer needs no outputs back: the schedule then keeps none past their backward.
        extra: dict[str, Any] = {"return_outputs": False}
        if self._last:
            extra.update(target=batch, losses=losses)
        with self.casting():
            if self._first:
                schedule.step(batch, **extra)
            else:
                schedule.step(**extra)
        mean = torch.stack(losses).mean().detach() if losses else torch.zeros(())
        mean = mean.to(self._device)
        dist.broadcast(mean, src=self._last_rank)
        return mean


def build_pipeline(ctx: EngineContext) -> PipelineTrainee:
    """This rank's chunks of the model, checkpointed as configured, on its device."""
    config = ctx.config
    pp, virtual = config.pp, config.pp_virtual
    chunks = pp * virtual
    model: Any = build_model(ctx.model, config, checkpointing=False)
    blocks = decoder_blocks(model)
    bounds = chunk_bounds(len(blocks), chunks)
    owned = [ctx.rank + k * pp for k in range(virtual)]
    kept = [index for chunk in owned for index in bounds[chunk]]
    inner = model.model
    inner.layers = nn.ModuleList(blocks[i] for i in kept)  # the others are dropped on meta
    if 0 not in owned:
        inner.embed_tokens = None
    if chunks - 1 not in owned:
        inner.norm = None
        model.lm_head = None
    apply_activation_checkpointing(model, config.ac_every, config.ac_ops)
    model.config.tie_word_embeddings = False  # the tables sit apart (tied models: refused)
    materialize(model, ctx.device, seed=ctx.seed)
    cast_weights(model, config)
    mine = decoder_blocks(model)
    chunks_here: list[tuple[int, nn.Module]] = []
    start = 0
    for chunk in owned:
        count = len(bounds[chunk])
        module = _Chunk(model, list(mine[start : start + count]), chunk == 0, chunk == chunks - 1)
        start += count
        chunks_here.append((chunk, module))
    return PipelineTrainee(ctx, chunks_here, chunks)
