"""Finding a catalogue entry from a key, an alias, a driver name or a GPU file."""

from __future__ import annotations

import os
import re

from autotune.hardware.catalogue import SPECS
from autotune.hardware.gpufile import load_gpu_file
from autotune.hardware.specs import DTYPES, GpuSpec
from autotune.units import GIB, MIB

# lookup_gpu's family keys (kept for GpuInfo.catalogue_key and older callers) onto spec keys.
# A100 and V100 families are refined by _driver_key, which sees the PCIe marker and memory.
_FAMILY_KEYS: dict[str, str] = {
    "B300": "b300",
    "GB200": "gb200",
    "B200": "b200",
    "A100-40GB": "a100-40gb",
    "A100-80GB": "a100-80gb",
    "H100-SXM": "h100-80gb",
    "H100-PCIE": "h100-pcie",
    "H100-NVL": "h100-nvl",
    "H200": "h200",
    "H200-NVL": "h200-nvl",
    "GH200": "gh200",
    "L40S": "l40s",
    "L40": "l40",
    "L4": "l4",
    "A10": "a10",
    "A10G": "a10g",
    "RTX-A6000": "a6000",
    "RTX-4090": "rtx4090",
    "RTX-3090": "rtx3090",
    "V100-SXM": "v100-32gb",
    "V100-PCIE": "v100-32gb-pcie",
    "V100S-PCIE": "v100s",
    "MI300X": "mi300x",
    "MI325X": "mi325x",
    "MI355X": "mi355x",
}

# Names accepted besides the keys, lower case: the family keys and short forms people type.
# A bare "a100" means the 80GB SXM, "v100" the 32GB SXM2: the common variants in clusters today.
_ALIASES: dict[str, str] = {
    **{family.lower(): key for family, key in _FAMILY_KEYS.items()},
    "h100": "h100-80gb",
    "h100-sxm5": "h100-80gb",
    "h200-sxm": "h200",
    "a100": "a100-80gb",
    "a100-sxm": "a100-80gb",
    "a100-pcie": "a100-80gb-pcie",
    "4090": "rtx4090",
    "3090": "rtx3090",
    "v100": "v100-32gb",
    "v100s-pcie": "v100s",
}

# Ordered rules over the normalised driver name (upper case, "-"/"_" turned into spaces).
# First match wins, so variants come before the family ("H100 NVL", "H100 PCIE" before "H100").
# Word boundaries keep "GH200" from matching H200, "L40S"/"L40" from matching L4 and "A100" from
# matching A10.
_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), key)
    for pattern, key in (
        (r"\bB300\b", "B300"),
        (r"\bGB200\b", "GB200"),
        (r"\bB200\b", "B200"),
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
        (r"\bMI325X\b", "MI325X"),
        (r"\bMI355X\b", "MI355X"),
    )
)


def _normalise(name: str) -> str:
    """Upper case, ``-``/``_`` as spaces, runs of spaces collapsed: what the rules match."""
    return " ".join(re.sub(r"[-_]", " ", name.upper()).split())


def lookup_gpu(name: str, *, memory_bytes: int | None = None) -> str | None:
    """Map a driver-reported GPU name onto a catalogue family key.

    Family keys (``H100-SXM``, ``A100-80GB``, ``V100-SXM``, ...) predate ``GpuSpec`` and do not
    tell every variant apart; ``gpu_spec`` and ``GpuInfo.spec`` give the exact entry.

    Args:
        name: The name from NVML / ``nvidia-smi``, e.g. ``NVIDIA A100-SXM4-80GB``.
        memory_bytes: Total device memory; only used to tell an A100 40GB from an 80GB when the
            name does not say (their peaks are equal, the key records the variant).

    Returns:
        The family key, or None when the GPU is not in the catalogue.
    """
    normalised = _normalise(name)
    for pattern, key in _RULES:
        if pattern.search(normalised):
            return key
    if re.search(r"\bA100\b", normalised):
        large = memory_bytes is not None and memory_bytes > 48 * GIB
        return "A100-80GB" if large else "A100-40GB"
    return None


def _driver_key(name: str, memory_bytes: int | None) -> str | None:
    """The spec key for a driver-reported name (and memory size when known), or None."""
    family = lookup_gpu(name, memory_bytes=memory_bytes)
    if family is None:
        return None
    normalised = _normalise(name)
    pcie = re.search(r"\bPCIE\b", normalised) is not None
    if family in ("A100-40GB", "A100-80GB"):
        return _FAMILY_KEYS[family] + ("-pcie" if pcie else "")
    if family in ("V100-SXM", "V100-PCIE"):
        # Both sizes share a name up to "16GB"/"32GB"; the memory reading is the surer sign.
        if memory_bytes is not None:
            small = memory_bytes < 24 * GIB
        else:
            small = re.search(r"\b16GB\b", normalised) is not None
        return f"v100-{16 if small else 32}gb" + ("-pcie" if family == "V100-PCIE" else "")
    return _FAMILY_KEYS[family]


def driver_spec(name: str, memory_bytes: int | None = None) -> GpuSpec | None:
    """The catalogue entry for a driver-reported name, or None for a GPU it does not know.

    Args:
        name: The name from NVML / ``nvidia-smi``, e.g. ``NVIDIA A100-SXM4-80GB``.
        memory_bytes: Total device memory when measured: it picks the variant where the name
            does not (V100 16GB or 32GB, A100 40GB or 80GB).

    Returns:
        The spec (shared: copy ``peak_flops`` before changing it), or None.
    """
    key = _driver_key(name, memory_bytes)
    return None if key is None else SPECS[key]


def gpu_keys() -> list[str]:
    """The catalogue's keys, in catalogue order (newest NVIDIA data-centre parts first)."""
    return list(SPECS)


_GPU_FILE_HELP = "describe another GPU in a .toml file and pass its path (see docs/gpus.md)"


def gpu_spec(key_or_name: str | os.PathLike[str]) -> GpuSpec:
    """The catalogue entry for a key, an alias, a driver-reported name, or a GPU file.

    Args:
        key_or_name: A key (``h100-80gb``, case-insensitive), an alias (``h100``, ``a100``,
            ``4090``, or a family key such as ``H100-SXM``), a name as ``nvidia-smi`` prints it
            (``NVIDIA H100 80GB HBM3``; a name without a space must be a key or an alias), or
            the path of a GPU file: a ``Path``, or a string
            ending in ``.toml`` (see ``load_gpu_file``).

    Returns:
        The spec.  Catalogue entries are shared: copy ``peak_flops`` before changing it.

    Raises:
        ValueError: For a GPU the catalogue does not know, or an invalid GPU file.
    """
    if isinstance(key_or_name, os.PathLike):
        return load_gpu_file(key_or_name)
    text = key_or_name.strip()
    if text.lower().endswith(".toml"):
        return load_gpu_file(text)
    lowered = text.lower()
    key = lowered if lowered in SPECS else _ALIASES.get(lowered)
    # Driver names have spaces ("NVIDIA H100 80GB HBM3"); a one-word name that is no key is a
    # mistyped key, and the driver rules would quietly read "h100-94gb" as the H100 80GB.
    if key is None and " " in text:
        key = _driver_key(text, None)
    if key is None:
        raise ValueError(
            f"unknown GPU {key_or_name!r}: known keys are {', '.join(gpu_keys())}; "
            + _GPU_FILE_HELP
        )
    return SPECS[key]


def peak_flops_for(name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of a GPU for a dtype.

    Args:
        name: Driver-reported GPU name, a catalogue key or an alias (as ``gpu_spec`` takes).
        dtype: ``bf16``/``bfloat16``, ``fp16``/``float16``, ``tf32`` or ``fp32``/``float32``;
            a ``torch.`` prefix is ignored.

    Returns:
        FLOP/s, or None when the GPU or the dtype's tensor path is unknown (e.g. bf16 on V100).
    """
    lowered = name.strip().lower()
    key = lowered if lowered in SPECS else _ALIASES.get(lowered) or _driver_key(name, None)
    return None if key is None else SPECS[key].peak(dtype)


def catalogue_markdown() -> str:
    """The catalogue as a Markdown table (``docs/gpus.md`` holds a copy; a test compares).

    Returns:
        The table, one row per key, ending in a newline.
    """

    def tera(spec: GpuSpec, dtype: str) -> str:
        flops = spec.peak_flops.get(dtype)
        return "-" if flops is None else f"{flops / 1e12:g}"

    lines = [
        "| key | GPU | memory (MiB) | bf16 | fp16 | tf32 | fp32 | memory GB/s "
        "| intra-node GB/s | host link GB/s | network GB/s | form |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for spec in SPECS.values():
        rates = (
            spec.hbm_bandwidth,
            spec.intra_node_bandwidth,
            spec.host_link_bandwidth,
            spec.inter_node_bandwidth,
        )
        cells = [
            f"`{spec.key}`",
            spec.name,
            f"{spec.memory_bytes / MIB:g}",
            *(tera(spec, dtype) for dtype in DTYPES),
            *(f"{rate / 1e9:g}" for rate in rates),
            spec.form_factor,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
