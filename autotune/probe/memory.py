"""Device memory inside a probe: the emulated limit, and the honest peak readings.

``--device-memory 20GiB`` caps what a probe may use. On CUDA that is the caching allocator's
own per-process fraction, so OOMs are the real ones. On CPU, where there is no device, a
dispatch mode (:class:`LiveTensorBytes`) counts the bytes of every live tensor storage and
raises the same ``torch.OutOfMemoryError`` a GPU would when the cap is passed: the tests and
CPU users get real OOM paths through the real engines. Every reading says whether it comes
from that emulation.
"""

from __future__ import annotations

import contextlib
import gc
import resource
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Self

import psutil
import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
    _get_current_dispatch_mode_stack,
    is_traceable_wrapper_subclass,
)
from torch.utils._pytree import tree_flatten

from autotune.probe.offload import HOST_POOL
from autotune.units import format_bytes


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of live tensor storages; raises an OOM above ``limit_bytes``.

    Every op's outputs are inspected; a storage is counted once, at its current size, until
    its last reference dies (storage Python objects are preserved while the C++ storage
    lives, so a weakref finalizer sees the real free). Wrapper tensor subclasses such as
    ``DTensor`` own no memory: their storage has no data pointer but reports the wrapper's
    (global) size. They are looked through to the inner tensors they hold (a DTensor's local
    shard), which are the ones counted; the inner tensors are invisible otherwise, since the
    subclass allocates them while this mode is off the dispatch stack. Storages resized in
    place with ``UntypedStorage.resize_``, which bypasses the dispatcher (FSDP2 frees and
    re-allocates its all-gather buffers that way), are observed through a hook installed
    while the mode is entered; the total is recomputed from scratch before an OOM is raised,
    so a stale count never causes a false OOM. Tensors created before the mode was entered
    are not counted: enter it before the model is built.
    """

    def __init__(self, limit_bytes: int | None = None) -> None:
        super().__init__()
        self.limit_bytes = limit_bytes
        self._live: dict[int, tuple[weakref.ref[torch.UntypedStorage], int]] = {}
        self._aside: set[int] = set()
        """Storages :meth:`set_aside` took out of the count, while they live."""
        self.live_bytes = 0
        self.peak_bytes = 0

    def __enter__(self) -> Self:
        _resize_hook.add(self)
        try:
            return super().__enter__()
        except BaseException:
            _resize_hook.remove(self)
            raise

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        try:
            super().__exit__(exc_type, exc_val, exc_tb)
        finally:
            _resize_hook.remove(self)

    def reset_peak(self) -> None:
        """Start a new peak window at the current live size."""
        self.recount()
        self.peak_bytes = self.live_bytes

    def recount(self) -> int:
        """Recompute the live total from each storage's current size."""
        total = 0
        for key, (ref, _) in list(self._live.items()):
            storage = ref()
            if storage is None:
                continue
            nbytes = storage.nbytes()
            self._live[key] = (ref, nbytes)
            total += nbytes
        self.live_bytes = total
        return total

    def _forget(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.live_bytes -= entry[1]

    def set_aside(self, storage: torch.UntypedStorage) -> int:
        """Stop counting ``storage`` for as long as it lives (what a GPU run keeps in host
        memory: a data set held as one tensor); the bytes it no longer counts."""
        key = storage._cdata
        if key in self._aside:
            return 0
        self._aside.add(key)
        weakref.finalize(storage, self._aside.discard, key)
        entry = self._live.pop(key, None)
        if entry is None:
            return 0
        self.live_bytes -= entry[1]
        return entry[1]

    def counts(self, storage: torch.UntypedStorage) -> bool:
        """Whether ``storage`` is live in the count."""
        return storage._cdata in self._live

    def _track(self, storage: torch.UntypedStorage) -> None:
        if storage.device.type == "meta":
            return
        key = storage._cdata
        if key in self._aside:
            return
        nbytes = storage.nbytes()
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = (weakref.ref(storage), nbytes)
            weakref.finalize(storage, self._forget, key)
            self.live_bytes += nbytes
        elif entry[1] != nbytes:
            self._live[key] = (entry[0], nbytes)
            self.live_bytes += nbytes - entry[1]
        else:
            return
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        if self.limit_bytes is not None and self.live_bytes > self.limit_bytes:
            self._raise_if_over(nbytes)

    def _track_tensor(self, tensor: torch.Tensor) -> None:
        if type(tensor) is torch.Tensor or type(tensor) is torch.nn.Parameter:
            self._track(tensor.untyped_storage())  # the common case: no subclass checks
        elif is_traceable_wrapper_subclass(tensor):
            for name in tensor.__tensor_flatten__()[0]:
                inner = getattr(tensor, name)
                if isinstance(inner, torch.Tensor) and not inner.is_meta:
                    self._track_tensor(inner)
        else:
            try:
                storage = tensor.untyped_storage()
                storage.data_ptr()  # raises for a wrapper's storage, which holds no data
            except (RuntimeError, NotImplementedError):
                return  # a subclass with no memory of its own, and no inner tensors to see
            self._track(storage)

    def _track_resized(self, storage: torch.UntypedStorage) -> None:
        """Account for ``storage`` after ``UntypedStorage.resize_`` changed its allocation."""
        if storage.nbytes() == 0 and storage._cdata not in self._live:
            return  # emptying a storage this counter never saw changes nothing
        self._track(storage)

    def _raise_if_over(self, requested: int) -> None:
        assert self.limit_bytes is not None
        if self.recount() <= self.limit_bytes:
            return
        gc.collect()  # reference cycles hold storages that are already garbage
        if self.recount() <= self.limit_bytes:
            return
        raise torch.OutOfMemoryError(
            f"emulated device out of memory: tried to allocate {format_bytes(requested)}; "
            f"{format_bytes(self.live_bytes)} live of the {format_bytes(self.limit_bytes)} "
            "limit (--device-memory emulation)"
        )

    supports_higher_order_operators = True
    """A higher-order operator (a compiled, checkpointed block's ``run_and_save_rng_state``)
    runs as any op: its outputs are counted."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor) and not leaf.is_meta:
                self._track_tensor(leaf)
        return out


@contextlib.contextmanager
def compiled_region(made: Callable[[], Iterable[torch.Tensor]]) -> Iterator[None]:
    """Run code that calls torch.compile'd functions under the entered counters.

    torch.compile refuses to trace while a user's dispatch mode is on the stack, so the
    :class:`LiveTensorBytes` counters step aside for the region and afterwards count the
    tensors ``made`` names (the state the region created: an optimizer's, say). What the
    compiled code allocates and frees inside the region is not counted; on a GPU, inductor's
    fused kernels allocate little beside their outputs. Without an entered counter (CUDA,
    where the allocator counts), the region just runs.
    """
    counters = [m for m in _get_current_dispatch_mode_stack() if isinstance(m, LiveTensorBytes)]
    if not counters:
        yield
        return
    with _disable_current_modes():
        yield
    for tensor in made():
        for counter in counters:
            counter._track_tensor(tensor)


class _ResizeHook:
    """Reports ``UntypedStorage.resize_`` calls to the entered :class:`LiveTensorBytes` modes.

    ``resize_`` on a storage changes its allocation without going through the dispatcher, so
    no dispatch mode sees it. The method is replaced while at least one counter is entered and
    restored when the last one exits. An allocation over a counter's limit is undone before
    the OOM propagates, as a device that is out of memory leaves the storage as it was.
    """

    def __init__(self) -> None:
        self.original: Any = None
        self.counters: list[LiveTensorBytes] = []
        self._overrode_own_method = False

    def add(self, counter: LiveTensorBytes) -> None:
        if not self.counters:
            self._overrode_own_method = "resize_" in vars(torch.UntypedStorage)
            self.original = torch.UntypedStorage.resize_
            torch.UntypedStorage.resize_ = _observed_resize  # type: ignore[method-assign,assignment]
        self.counters.append(counter)

    def remove(self, counter: LiveTensorBytes) -> None:
        if counter not in self.counters:
            return
        self.counters.remove(counter)
        if self.counters:
            return
        if vars(torch.UntypedStorage).get("resize_") is _observed_resize:
            if self._overrode_own_method:
                torch.UntypedStorage.resize_ = self.original  # type: ignore[method-assign]
            else:
                del torch.UntypedStorage.resize_  # inherited from the C base class again


_resize_hook = _ResizeHook()


def _observed_resize(storage: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
    """``UntypedStorage.resize_`` that reports the new size to the entered counters."""
    original = _resize_hook.original
    old_nbytes = storage.nbytes()
    result = original(storage, size)
    try:
        for counter in list(_resize_hook.counters):
            counter._track_resized(storage)
    except torch.OutOfMemoryError:
        original(storage, old_nbytes)
        for counter in list(_resize_hook.counters):
            counter._track_resized(storage)
        raise
    return result


def apply_cuda_limit(limit_bytes: int, device: torch.device) -> float:
    """Cap the caching allocator at ``limit_bytes`` on ``device``; returns the fraction used."""
    total = torch.cuda.get_device_properties(device).total_memory
    if limit_bytes > total:
        raise ValueError(
            f"--device-memory {format_bytes(limit_bytes)} is more than the GPU has "
            f"({format_bytes(total)}): leave it out, or give a smaller size"
        )
    fraction = limit_bytes / total
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


@dataclass(kw_only=True, slots=True)
class MemoryMeter:
    """Peak memory readings for one window of a probe (reset before each micro-batch size)."""

    device: torch.device
    tracker: LiveTensorBytes | None = None
    """The CPU byte counter, when the probe runs on the CPU."""
    emulated_limit_bytes: int | None = None

    def reset(self) -> None:
        """Start a new peak window."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.tracker is not None:
            self.tracker.reset_peak()
        HOST_POOL.reset_peak()

    def read(self) -> dict[str, Any]:
        """Peak allocated/reserved bytes, allocator retries and OOMs, NVML and host usage."""
        reading: dict[str, Any] = {
            "host_rss_bytes": psutil.Process().memory_info().rss,
            # ru_maxrss is KiB on Linux: the process's high-water mark since it started.
            "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "emulated_limit_bytes": self.emulated_limit_bytes,
            # Activation offload's host copies (emulated on the CPU); 0 without it.
            "offloaded_activation_peak_bytes": HOST_POOL.peak_bytes,
        }
        if self.device.type == "cuda":
            stats = torch.cuda.memory_stats(self.device)
            reading.update(
                peak_allocated_bytes=stats.get("allocated_bytes.all.peak", 0),
                peak_reserved_bytes=stats.get("reserved_bytes.all.peak", 0),
                alloc_retries=stats.get("num_alloc_retries", 0),
                ooms=stats.get("num_ooms", 0),
                nvml_used_bytes=_nvml_used_bytes(self.device),
                memory_source="cuda-caching-allocator",
            )
        elif self.tracker is not None:
            # On CPU every tensor byte is "device" memory: there is no caching allocator, so
            # reserved equals allocated.
            reading.update(
                peak_allocated_bytes=self.tracker.peak_bytes,
                peak_reserved_bytes=self.tracker.peak_bytes,
                alloc_retries=0,
                ooms=0,
                nvml_used_bytes=None,
                memory_source="cpu-live-tensor-bytes",
            )
        return reading


def _nvml_used_bytes(device: torch.device) -> int | None:
    """Device-wide used memory as the driver sees it (all processes, CUDA context included)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        index = device.index if device.index is not None else torch.cuda.current_device()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    except Exception:  # NVML is optional: any failure just means no reading
        return None
