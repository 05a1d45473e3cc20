"""Activation offload: what the decoder blocks save for the backward, kept in host memory.

Each decoder block runs under saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``)
that copy every tensor autograd saves to host memory as it is saved and bring it back to the
device when the backward unpacks it, one node at a time. Kept on the device, as torchtune's
and TRL's activation offloading keep them: parameters, autocast's 16-bit copies of them (the
weights would cross the link twice a step for nothing: autocast's cache holds them through
the forward anyway), and tensors under :data:`MIN_OFFLOAD_BYTES`. A block checkpointed whole
saves only its input through these hooks (the non-reentrant checkpoint saves its positional
inputs as saved tensors before its own hooks take over), so offload then moves the
checkpoints themselves.

On a GPU the host copies are pinned (the caching host allocator's pool, which rounds each up
to a power of two) and the copies synchronous one way, ``non_blocking`` the other. On the CPU,
where device and host are the same memory, the host side is **emulated**: the copy is made
with the live-tensor counters stepped aside, so the emulated device no longer counts it, and
:data:`HOST_POOL` counts it instead. Either way :data:`HOST_POOL` has the bytes held on the
host, which the rank's memory readings report (``offloaded_activation_peak_bytes``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

MIN_OFFLOAD_BYTES = 1024
"""Tensors smaller than this stay on the device (their copy costs more than it frees)."""


class HostPool:
    """Bytes of saved tensors held on the host, live and at their peak (one per process)."""

    def __init__(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0

    def reset_peak(self) -> None:
        """Start a new peak window at the current live size."""
        self.peak_bytes = self.live_bytes

    def _add(self, host: torch.Tensor) -> None:
        nbytes = host.untyped_storage().nbytes()
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(host, self._release, nbytes)

    def _release(self, nbytes: int) -> None:
        self.live_bytes -= nbytes


HOST_POOL = HostPool()


_WEIGHT_VIEWS = frozenset({"ToCopyBackward0", "TBackward0", "TransposeBackward0", "ViewBackward0"})
"""The autograd nodes between a parameter and what a layer saves of it: autocast's cast, a
linear layer's transpose."""


def _is_weight(tensor: torch.Tensor) -> bool:
    """A parameter, autocast's cast of one, or a view of either (a chain of single-input
    casts and views that ends at a leaf's gradient accumulator)."""
    if isinstance(tensor, nn.Parameter):
        return True
    node = tensor.grad_fn
    for _ in range(3):
        if node is None or node.name() not in _WEIGHT_VIEWS:
            return False
        inputs = [n for n, _ in node.next_functions if n is not None]
        if len(inputs) != 1:
            return False
        node = inputs[0]
        if type(node).__name__ == "AccumulateGrad":
            return True
    return False


class _Packed:
    """A saved tensor's host copy, the device it goes back to, and the storage it copies
    (weakly: while that lives, no other tensor can have its address)."""

    __slots__ = ("__weakref__", "device", "host", "source")

    def __init__(self, tensor: torch.Tensor, host: torch.Tensor) -> None:
        self.device = tensor.device
        self.host = host
        self.source = weakref.ref(tensor.untyped_storage())


_copies: weakref.WeakValueDictionary[tuple[Any, ...], _Packed] = weakref.WeakValueDictionary()
"""Host copies still saved, by the tensor they copy: a tensor saved by several ops (a norm's
input by its power and its product) crosses the link and takes host memory once."""


def _pack(tensor: torch.Tensor) -> Any:
    if tensor.untyped_storage().nbytes() < MIN_OFFLOAD_BYTES or _is_weight(tensor):
        return tensor
    key = (
        tensor.untyped_storage()._cdata,
        tensor.storage_offset(),
        tuple(tensor.shape),
        tensor.stride(),
        tensor.dtype,
        tensor._version,
    )
    packed = _copies.get(key)
    if packed is None or packed.source() is None:  # a freed storage's address, reused
        packed = _copies[key] = _copy_out(tensor)
    return packed


def _copy_out(tensor: torch.Tensor) -> _Packed:
    if tensor.device.type == "cpu":
        with _disable_current_modes():  # the emulated host: not the device's bytes
            host = tensor.detach().clone()
    else:
        host = torch.empty_like(tensor, device="cpu", pin_memory=torch.cuda.is_available())
        host.copy_(tensor.detach())
    HOST_POOL._add(host)
    return _Packed(tensor, host)


def _unpack(packed: Any) -> torch.Tensor:
    if not isinstance(packed, _Packed):
        return packed
    if packed.device.type == "cpu":
        return packed.host.clone()  # counted again: back on the emulated device
    return packed.host.to(packed.device, non_blocking=True)


class OffloadedBlock(nn.Module):
    """A decoder block whose saved tensors are kept on the host (see the module docstring)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            return self.block(*args, **kwargs)


def apply_activation_offload(blocks: nn.ModuleList) -> int:
    """Wrap every block of ``blocks`` (after checkpointing, so a checkpointed block's input is
    offloaded too), in place; returns how many were wrapped."""
    for index, block in enumerate(blocks):
        blocks[index] = OffloadedBlock(block)
    return len(blocks)
