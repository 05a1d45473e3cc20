"""The contract between the probe's step loop and a training engine."""

from __future__ import annotations

import abc
import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from autotune.config import ADAMW_DEFAULTS, OPTIMIZER_8BIT_BLOCK, Optimizer, Precision, TrainConfig
from autotune.models import ModelSpec
from autotune.probe.memory import compiled_region


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineContext:
    """Everything an engine needs to build itself in one rank."""

    model: ModelSpec
    config: TrainConfig
    device: torch.device
    rank: int
    world_size: int
    micro_batch_size: int
    """First micro-batch size of the probe (DeepSpeed wants one in its config)."""
    grad_accum: int
    lr: float
    seed: int


class Trainee(abc.ABC):
    """A model wrapped by an engine, trained one phase at a time so each can be timed.

    The step loop calls, per optimizer step, ``grad_accum`` times ``forward`` then
    ``backward`` (``sync`` true on the last micro-step only, when gradients are reduced),
    then ``optimizer_step`` once. ``discard_gradients`` drops partial state after an OOM.
    Not thread-safe; one per rank.
    """

    model: nn.Module
    pipelined: bool = False
    """Whether a step runs all its micro-steps in one call (:meth:`pipeline_step`: a
    pipeline's schedule) instead of ``forward`` and ``backward`` a micro-step."""

    def pipeline_step(self, input_ids: torch.Tensor, microbatches: int) -> torch.Tensor:
        """Forward and backward of ``microbatches`` micro-steps at once (a pipelined
        trainee's); their mean loss."""
        raise NotImplementedError(f"{type(self).__name__} runs a micro-step at a time")

    @abc.abstractmethod
    def forward(self, input_ids: torch.Tensor, *, sync: bool) -> torch.Tensor:
        """Loss of one micro-batch (labels are the inputs, shifted inside the model)."""

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor, *, sync: bool) -> None:
        """Gradients of the loss; reduced over ranks when ``sync``."""

    @abc.abstractmethod
    def optimizer_step(self) -> None:
        """Apply and clear the accumulated gradients."""

    def discard_gradients(self) -> None:
        """Forget gradients of a failed step (called after an OOM, before the next size)."""
        for param in self.model.parameters():
            param.grad = None


_TORCH_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}


def torch_dtype(precision: Precision) -> torch.dtype:
    """The torch dtype the matmuls run in under ``precision`` (its ``compute_dtype``)."""
    return _TORCH_DTYPES[precision.compute_dtype]


def cast_weights(model: nn.Module, config: TrainConfig) -> None:
    """Pure bf16 keeps the weights themselves in bf16; the mixed precisions keep fp32 ones.
    Under LoRA the frozen weights are in the compute dtype (but in fp32) and the adapters in
    fp32, as peft leaves them over a 16-bit model."""
    precision = config.precision
    if config.is_lora:
        if precision is not Precision.FP32:
            model.to(torch_dtype(precision))
            for param in trainable(model):
                param.data = param.data.float()
    elif precision is Precision.BF16:
        model.to(torch_dtype(precision))


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the optimizer steps: all of them, or LoRA's adapters alone."""
    return [param for param in model.parameters() if param.requires_grad]


def autocast_context(
    config: TrainConfig, device: torch.device
) -> contextlib.AbstractContextManager:
    """Autocast for engines that keep fp32 weights and cast per op (single, ddp)."""
    if not config.precision.is_mixed:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch_dtype(config.precision))


def build_optimizer(
    params: Iterable[nn.Parameter], optimizer: Optimizer, lr: float
) -> torch.optim.Optimizer:
    """The optimizer a configuration names, over ``params``.

    Fused AdamW is one kernel per parameter group and no temporaries, what launchers use by
    default (Hugging Face Trainer's ``adamw_torch_fused``), on CUDA and on the CPU alike.
    torchao's AdamW8bit (Hugging Face's ``adamw_torch_8bit``) steps each tensor in a kernel
    torch.compile makes at its first step (one per shape: part of the probe's warm-up). Betas,
    eps and weight decay are every export's (:data:`~autotune.config.ADAMW_DEFAULTS`).
    """
    values = {k: v for k, v in ADAMW_DEFAULTS.items() if k != "lr"}
    if optimizer is Optimizer.ADAMW_8BIT:
        logging.getLogger("torchao").setLevel(logging.ERROR)  # its CUDA-only kernels, on a CPU
        from torchao.optim import AdamW8bit

        return AdamW8bit(params, lr=lr, block_size=OPTIMIZER_8BIT_BLOCK, **values)
    return torch.optim.AdamW(params, lr=lr, fused=True, **values)


def optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors of an optimizer's state (moments, step counts)."""
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


class TorchTrainee(Trainee):
    """A torch module with a torch AdamW: the shared body of the single, ddp and fsdp engines."""

    def __init__(
        self,
        model: nn.Module,
        params: Iterable[nn.Parameter],
        ctx: EngineContext,
        *,
        autocast: bool,
    ) -> None:
        self.model = model
        self._device = ctx.device
        self._config = ctx.config
        self._autocast = autocast
        self.optimizer = build_optimizer(params, ctx.config.optimizer, ctx.lr)
        # fp16 needs dynamic loss scaling so small gradients do not flush to zero.
        self.scaler = (
            torch.amp.GradScaler(ctx.device.type)
            if ctx.config.precision is Precision.FP16_MIXED
            else None
        )

    def prepare_sync(self, sync: bool) -> None:
        """Engine hook: tell the wrapper whether this micro-step reduces gradients."""

    def casting(self) -> contextlib.AbstractContextManager:
        """Autocast where this engine casts per op (single, ddp), else nothing."""
        if self._autocast:
            return autocast_context(self._config, self._device)
        return contextlib.nullcontext()

    def forward(self, input_ids: torch.Tensor, *, sync: bool) -> torch.Tensor:
        self.prepare_sync(sync)
        with self.casting():
            return self.model(input_ids=input_ids, labels=input_ids).loss

    def backward(self, loss: torch.Tensor, *, sync: bool) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def optimizer_step(self) -> None:
        compiled = self._config.optimizer is Optimizer.ADAMW_8BIT  # its kernels: torch.compile
        with (
            compiled_region(lambda: optimizer_state(self.optimizer))
            if compiled
            else contextlib.nullcontext()
        ):
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def discard_gradients(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
