"""What this node has: visible GPUs through NVML (never torch.cuda), and host memory.

Detection goes through NVML (``pynvml`` from the ``nvidia-ml-py`` package) and never touches
``torch.cuda``: probes are forked from this process later, and a parent that has initialised CUDA
cannot fork children that use it ("Cannot re-initialize CUDA in forked subprocess").
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from autotune.hardware.lookup import driver_spec, lookup_gpu
from autotune.hardware.specs import GpuSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuInfo:
    """The GPUs visible to this process (assumed identical, as on training nodes)."""

    name: str
    """Device 0's name as the driver reports it, e.g. ``NVIDIA H100 80GB HBM3``."""
    memory_bytes: int
    """Total memory of device 0 in bytes."""
    count: int
    """Number of visible devices (honours ``CUDA_VISIBLE_DEVICES``)."""
    peak_flops: dict[str, float] = field(default_factory=dict)
    """Dense peak FLOP/s by dtype (``bf16``, ``fp16``, ``tf32``, ``fp32``); empty if unknown."""
    catalogue_key: str | None = None
    """Family key from ``lookup_gpu`` (``H100-SXM``, ...), or None for an unknown GPU."""
    driver: str | None = None
    """The NVIDIA driver's version (``580.159.04``), or None where NVML does not say."""

    @property
    def spec(self) -> GpuSpec | None:
        """The catalogue entry for this name and memory size, or None for an unknown GPU.

        The memory size picks the variant where the name does not (V100 16GB or 32GB).  The
        spec's ``memory_bytes`` is the catalogue's; ``self.memory_bytes`` is what was measured.
        """
        return driver_spec(self.name, self.memory_bytes)


def _visible_entries() -> list[str] | None:
    """Parse ``CUDA_VISIBLE_DEVICES``; None when unset (all devices visible).

    NVML ignores the variable, so without this a job restricted to 2 of 8 GPUs would be planned
    for 8.  Like CUDA, the list is cut at the first empty or negative entry.
    """
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    entries: list[str] = []
    for entry in (part.strip() for part in raw.split(",")):
        if not entry or entry.startswith("-"):
            break
        entries.append(entry)
    return entries


def detect_gpus() -> GpuInfo | None:
    """Describe the visible NVIDIA GPUs through NVML, without initialising CUDA.

    Returns:
        The GPU description, or None when there is no driver, no NVML library, or no GPU.
    """
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        total = pynvml.nvmlDeviceGetCount()
        entries = _visible_entries()
        if entries is None:
            entries = [str(index) for index in range(total)]
        # Integers index NVML's PCI order; CUDA's default order may differ, but on a node of
        # identical GPUs either finds the same model.  Other entries are GPU-/MIG- UUIDs.  Like
        # CUDA, stop at the first index that does not exist.
        valid = [not e.isdigit() or int(e) < total for e in entries]
        entries = entries[: valid.index(False)] if False in valid else entries
        if not entries:
            return None
        first = entries[0]
        if first.isdigit():
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(first))
        else:
            handle = pynvml.nvmlDeviceGetHandleByUUID(first)
        raw_name = pynvml.nvmlDeviceGetName(handle)
        # Older nvidia-ml-py releases return bytes.
        name = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)
        memory = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        raw_driver = pynvml.nvmlSystemGetDriverVersion()
        driver = raw_driver.decode() if isinstance(raw_driver, bytes) else str(raw_driver)
    except pynvml.NVMLError:
        return None
    finally:
        # A shutdown failing after a failed query changes nothing for the caller.
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()
    key = lookup_gpu(name, memory_bytes=memory)
    spec = driver_spec(name, memory)
    peaks = dict(spec.peak_flops) if spec is not None else {}
    return GpuInfo(
        name=name,
        memory_bytes=memory,
        count=len(entries),
        peak_flops=peaks,
        catalogue_key=key,
        driver=driver or None,
    )


def _read_int(path: Path) -> int | None:
    """An integer from a cgroup file; None when missing, unreadable or ``max``."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _inactive_file(stat_file: Path) -> int:
    """Reclaimable page cache of a cgroup (``inactive_file``), 0 when unknown."""
    try:
        lines = stat_file.read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        key, _, value = line.partition(" ")
        if key in ("inactive_file", "total_inactive_file") and value.strip().isdigit():
            return int(value)
    return 0


def _own_cgroup() -> str:
    """This process's cgroup v2 path from ``/proc/self/cgroup`` (``0::/path``), else ``/``."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return "/"
    return next((line[3:] for line in lines if line.startswith("0::")), "/") or "/"


def _cgroup_memory(root: Path, own: str) -> tuple[int, int] | None:
    """Tightest container memory limit and the headroom left under it, or None if unlimited.

    Containers (Docker, Kubernetes, Slurm with cgroups) cap memory below what the host has, and
    psutil reports the host: CPU offload sized from psutil alone gets OOM-killed.  cgroup v2
    puts ``memory.max`` on the process's cgroup or any ancestor; v1 has
    ``memory/memory.limit_in_bytes``.  Usage counts page cache, so reclaimable
    ``inactive_file`` is subtracted, as ``docker stats`` does (kernel docs:
    admin-guide/cgroup-v2.rst, admin-guide/cgroup-v1/memory.rst).
    """
    parts = [part for part in own.split("/") if part and part != ".."]
    found: list[tuple[int, int]] = []
    for depth in range(len(parts), -1, -1):
        directory = root.joinpath(*parts[:depth])
        limit = _read_int(directory / "memory.max")
        usage = _read_int(directory / "memory.current")
        if limit is not None and usage is not None:
            used = max(0, usage - _inactive_file(directory / "memory.stat"))
            found.append((limit, max(0, limit - used)))
    v1 = root / "memory"
    limit = _read_int(v1 / "memory.limit_in_bytes")
    usage = _read_int(v1 / "memory.usage_in_bytes")
    if limit is not None and usage is not None:
        used = max(0, usage - _inactive_file(v1 / "memory.stat"))
        found.append((limit, max(0, limit - used)))
    if not found:
        return None
    return min(limit for limit, _ in found), min(headroom for _, headroom in found)


_CGROUP_ROOT = Path("/sys/fs/cgroup")


def _capped(host_bytes: int, which: int, cgroup_root: Path, cgroup: str | None) -> int:
    """``host_bytes`` capped by the container's limit (``which`` 0) or headroom (1), if any.

    ``cgroup_root`` is where the cgroup filesystem is mounted (tests point it elsewhere),
    ``cgroup`` this process's cgroup path below it, read from /proc when None.
    """
    found = _cgroup_memory(cgroup_root, _own_cgroup() if cgroup is None else cgroup)
    # cgroup v1 reports "unlimited" as a huge number near 2**63, which min() takes care of.
    return min(host_bytes, found[which]) if found else host_bytes


def host_memory_bytes(*, cgroup_root: Path = _CGROUP_ROOT, cgroup: str | None = None) -> int:
    """Host RAM this process may use in bytes: physical total, capped by a container memory
    limit (``cgroup_root`` and ``cgroup`` as for ``host_available_bytes``)."""
    return _capped(int(psutil.virtual_memory().total), 0, cgroup_root, cgroup)


def host_available_bytes(*, cgroup_root: Path = _CGROUP_ROOT, cgroup: str | None = None) -> int:
    """Host RAM available now: psutil's estimate, capped by what the container has left.

    Args:
        cgroup_root: Where the cgroup filesystem is mounted (tests point it elsewhere).
        cgroup: This process's cgroup path below the root; read from /proc when None.

    Returns:
        Bytes.
    """
    return _capped(int(psutil.virtual_memory().available), 1, cgroup_root, cgroup)
