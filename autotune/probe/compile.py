"""Compiled decoder blocks: each block ``torch.compile``'d on its first call (after
checkpointing, as torchtitan compiles per block), on the device the call runs on.

On a GPU the block gets torch's default backend, inductor: AOT autograd traces the block's
forward and backward, the min-cut partitioner chooses what the backward keeps (it recomputes
cheap elementwise ops rather than keep their outputs), and inductor fuses the rest into
kernels. The compile itself happens in the probe's first (warm-up) step, so its time is the
probe's and the budget's.

On the CPU, where the probe counts live tensor bytes with a dispatch mode that
``torch.compile`` refuses to trace under, the block is compiled **emulated**: the same AOT
autograd and min-cut partitioner, but the partitioned forward and backward graphs run op by
op with the live-tensor counters entered (inductor's kernels do not run). What the backward
keeps, and so the memory effect of compiling, is counted; inductor's own buffer reuse and its
speed are not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

from autotune.probe.memory import LiveTensorBytes

_counters: list[LiveTensorBytes] = []
"""The counters that were entered where the compiled block was called (CPU)."""


def _counted(graph: torch.fx.GraphModule, _inputs: Sequence[Any]) -> Callable[..., Any]:
    """A compiler for AOT autograd that runs ``graph`` op by op under the probe's counters."""

    def run(args: list[Any]) -> Any:
        entered = _get_current_dispatch_mode_stack()
        with contextlib.ExitStack() as stack:
            for counter in _counters:
                if counter not in entered:
                    stack.enter_context(counter)
            return graph(*args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _counted_backend() -> Any:
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    return aot_autograd(
        fw_compiler=_counted, bw_compiler=_counted, partition_fn=min_cut_rematerialization_partition
    )


class CompiledBlock(nn.Module):
    """A decoder block compiled on its first call (see the module docstring)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block
        self._emulated: bool | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._emulated is None:
            first = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
            self._emulated = first.device.type == "cpu"
            if self._emulated:
                self.block.compile(backend=_counted_backend())
            else:
                self.block.compile()
        if not self._emulated:
            return self.block(*args, **kwargs)
        counters = [m for m in _get_current_dispatch_mode_stack() if isinstance(m, LiveTensorBytes)]
        _counters[:] = counters
        with _disable_current_modes():  # dynamo traces and runs guards with no mode entered
            return self.block(*args, **kwargs)


def apply_compile(blocks: nn.ModuleList) -> int:
    """Wrap every block of ``blocks`` (after checkpointing) to be compiled on its first call,
    in place; returns how many were wrapped."""
    for index, block in enumerate(blocks):
        blocks[index] = CompiledBlock(block)
    return len(blocks)
