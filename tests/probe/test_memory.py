"""Tests for autotune.probe.memory: the CPU live-tensor byte counter and the memory meter."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from autotune.config import Engine, TrainConfig
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


def test_storage_resized_in_place_is_followed() -> None:
    """UntypedStorage.resize_ bypasses the dispatcher (FSDP2 frees and re-allocates its
    unsharded parameters that way); the count follows it at once, with no op in between."""
    with LiveTensorBytes(limit_bytes=10000) as tracker:
        x = torch.empty(2000)  # 8000 bytes
        x.untyped_storage().resize_(0)
        assert tracker.live_bytes == 0
        y = torch.empty(1500)  # 6000 bytes: fits, as the 8000 were freed
        assert tracker.live_bytes == 6000
        x.untyped_storage().resize_(1000)
        assert tracker.live_bytes == 7000
        assert tracker.peak_bytes == 8000
        assert tracker.recount() == 7000
        del x, y


def test_storage_regrown_over_the_limit_raises_and_stays_empty() -> None:
    """Growing a storage past the limit raises at the resize, and leaves it as it was."""
    with LiveTensorBytes(limit_bytes=10000) as tracker:
        x = torch.empty(2000)
        x.untyped_storage().resize_(0)
        y = torch.empty(1500)
        with pytest.raises(torch.OutOfMemoryError, match="emulated"):
            x.untyped_storage().resize_(8000)
        assert x.untyped_storage().nbytes() == 0
        assert tracker.live_bytes == 6000
        assert tracker.recount() == 6000
        x.untyped_storage().resize_(4000)  # fits
        assert tracker.live_bytes == 10000
        del x, y


def test_resize_hook_lives_while_a_counter_is_entered() -> None:
    """The resize_ hook is installed on entering, shared by nested counters, removed after.

    What was there before is restored exactly: the C base class's method, or another tool's
    own override (torch's MemTracker leaves the plain method set on the class).
    """
    before = vars(torch.UntypedStorage).get("resize_")
    with LiveTensorBytes() as outer:
        x = torch.empty(100)
        with LiveTensorBytes() as inner:
            y = torch.empty(10)
            y.untyped_storage().resize_(80)
            x.untyped_storage().resize_(0)
            assert inner.live_bytes == 80  # x was made before the inner counter: not its own
        assert vars(torch.UntypedStorage).get("resize_") not in (None, before)
        assert outer.live_bytes == 80
        del x, y
    assert vars(torch.UntypedStorage).get("resize_") is before
    storage = torch.empty(10).untyped_storage()
    storage.resize_(0)  # plain resize_ again
    assert storage.nbytes() == 0


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


# Wrapper tensor subclasses and FSDP2 need a process group; these run in a fresh interpreter
# (this file as a script) so that the group and FSDP's global state stay out of the session.


def _run_isolated(*args: str) -> Any:
    """Run this file as a script with ``args``; returns the JSON it prints last."""
    done = subprocess.run(
        [sys.executable, __file__, *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_dtensor_counts_its_local_shard_not_the_wrapper() -> None:
    """A DTensor's own storage holds no data and reports the global size; what an op on it
    allocates is its local shard, and that is what is counted, and freed with it."""
    counts = _run_isolated("dtensor")
    assert counts["wrapper_storage_bytes"] == 8000  # 2000 float32 elements, globally
    assert counts["after_zeros_like"] == 4000  # the 1000-element local shard
    assert counts["after_del"] == 0


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_fsdp2_count_equals_the_live_storages(zero_stage: int) -> None:
    """FSDP2 (world size 1) on the tiny model, built and stepped twice under the counter: at
    each quiet point the count equals the distinct storages of every live tensor (DTensor
    shards, gradients, optimizer state), and the step peak stays within the model states plus
    an unsharded block or two (params 4P + grads 4P + Adam 8P = 16P, with P parameters)."""
    report = _run_isolated("fsdp", str(zero_stage))
    params = report["params"]
    for point in report["points"]:
        assert point["counted"] == point["recounted"], point  # no stale size
        assert point["counted"] == pytest.approx(point["walked"], rel=0.01), point
    after_build, *steps = report["points"]
    assert after_build["counted"] == pytest.approx(4 * params, rel=0.01)  # fp32 weights
    for step in steps:
        assert step["counted"] == pytest.approx(12 * params, rel=0.01)  # + two Adam moments
        assert step["peak"] < 20 * params, step


def test_fsdp2_probe_step_peak(run_probe: Any) -> None:
    """Through the probe worker: FSDP2 zero 3 at one rank peaks below 20 bytes a parameter."""
    result = run_probe(
        TrainConfig(engine=Engine.FSDP, zero_stage=3), micro_batch_sizes=(1,), seq_len=16
    )
    assert result.sizes, result
    report = json.loads((result.probe_dir / "rank0.json").read_text())
    params = report["num_params"]
    assert report["build_memory"]["peak_allocated_bytes"] < 4.1 * params
    assert result.sizes[0].peak_allocated_bytes < 20 * params


def _reachable_storages() -> dict[int, int]:
    """Data pointer to size of the distinct storages of every tensor the collector reaches."""
    from torch.distributed.tensor import DTensor

    gc.collect()
    sizes: dict[int, int] = {}
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor):
            continue
        tensor = obj._local_tensor if isinstance(obj, DTensor) else obj
        if tensor.is_meta:
            continue
        try:
            storage = tensor.untyped_storage()
            pointer = storage.data_ptr()
        except (RuntimeError, NotImplementedError):
            continue  # other wrapper subclasses: their inner tensors are reached themselves
        if pointer:
            sizes[pointer] = max(sizes.get(pointer, 0), storage.nbytes())
    return sizes


def _isolated_dtensor() -> dict[str, int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (1,))
    # A shard of 1000 elements of a 2000-element tensor: the wrapper is twice its shard.
    sharded = DTensor.from_local(
        torch.ones(1000), mesh, [Shard(0)], run_check=False, shape=torch.Size([2000]), stride=(1,)
    )
    with LiveTensorBytes() as tracker:
        zeros = torch.zeros_like(sharded)
        after_zeros_like = tracker.live_bytes
        del zeros
        return {
            "wrapper_storage_bytes": sharded.untyped_storage().nbytes(),
            "after_zeros_like": after_zeros_like,
            "after_del": tracker.live_bytes,
        }


def _isolated_fsdp(zero_stage: int) -> dict[str, Any]:
    from autotune.models import resolve_model
    from autotune.probe.data import synthetic_batch
    from autotune.probe.engines import build_trainee
    from autotune.probe.engines.base import EngineContext

    model = resolve_model("tiny")
    before = _reachable_storages()
    points = []

    def point(tracker: LiveTensorBytes) -> None:
        reachable = _reachable_storages()
        counted = tracker.live_bytes
        points.append(
            {
                "counted": counted,
                "recounted": tracker.recount(),
                "walked": sum(size for ptr, size in reachable.items() if ptr not in before),
                "peak": tracker.peak_bytes,
            }
        )

    with LiveTensorBytes() as tracker:
        context = EngineContext(
            model=model,
            config=TrainConfig(engine=Engine.FSDP, zero_stage=zero_stage),
            device=torch.device("cpu"),
            rank=0,
            world_size=1,
            micro_batch_size=1,
            grad_accum=1,
            lr=1e-4,
            seed=0,
        )
        trainee = build_trainee(context)
        point(tracker)
        batch = synthetic_batch(model, 1, 16, seed=0)
        for _ in range(2):
            tracker.reset_peak()
            loss = trainee.forward(batch, sync=True)
            trainee.backward(loss, sync=True)
            trainee.optimizer_step()
            del loss
            point(tracker)
    return {"params": model.num_params, "points": points}


if __name__ == "__main__":
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as store_dir:
        store = dist.FileStore(str(Path(store_dir) / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            if sys.argv[1] == "dtensor":
                print(json.dumps(_isolated_dtensor()))
            else:
                print(json.dumps(_isolated_fsdp(int(sys.argv[2]))))
        finally:
            dist.destroy_process_group()
