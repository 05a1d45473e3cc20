"""GPUs the catalogue lacks, described by the user in a small TOML file."""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from autotune.hardware.catalogue import DEFAULT_INTER_NODE_BANDWIDTH
from autotune.hardware.specs import DTYPES, FORM_FACTORS, GpuSpec, canonical_dtype
from autotune.units import parse_size

_T = TypeVar("_T")

# GPU files.  Rates are written as datasheets print them: "960GB/s" (bytes, SI prefixes), or a
# network's "400Gb/s" (lower-case b: bits).  The case of the b is the only thing telling bytes
# from bits, so it is honoured; the prefix's case is not ("gB/s" is fine).
_RATE_RE = re.compile(
    r"^\s*(?P<num>\d+(?:\.\d*)?(?:e[+-]?\d+)?|\.\d+)\s*"
    r"(?P<prefix>[kmgtp]?)(?P<binary>i?)(?P<unit>B|b|bit)(?:/s|ps)\s*$",
    re.IGNORECASE,
)
_FLOPS_RE = re.compile(
    r"^\s*(?P<num>\d+(?:\.\d*)?(?:e[+-]?\d+)?|\.\d+)\s*(?P<prefix>[kmgtp]?)flop(?:s|/s)\s*$",
    re.IGNORECASE,
)
_SI_PREFIX: dict[str, float] = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}
_BINARY_PREFIX: dict[str, float] = {
    "k": 2.0**10,
    "m": 2.0**20,
    "g": 2.0**30,
    "t": 2.0**40,
    "p": 2.0**50,
}

_FILE_FIELDS = (
    "key",
    "name",
    "memory",
    "memory_bytes",
    "peak_flops",
    "hbm_bandwidth",
    "intra_node_bandwidth",
    "host_link_bandwidth",
    "inter_node_bandwidth",
    "form_factor",
)


class _FieldError(ValueError):
    """An invalid value; the caller adds the file and the field to the message."""


def _positive_number(value: object) -> float | None:
    """A finite positive TOML number as float, None when ``value`` is not a number (bool isn't)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not math.isfinite(value) or value <= 0:
        raise _FieldError(f"must be a positive finite number, got {value!r}")
    return float(value)


def _quantity(
    value: object,
    pattern: re.Pattern[str],
    expected: str,
    unit: Callable[[re.Match[str]], float],
) -> float:
    """A positive number as it is, or a string matching ``pattern``: its number times what
    ``unit`` makes of the match.  ``expected`` says what was wanted when neither fits."""
    number = _positive_number(value)
    if number is not None:
        return number
    match = pattern.match(value) if isinstance(value, str) else None
    if match is None:
        raise _FieldError(f"expected {expected}, got {value!r}")
    quantity = float(match["num"]) * unit(match)
    if quantity <= 0:
        raise _FieldError(f"must be positive, got {value!r}")
    return quantity


def _rate_unit(match: re.Match[str]) -> float:
    """Bytes/s in one unit of a rate: SI or binary prefix, bytes (``B``) or bits (``b``)."""
    prefix = match["prefix"].lower()
    if match["binary"] and prefix not in _BINARY_PREFIX:
        raise _FieldError(f"unknown unit in {match.string!r}")
    scale = _BINARY_PREFIX[prefix] if match["binary"] else _SI_PREFIX[prefix]
    return scale / (1 if match["unit"] == "B" else 8)


def _parse_rate(value: object) -> float:
    """Bytes/s from a number or a string such as ``"960GB/s"``, ``"3.35 TB/s"``, ``"400Gb/s"``."""
    expected = "bytes/s as a number or a string like '960GB/s', '3.35TB/s' or '400Gb/s' (bits)"
    return _quantity(value, _RATE_RE, expected, _rate_unit)


def _parse_flops(value: object) -> float:
    """FLOP/s from a number or a string such as ``"362 TFLOPS"`` or ``"91.6TFLOP/s"``."""
    expected = "FLOP/s as a number or a string like '362TFLOPS'"
    return _quantity(value, _FLOPS_RE, expected, lambda match: _SI_PREFIX[match["prefix"].lower()])


def _parse_memory(value: object) -> int:
    """Bytes from a whole number or a size string (``"48GiB"``, ``"46068MiB"``, ``"80GB"``)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise _FieldError(f"must be positive, got {value!r}")
        return value
    if not isinstance(value, str):
        raise _FieldError(f"expected bytes or a size like '48GiB', got {value!r}")
    try:
        size = parse_size(value)
    except ValueError as exc:
        raise _FieldError(str(exc)) from None
    if size <= 0:
        raise _FieldError(f"must be positive, got {value!r}")
    return size


def _parse_text(value: object) -> str:
    """A non-empty single-line string."""
    if not isinstance(value, str) or not value.strip() or "\n" in value:
        raise _FieldError(f"expected a non-empty string, got {value!r}")
    return value.strip()


def _parse_peaks(value: object) -> dict[str, float]:
    """The ``[peak_flops]`` table: dtype -> FLOP/s, at least one dtype."""
    if not isinstance(value, dict) or not value:
        raise _FieldError(
            "expected a table of FLOP/s by dtype, e.g. [peak_flops] with bf16 = '362TFLOPS'"
        )
    peaks: dict[str, float] = {}
    for dtype, rate in value.items():
        canonical = canonical_dtype(dtype)
        if canonical is None:
            raise _FieldError(f"unknown dtype {dtype!r}, expected one of {', '.join(DTYPES)}")
        try:
            peaks[canonical] = _parse_flops(rate)
        except _FieldError as exc:
            raise _FieldError(f"{dtype}: {exc}") from None
    return peaks


def load_gpu_file(path: str | os.PathLike[str]) -> GpuSpec:
    """Read a GPU the catalogue lacks from a TOML file (format in ``docs/gpus.md``).

    Fields are ``GpuSpec``'s.  ``memory`` (or ``memory_bytes``) takes bytes or a size string
    (``"48GiB"``, ``"46068MiB"``; what ``nvidia-smi`` prints is best); bandwidths take bytes/s
    or strings (``"960GB/s"``, ``"3.35TB/s"``, ``"400Gb/s"`` in bits); ``[peak_flops]`` takes
    FLOP/s or strings (``"362TFLOPS"``).  ``key`` defaults to the file name's stem and
    ``inter_node_bandwidth`` to 100 Gb/s; everything else is required.

    Args:
        path: The file.

    Returns:
        The spec.

    Raises:
        ValueError: One line naming the file and the missing or invalid field.
    """
    try:
        with open(path, "rb") as stream:
            data: dict[str, Any] = tomllib.load(stream)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read GPU file: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None

    def fail(name: str, reason: str) -> ValueError:
        return ValueError(f"{path}: field {name!r}: {reason}")

    unknown = [name for name in data if name not in _FILE_FIELDS]
    if unknown:
        raise fail(unknown[0], f"unknown field; known fields are {', '.join(_FILE_FIELDS)}")
    if "memory" in data and "memory_bytes" in data:
        raise fail("memory", "give either 'memory' or 'memory_bytes', not both")
    data.setdefault("key", Path(path).stem.lower())
    data.setdefault("inter_node_bandwidth", DEFAULT_INTER_NODE_BANDWIDTH)
    if "memory_bytes" in data:
        data["memory"] = data.pop("memory_bytes")

    def get(name: str, parse: Callable[[object], _T]) -> _T:
        if name not in data:
            also = " (or 'memory_bytes')" if name == "memory" else ""
            raise fail(name, f"missing{also}")
        try:
            return parse(data[name])
        except _FieldError as exc:
            raise fail(name, str(exc)) from None

    form_factor = FORM_FACTORS.get(get("form_factor", _parse_text).lower())
    if form_factor is None:
        raise fail("form_factor", f"expected 'sxm' or 'pcie', got {data['form_factor']!r}")
    return GpuSpec(
        key=get("key", _parse_text).lower(),
        name=get("name", _parse_text),
        memory_bytes=get("memory", _parse_memory),
        peak_flops=get("peak_flops", _parse_peaks),
        hbm_bandwidth=get("hbm_bandwidth", _parse_rate),
        intra_node_bandwidth=get("intra_node_bandwidth", _parse_rate),
        host_link_bandwidth=get("host_link_bandwidth", _parse_rate),
        inter_node_bandwidth=get("inter_node_bandwidth", _parse_rate),
        form_factor=form_factor,
    )
