"""Tests for autotune.probe.memory: the CPU live-tensor byte counter and the memory meter."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from autotune.probe.memory import LiveTensorBytes, MemoryMeter
from autotune.probe.outcome import is_oom_error

KIB = 1024


def test_counts_a_new_tensor() -> None:
    """A tensor created inside the mode is counted at its storage size."""
    with LiveTensorBytes() as tracker:
        x = torch.empty(1000, dtype=torch.float32)
        assert tracker.live_bytes == 4000
        assert tracker.peak_bytes == 4000
        y = torch.zeros(10, dtype=torch.float64)
        assert tracker.live_bytes == 4080
        del x, y


def test_views_are_counted_once() -> None:
    """Views, slices, transposes and in-place ops share the storage: still counted once."""
    with LiveTensorBytes() as tracker:
        x = torch.zeros(100, 10)
        views = [x.view(10, 100), x[:5], x.t(), x.reshape(1000), x.unsqueeze(0), x[::2]]
        x.add_(1.0)
        views[0].mul_(2.0)
        assert tracker.live_bytes == 4000
        assert tracker.recount() == 4000
        del views, x


def test_freed_tensor_is_dropped() -> None:
    """When the last reference (views included) dies, its bytes leave the live total."""
    with LiveTensorBytes() as tracker:
        keep = torch.ones(256)
        x = torch.empty(1000)
        view = x[10:20]
        del x
        assert tracker.live_bytes == 1024 + 4000  # the view keeps the storage alive
        del view
        assert tracker.live_bytes == 1024
        assert tracker.peak_bytes == 5024
        del keep
        assert tracker.live_bytes == 0


def test_temporaries_are_freed() -> None:
    """Intermediates of an expression are counted while alive and dropped after."""
    with LiveTensorBytes() as tracker:
        a = torch.ones(1000)
        b = (a * 2 + 1).sum()  # a*2 and +1 are 4000-byte temporaries
        assert tracker.live_bytes == 4000 + b.untyped_storage().nbytes()
        assert tracker.peak_bytes >= 3 * 4000
        del a, b


def test_tensors_created_before_entering_are_not_counted() -> None:
    """Only storages produced inside the mode are counted."""
    outside = torch.ones(1000)
    with LiveTensorBytes() as tracker:
        inside = torch.ones(10)
        assert tracker.live_bytes == 40
        del inside
    del outside


def test_raises_oom_above_limit() -> None:
    """Passing the limit raises torch.OutOfMemoryError saying the OOM is emulated."""
    with LiveTensorBytes(limit_bytes=10 * KIB) as tracker:
        a = torch.empty(2 * KIB, dtype=torch.uint8)
        with pytest.raises(torch.OutOfMemoryError) as caught:
            torch.empty(9 * KIB, dtype=torch.uint8)
        message = str(caught.value)
        assert "emulated" in message
        assert "tried to allocate 9.00 KiB" in message
        assert "of the 10.00 KiB limit" in message
        assert is_oom_error(caught.value)
        del caught  # its traceback's frames hold the tensor that was allocated
        gc.collect()
        assert tracker.recount() == 2 * KIB  # the failed allocation holds nothing
        b = torch.empty(8 * KIB, dtype=torch.uint8)  # exactly at the limit is allowed
        assert tracker.live_bytes == 10 * KIB
        del a, b


def test_limit_counts_everything_live_not_one_allocation() -> None:
    """Many small tensors add up to an OOM."""
    with LiveTensorBytes(limit_bytes=4000) as tracker:
        kept = []
        with pytest.raises(torch.OutOfMemoryError):
            for _ in range(20):
                kept.append(torch.empty(100))  # 400 bytes each
        assert len(kept) == 10
        assert tracker.live_bytes <= 4000 + 400
        del kept


def test_garbage_in_reference_cycles_is_collected_before_an_oom() -> None:
    """Storages only held by unreachable cycles do not cause an OOM."""

    class Node:
        def __init__(self) -> None:
            self.other: Node | None = None
            self.data = torch.empty(2000)  # 8000 bytes

    gc.disable()
    try:
        with LiveTensorBytes(limit_bytes=16000) as tracker:
            a, b = Node(), Node()
            a.other, b.other = b, a
            del a, b  # 16000 bytes now garbage, held only by the cycle
            c = torch.empty(2000)  # 8000 bytes: fits once the cycle is collected
            assert tracker.live_bytes == 8000
            del c
    finally:
        gc.enable()


def test_peak_and_reset_peak() -> None:
    """The peak holds the high-water mark; reset_peak restarts it at the live size."""
    with LiveTensorBytes() as tracker:
        keep = torch.empty(500)
        big = torch.empty(5000)
        del big
        assert tracker.live_bytes == 2000
        assert tracker.peak_bytes == 22000
        tracker.reset_peak()
        assert tracker.peak_bytes == 2000
        small = torch.empty(100)
        assert tracker.peak_bytes == 2400
        del small, keep


def test_storage_resized_in_place_is_no_false_oom() -> None:
    """A storage shrunk with resize_(0) (as FSDP2 frees unsharded parameters) is recounted
    before an OOM is raised, so its old size does not count against the limit."""
    with LiveTensorBytes(limit_bytes=10000) as tracker:
        x = torch.empty(2000)  # 8000 bytes
        x.untyped_storage().resize_(0)  # not a tensor op: the count is stale
        y = torch.empty(1500)  # 6000 bytes: 14000 by the stale count, 6000 for real
        assert tracker.live_bytes == 6000
        assert tracker.recount() == 6000
        assert tracker.peak_bytes >= 6000
        del x, y


def test_storage_regrown_in_place_is_recounted() -> None:
    """A storage grown back in place is counted at its new size once seen again."""
    with LiveTensorBytes() as tracker:
        x = torch.empty(2000)
        x.untyped_storage().resize_(0)
        assert tracker.recount() == 0
        x.untyped_storage().resize_(8000)
        x.zero_()  # the next op that outputs it re-reads its size
        assert tracker.live_bytes == 8000
        del x


def test_regrown_storage_over_the_limit_raises() -> None:
    """Growing a storage back past the limit is an OOM when it is next seen."""
    with LiveTensorBytes(limit_bytes=10000) as tracker:
        x = torch.empty(2000)
        x.untyped_storage().resize_(0)
        y = torch.empty(1500)
        x.untyped_storage().resize_(8000)
        with pytest.raises(torch.OutOfMemoryError, match="emulated"):
            x.zero_()
        assert tracker.recount() == 14000
        del x, y


def test_meta_tensors_are_free() -> None:
    """Meta tensors have no memory."""
    with LiveTensorBytes(limit_bytes=1) as tracker:
        m = torch.empty(10**9, device="meta")
        assert tracker.live_bytes == 0
        del m


def test_linear_forward_backward() -> None:
    """Through a real nn.Linear: weights, activations and gradients are counted and dropped;
    building past a limit raises."""
    torch.manual_seed(0)
    with LiveTensorBytes() as tracker:
        layer = nn.Linear(256, 256)
        param_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
        assert tracker.live_bytes == param_bytes
        x = torch.randn(64, 256, requires_grad=True)
        loss = layer(x).square().mean()
        after_forward = tracker.live_bytes
        assert after_forward > param_bytes + x.numel() * 4  # activations kept for backward
        loss.backward()
        assert layer.weight.grad is not None
        grad_bytes = param_bytes + x.numel() * 4  # parameter grads and the input's
        assert tracker.live_bytes >= param_bytes + x.numel() * 4 + grad_bytes
        assert tracker.peak_bytes >= tracker.live_bytes
        del loss
        assert tracker.recount() == tracker.live_bytes
        layer.zero_grad(set_to_none=True)
        x.grad = None
        assert tracker.live_bytes == param_bytes + x.numel() * 4
        del x, layer
        assert tracker.live_bytes == 0

    with LiveTensorBytes(limit_bytes=400 * KIB), pytest.raises(torch.OutOfMemoryError):
        held: list[object] = [nn.Linear(256, 256)]  # 257 KiB of parameters
        held.append(torch.randn(256, 256))  # 256 KiB more: over the limit


def test_linear_forward_backward_oom() -> None:
    """A forward whose activations pass the limit raises; after freeing, a smaller batch fits."""
    torch.manual_seed(0)
    limit = 1100 * KIB  # parameters and their gradients (2 x 514 KiB) plus a little
    with LiveTensorBytes(limit_bytes=limit) as tracker:
        layer = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256))
        with pytest.raises(torch.OutOfMemoryError, match="emulated"):
            layer(torch.randn(64, 256)).sum().backward()  # 64 KiB per activation
        gc.collect()
        assert tracker.recount() <= limit
        layer.zero_grad(set_to_none=True)
        layer(torch.randn(4, 256)).sum().backward()
        assert all(p.grad is not None for p in layer.parameters())
        del layer


def test_backward_runs_under_the_mode() -> None:
    """Gradients produced by the autograd engine are counted too."""
    with LiveTensorBytes() as tracker:
        w = torch.zeros(1000, requires_grad=True)
        before = tracker.live_bytes
        (w * 2).sum().backward()
        assert w.grad is not None
        assert tracker.live_bytes >= before + 4000
        del w


def test_memory_meter_on_cpu() -> None:
    """MemoryMeter reports the tracker's peak as allocated and reserved, per window."""
    with LiveTensorBytes(limit_bytes=10**6) as tracker:
        meter = MemoryMeter(device=torch.device("cpu"), tracker=tracker, emulated_limit_bytes=10**6)
        keep = torch.empty(1000)
        big = torch.empty(10000)
        del big
        reading = meter.read()
        assert reading["peak_allocated_bytes"] == 44000
        assert reading["peak_reserved_bytes"] == 44000
        assert reading["memory_source"] == "cpu-live-tensor-bytes"
        assert reading["emulated_limit_bytes"] == 10**6
        assert reading["host_rss_bytes"] > 0
        assert reading["host_peak_rss_bytes"] >= reading["host_rss_bytes"] // 2
        meter.reset()
        assert meter.read()["peak_allocated_bytes"] == 4000
        del keep


def test_memory_meter_without_tracker() -> None:
    """Without a tracker (CPU, no emulation) only host memory is read."""
    reading = MemoryMeter(device=torch.device("cpu")).read()
    assert reading["host_rss_bytes"] > 0
    assert "peak_allocated_bytes" not in reading
