"""Parsing and formatting of memory sizes and durations.

Users type sizes the way tools print them: ``nvidia-smi`` says ``81559MiB``, cloud consoles say
``80GB`` and people say ``80G``.  This module accepts all of those and prints sizes back in
binary units (GiB), which is what allocators and ``torch.cuda.memory_stats`` work in.
"""

from __future__ import annotations

import math
import re

__all__ = [
    "GIB",
    "MIB",
    "format_bytes",
    "format_duration",
    "is_plain_number",
    "parse_duration",
    "parse_size",
]

_KIB = 1024
MIB = _KIB**2
"""Bytes in a mebibyte, the unit ``nvidia-smi`` prints memory in."""
GIB = _KIB**3
"""Bytes in a gibibyte."""

# Binary (IEC) multipliers.  A bare "G" is binary on purpose: nvidia-smi, `free -g` and `ulimit`
# all mean GiB when they print a bare G, and so do people reading them.
_BINARY: dict[str, int] = {
    "k": _KIB,
    "m": MIB,
    "g": GIB,
    "t": _KIB**4,
    "p": _KIB**5,
}
# Decimal (SI) multipliers: "GB" is 10**9, as on GPU datasheets and disk labels.
_DECIMAL: dict[str, int] = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}

_SIZE_RE = re.compile(
    r"^\s*(?P<num>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[a-z]*)\s*$", re.IGNORECASE | re.ASCII
)
_SIZE_HELP = "use a number with a unit, like 20GiB, 512MiB or 80GB"


def _size_multiplier(unit: str) -> int | None:
    """Return the byte multiplier of a lower-case size unit, or None when it is not one."""
    if unit in ("", "b"):
        return 1
    prefix, rest = unit[0], unit[1:]
    if prefix not in _BINARY:
        return None
    if rest in ("", "i", "ib"):
        return _BINARY[prefix]
    if rest == "b":
        return _DECIMAL[prefix]
    return None


def parse_size(text: str) -> int:
    """Parse a memory size into bytes.

    Accepted forms (units are case-insensitive, a space before the unit is allowed):
    ``20GiB`` / ``20Gi`` / ``20G`` (binary, 2**30), ``20GB`` (decimal, 10**9), likewise for
    K, M, T and P, ``1.5TiB`` (fractions), ``1024`` or ``1024B`` (bytes).

    Args:
        text: The size as typed by a user.

    Returns:
        The size in bytes, rounded to the nearest byte.

    Raises:
        ValueError: If ``text`` is not a size; the message quotes the input.
    """
    match = _SIZE_RE.match(text)
    multiplier = _size_multiplier(match["unit"].lower()) if match else None
    if match is None or multiplier is None:
        raise ValueError(f"invalid size {text!r}: {_SIZE_HELP}")
    number = match["num"]
    if multiplier == 1 and not number.isdigit():
        raise ValueError(f"invalid size {text!r}: a byte count must be a whole number")
    if number.isdigit():
        # Integer path keeps exact results for big values such as "1048576PiB".
        return int(number) * multiplier
    return round(float(number) * multiplier)


# Longest alternatives first so that "ms" is not read as minutes and "min" not as "m" + junk.
_DURATION_UNITS: dict[str, float] = {
    "days": 86400.0,
    "day": 86400.0,
    "d": 86400.0,
    "hours": 3600.0,
    "hour": 3600.0,
    "hrs": 3600.0,
    "hr": 3600.0,
    "h": 3600.0,
    "minutes": 60.0,
    "minute": 60.0,
    "mins": 60.0,
    "min": 60.0,
    "ms": 0.001,
    "m": 60.0,
    "seconds": 1.0,
    "second": 1.0,
    "secs": 1.0,
    "sec": 1.0,
    "s": 1.0,
}
_DURATION_TOKEN_RE = re.compile(
    r"(?P<num>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>"
    + "|".join(sorted(_DURATION_UNITS, key=len, reverse=True))
    + r")\s*",
    re.IGNORECASE | re.ASCII,
)
_PLAIN_NUMBER_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*$", re.ASCII)
"""Digits are ASCII's only: ``５m`` (full-width) is refused, not read as 5 minutes."""
_DURATION_HELP = "use a number with a unit, like 90s, 30m, 1h30m or 2h"


def is_plain_number(text: str) -> bool:
    """Whether ``text`` is a number with no unit (``30``, ``1.5``)."""
    return _PLAIN_NUMBER_RE.match(text) is not None


def parse_duration(text: str) -> float:
    """Parse a duration into seconds.

    Accepted forms: ``45`` (plain number = seconds), ``90s``, ``30m``, ``2h``, ``1.5h``, ``1d``,
    ``250ms`` and combinations in decreasing order such as ``1h30m`` or ``1h 30m``.  Long unit
    names (``min``, ``hours``, ``sec``) are accepted too.

    Args:
        text: The duration as typed by a user.

    Returns:
        The duration in seconds.

    Raises:
        ValueError: If ``text`` is not a duration; the message quotes the input.
    """
    plain = _PLAIN_NUMBER_RE.match(text)
    if plain:
        return float(plain[1])
    stripped = text.strip()
    position = 0
    total = 0.0
    last_scale = math.inf
    while position < len(stripped):
        token = _DURATION_TOKEN_RE.match(stripped, position)
        if token is None:
            raise ValueError(f"invalid duration {text!r}: {_DURATION_HELP}")
        scale = _DURATION_UNITS[token["unit"].lower()]
        # "30m1h" or "1h1h" are almost certainly typos; refuse rather than guess.
        if scale >= last_scale:
            raise ValueError(
                f"invalid duration {text!r}: give units from largest to smallest, each once"
            )
        last_scale = scale
        total += float(token["num"]) * scale
        position = token.end()
    if not stripped:
        raise ValueError(f"invalid duration {text!r}: {_DURATION_HELP}")
    return total


def parse_fraction(text: str, what: str = "fraction") -> float:
    """Parse a share of something: ``10%`` or ``0.1``, from 0 (inclusive) to 1 (exclusive).

    Args:
        text: The fraction as typed by a user.
        what: What the fraction is of, for the error message (``headroom``).

    Raises:
        ValueError: If ``text`` is not a fraction in [0, 1); the message quotes the input.
    """
    value = text.strip()
    try:
        if not value.isascii():
            raise ValueError(value)
        fraction = float(value[:-1]) / 100 if value.endswith("%") else float(value)
    except ValueError:
        raise ValueError(f"invalid {what} {text!r}: use a percentage like 10%") from None
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"{what} {text!r} must be between 0% and 100%")
    return fraction


_BYTE_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: int | float) -> str:
    """Format a byte count with binary units, about four significant digits.

    Examples: ``0 B``, ``512 B``, ``512.0 MiB``, ``13.48 GiB``, ``1.50 TiB``.

    Args:
        n: A byte count; negative values (deltas) get a leading minus sign.

    Returns:
        The human-readable size.
    """
    if n < 0:
        return "-" + format_bytes(-n)
    if not math.isfinite(n):
        return f"{n} B"
    if n < _KIB:
        return f"{round(n)} B"
    value = float(n)
    for index, unit in enumerate(_BYTE_UNITS):
        value /= _KIB
        digits = 1 if value >= 100 else 2
        is_last = index == len(_BYTE_UNITS) - 1
        # Promote when rounding would print "1024.0 MiB" instead of "1.00 GiB".
        if round(value, digits) < _KIB or is_last:
            return f"{value:.{digits}f} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover


def format_duration(seconds: float) -> str:
    """Format a duration compactly; the output is accepted by :func:`parse_duration`.

    Examples: ``250ms``, ``45.2s``, ``2m05s``, ``1h30m``, ``30h00m``, ``7d``, ``3d5h``.

    Args:
        seconds: The duration; negative values get a leading minus sign.

    Returns:
        The human-readable duration.
    """
    if seconds < 0:
        return "-" + format_duration(-seconds)
    if not math.isfinite(seconds):
        return f"{seconds}s"
    if round(seconds, 3) < 1:
        return f"{seconds * 1000:.0f}ms"
    if round(seconds, 1) < 60:
        return f"{seconds:.1f}s"
    whole = round(seconds)
    if whole < 3600:
        minutes, secs = divmod(whole, 60)
        return f"{minutes}m{secs:02d}s"
    # Past an hour the seconds are noise for a tuning budget; round to the minute.
    hours, minutes = divmod(round(seconds / 60), 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    # Past two days (a result's age), to the hour.
    days, hours = divmod(round(seconds / 3600), 24)
    return f"{days}d{hours}h" if hours else f"{days}d"
