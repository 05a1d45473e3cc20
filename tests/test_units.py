"""Tests for autotune.units: size and duration parsing and formatting."""

from __future__ import annotations

import pytest

from autotune.units import format_bytes, format_duration, parse_duration, parse_size

GIB = 1024**3


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("20GiB", 20 * GIB),
        ("20 GiB", 20 * GIB),
        ("20gib", 20 * GIB),
        ("20Gi", 20 * GIB),
        ("80G", 80 * GIB),  # bare G is binary, as nvidia-smi users mean it
        ("80g", 80 * GIB),
        ("20GB", 20 * 10**9),
        ("20gb", 20 * 10**9),
        ("512MiB", 512 * 1024**2),
        ("512M", 512 * 1024**2),
        ("512MB", 512 * 10**6),
        ("4K", 4096),
        ("4kB", 4000),
        ("1.5TiB", 3 * 1024**4 // 2),
        ("2T", 2 * 1024**4),
        ("1TB", 10**12),
        ("1024", 1024),
        ("1024B", 1024),
        ("0", 0),
        ("  7 MiB  ", 7 * 1024**2),
        ("13.48 GiB", round(13.48 * GIB)),
        (".5GiB", GIB // 2),
        ("81559MiB", 81559 * 1024**2),  # nvidia-smi's H100 figure
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected
    assert isinstance(parse_size(text), int)


def test_parse_size_large_integers_are_exact() -> None:
    assert parse_size("123456789PiB") == 123456789 * 1024**5


@pytest.mark.parametrize("text", ["abc", "", "GiB", "20 XB", "20GiBs", "-5GiB", "1,5GiB", "2 G B"])
def test_parse_size_rejects_with_input_quoted(text: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_size(text)
    message = str(info.value)
    assert repr(text) in message
    assert "20GiB" in message  # says what is accepted
    assert "\n" not in message


def test_parse_size_rejects_fractional_bytes() -> None:
    with pytest.raises(ValueError, match="whole number"):
        parse_size("1.5")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30m", 1800.0),
        ("1h30m", 5400.0),
        ("1h 30m", 5400.0),
        ("90s", 90.0),
        ("2h", 7200.0),
        ("1.5h", 5400.0),
        ("45", 45.0),
        ("45.5", 45.5),
        ("2m05s", 125.0),
        ("1d", 86400.0),
        ("250ms", 0.25),
        ("1H30M", 5400.0),
        ("10 min", 600.0),
        ("2 hours 15 minutes", 8100.0),
        (" 5s ", 5.0),
    ],
)
def test_parse_duration(text: str, expected: float) -> None:
    assert parse_duration(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["", "abc", "1x", "h", "30m1h", "1h1h", "-5s", "1h30", "5 s s"])
def test_parse_duration_rejects_with_input_quoted(text: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_duration(text)
    assert repr(text) in str(info.value)


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (512 * 1024**2, "512.0 MiB"),
        (round(13.48 * GIB), "13.48 GiB"),
        (80 * GIB, "80.00 GiB"),
        (1.5 * 1024**4, "1.50 TiB"),
        (1024**2 - 1, "1.00 MiB"),  # would print as "1024.0 KiB" without promotion
        (-2 * GIB, "-2.00 GiB"),
        (3 * 1024**6, "3072.0 PiB"),  # largest unit is kept past 1024
    ],
)
def test_format_bytes(n: int | float, expected: str) -> None:
    assert format_bytes(n) == expected


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        (5400, "1h30m"),
        (125, "2m05s"),
        (45.2, "45.2s"),
        (0.25, "250ms"),
        (59.97, "1m00s"),  # rounds up into the minutes form, not "60.0s"
        (3599.6, "1h00m"),
        (3600 * 26 + 60, "26h01m"),
        (86400 * 7, "7d"),
        (86400 * 3 + 3600 * 5 + 600, "3d5h"),
        (-90, "-1m30s"),
    ],
)
def test_format_duration(seconds: float, expected: str) -> None:
    assert format_duration(seconds) == expected


@pytest.mark.parametrize("seconds", [0.25, 7.5, 45.2, 125, 5400, 86400 * 2, 86400 * 9.5])
def test_format_duration_round_trips(seconds: float) -> None:
    assert parse_duration(format_duration(seconds)) == pytest.approx(seconds, rel=0.01)


@pytest.mark.parametrize("n", [1024, 512 * 1024**2, 13 * GIB + 12345, 3 * 1024**4])
def test_format_bytes_round_trips(n: int) -> None:
    assert parse_size(format_bytes(n)) == pytest.approx(n, rel=0.005)
