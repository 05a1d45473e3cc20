"""What accelerators this node has, how fast they are, and how much host memory is left.

Detection goes through NVML (``pynvml`` from the ``nvidia-ml-py`` package) and never touches
``torch.cuda``: probes are forked from this process later, and a parent that has initialised CUDA
cannot fork children that use it ("Cannot re-initialize CUDA in forked subprocess").
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import psutil

__all__ = [
    "GpuInfo",
    "detect_gpus",
    "host_available_bytes",
    "host_memory_bytes",
    "lookup_gpu",
    "peak_flops_for",
]

_GIB = 1024**3


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
    """Key of the matching catalogue entry, or None for a GPU the catalogue does not know."""


@dataclass(frozen=True, kw_only=True, slots=True)
class _Entry:
    """One catalogue row."""

    memory_gib: float
    """Nominal memory of this variant, as marketed."""
    peak_flops: dict[str, float]
    """Dense (no 2:4 sparsity) tensor-core peak by dtype; fp32 is the non-tensor SIMT rate."""


def _flops(bf16: float | None, fp16: float, tf32: float | None, fp32: float) -> dict[str, float]:
    """Build a peak-FLOP/s row from TFLOP/s figures; None marks a dtype with no tensor path."""
    row = {"bf16": bf16, "fp16": fp16, "tf32": tf32, "fp32": fp32}
    return {dtype: tflops * 1e12 for dtype, tflops in row.items() if tflops is not None}


# Dense peaks from the vendor datasheets.  Datasheets print the 2:4-sparsity figure for tensor
# cores (marked with an asterisk); those are halved here.  Training kernels accumulate in fp32,
# so GeForce cards use the "FP16 Tensor with FP32 accumulate" row, half the fp16-accumulate one.
#   A100:       NVIDIA A100 Tensor Core GPU datasheet (2021), SXM and PCIe columns.
#   H100:       NVIDIA H100 Tensor Core GPU datasheet (2023): SXM, PCIe and NVL columns.
#   H200/GH200: NVIDIA H200 datasheet (2024); GH200 Grace Hopper datasheet, same Hopper GPU.
#   L40S, L40, L4, A10, RTX A6000: the respective NVIDIA product datasheets.
#   RTX 4090:   NVIDIA Ada Lovelace GPU architecture whitepaper v1.01, appendix table.
#   RTX 3090:   NVIDIA Ampere GA102 GPU architecture whitepaper v2, table 9.
#   V100:       NVIDIA Tesla V100 datasheet (no bf16, no tf32: Volta predates both).
#   MI300X:     AMD Instinct MI300X data sheet (matrix, dense).
# A10G is AWS's variant of the A10 (g5 instances); NVIDIA publishes no separate sheet.
_CATALOGUE: dict[str, _Entry] = {
    "A100-40GB": _Entry(memory_gib=40, peak_flops=_flops(312, 312, 156, 19.5)),
    "A100-80GB": _Entry(memory_gib=80, peak_flops=_flops(312, 312, 156, 19.5)),
    "H100-SXM": _Entry(memory_gib=80, peak_flops=_flops(989.4, 989.4, 494.7, 66.9)),
    "H100-PCIE": _Entry(memory_gib=80, peak_flops=_flops(756.5, 756.5, 378, 51.2)),
    "H100-NVL": _Entry(memory_gib=94, peak_flops=_flops(835.5, 835.5, 417.5, 60)),
    "H200": _Entry(memory_gib=141, peak_flops=_flops(989.4, 989.4, 494.7, 66.9)),
    "H200-NVL": _Entry(memory_gib=141, peak_flops=_flops(835.5, 835.5, 417.5, 60)),
    "GH200": _Entry(memory_gib=96, peak_flops=_flops(989.4, 989.4, 494.7, 66.9)),
    "L40S": _Entry(memory_gib=48, peak_flops=_flops(362.05, 362.05, 183, 91.6)),
    "L40": _Entry(memory_gib=48, peak_flops=_flops(181, 181, 90.5, 90.5)),
    "L4": _Entry(memory_gib=24, peak_flops=_flops(121, 121, 60, 30.3)),
    "A10": _Entry(memory_gib=24, peak_flops=_flops(125, 125, 62.5, 31.2)),
    "A10G": _Entry(memory_gib=24, peak_flops=_flops(125, 125, 62.5, 31.2)),
    "RTX-A6000": _Entry(memory_gib=48, peak_flops=_flops(154.8, 154.8, 77.4, 38.7)),
    "RTX-4090": _Entry(memory_gib=24, peak_flops=_flops(165.2, 165.2, 82.6, 82.6)),
    "RTX-3090": _Entry(memory_gib=24, peak_flops=_flops(71, 71, 35.6, 35.6)),
    "V100-SXM": _Entry(memory_gib=32, peak_flops=_flops(None, 125, None, 15.7)),
    "V100-PCIE": _Entry(memory_gib=32, peak_flops=_flops(None, 112, None, 14)),
    "V100S-PCIE": _Entry(memory_gib=32, peak_flops=_flops(None, 130, None, 16.4)),
    "MI300X": _Entry(memory_gib=192, peak_flops=_flops(1307.4, 1307.4, 653.7, 163.4)),
}

# Ordered rules over the normalised driver name (upper case, "-"/"_" turned into spaces).
# First match wins, so variants come before the family ("H100 NVL", "H100 PCIE" before "H100").
# Word boundaries keep "GH200" from matching H200, "L40S"/"L40" from matching L4 and "A100" from
# matching A10.
_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), key)
    for pattern, key in (
        (r"\bGH200\b", "GH200"),
        (r"\bH200 NVL\b", "H200-NVL"),
        (r"\bH200\b", "H200"),
        (r"\bH100 NVL\b", "H100-NVL"),
        (r"\bH100\b.*\bPCIE\b", "H100-PCIE"),
        (r"\bH100\b", "H100-SXM"),
        (r"\bA100\b.*\b80GB\b", "A100-80GB"),
        (r"\bA100\b.*\b40GB\b", "A100-40GB"),
        (r"\bL40S\b", "L40S"),
        (r"\bL40\b", "L40"),
        (r"\bL4\b", "L4"),
        (r"\bA10G\b", "A10G"),
        (r"\bA10\b", "A10"),
        (r"\bRTX A6000\b", "RTX-A6000"),
        # The 4090 D (China) and 3090 Ti have other clocks/SM counts: leave them unknown.
        (r"\bRTX 4090\b(?! D\b)", "RTX-4090"),
        (r"\bRTX 3090\b(?! TI\b)", "RTX-3090"),
        (r"\bV100S\b", "V100S-PCIE"),
        (r"\bV100\b.*\bPCIE\b", "V100-PCIE"),
        (r"\bV100\b", "V100-SXM"),
        (r"\bMI300X\b", "MI300X"),
    )
)


def lookup_gpu(name: str, *, memory_bytes: int | None = None) -> str | None:
    """Map a driver-reported GPU name onto a catalogue key.

    Args:
        name: The name from NVML / ``nvidia-smi``, e.g. ``NVIDIA A100-SXM4-80GB``.
        memory_bytes: Total device memory; only used to tell an A100 40GB from an 80GB when the
            name does not say (their peaks are equal, the key records the variant).

    Returns:
        The catalogue key, or None when the GPU is not in the catalogue.
    """
    normalised = " ".join(re.sub(r"[-_]", " ", name.upper()).split())
    for pattern, key in _RULES:
        if pattern.search(normalised):
            return key
    if re.search(r"\bA100\b", normalised):
        large = memory_bytes is not None and memory_bytes > 48 * _GIB
        return "A100-80GB" if large else "A100-40GB"
    return None


_DTYPE_ALIASES: dict[str, str] = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "tf32": "tf32",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
}


def peak_flops_for(name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of a GPU for a dtype.

    Args:
        name: Driver-reported GPU name or a catalogue key.
        dtype: ``bf16``/``bfloat16``, ``fp16``/``float16``, ``tf32`` or ``fp32``/``float32``;
            a ``torch.`` prefix is ignored.

    Returns:
        FLOP/s, or None when the GPU or the dtype's tensor path is unknown (e.g. bf16 on V100).
    """
    key = name if name in _CATALOGUE else lookup_gpu(name)
    canonical = _DTYPE_ALIASES.get(dtype.lower().removeprefix("torch."))
    if key is None or canonical is None:
        return None
    return _CATALOGUE[key].peak_flops.get(canonical)


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
    except pynvml.NVMLError:
        return None
    finally:
        # A shutdown failing after a failed query changes nothing for the caller.
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()
    key = lookup_gpu(name, memory_bytes=memory)
    peaks = dict(_CATALOGUE[key].peak_flops) if key else {}
    return GpuInfo(
        name=name, memory_bytes=memory, count=len(entries), peak_flops=peaks, catalogue_key=key
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


def host_memory_bytes(*, cgroup_root: Path = _CGROUP_ROOT, cgroup: str | None = None) -> int:
    """Host RAM this process may use: physical total, capped by a container memory limit.

    Args:
        cgroup_root: Where the cgroup filesystem is mounted (tests point it elsewhere).
        cgroup: This process's cgroup path below the root; read from /proc when None.

    Returns:
        Bytes.
    """
    total = int(psutil.virtual_memory().total)
    limits = _cgroup_memory(cgroup_root, _own_cgroup() if cgroup is None else cgroup)
    # cgroup v1 reports "unlimited" as a huge number near 2**63, which min() takes care of.
    return min(total, limits[0]) if limits else total


def host_available_bytes(*, cgroup_root: Path = _CGROUP_ROOT, cgroup: str | None = None) -> int:
    """Host RAM available now: psutil's estimate, capped by what the container has left.

    Args:
        cgroup_root: Where the cgroup filesystem is mounted (tests point it elsewhere).
        cgroup: This process's cgroup path below the root; read from /proc when None.

    Returns:
        Bytes.
    """
    available = int(psutil.virtual_memory().available)
    limits = _cgroup_memory(cgroup_root, _own_cgroup() if cgroup is None else cgroup)
    return min(available, limits[1]) if limits else available
