"""Human sizes: what `cache ls` writes, `prune --max-size` reads back."""
import argparse

import pytest

from npu_graph.tools.units import format_size, parse_age, parse_size


@pytest.mark.parametrize("size, text", [(0, "0B"), (512, "512B"), (1024, "1.0K"), (1536, "1.5K"),
                                        (3 << 20, "3.0M"), ((1 << 31) + (1 << 30), "3.0G"), (5 << 40, "5.0T")])
def test_format_size(size, text):
    assert format_size(size) == text and parse_size(text) == size


@pytest.mark.parametrize("size", [1, 1023, 1025, 999_999, 123_456_789, 7_000_000_000])
def test_round_trip_within_the_printed_digit(size):
    text = format_size(size)
    unit = parse_size("1" + text[-1]) if text[-1] != "B" else 1
    assert abs(parse_size(text) - size) <= 0.05 * unit


@pytest.mark.parametrize("text, value", [("500M", 500 << 20), ("2G", 2 << 30), ("4096", 4096), ("1.5kib", 1536),
                                         ("2 gb", 2 << 30)])
def test_parse_size(text, value):
    assert parse_size(text) == value


def test_bad_values_are_argparse_errors():
    with pytest.raises(argparse.ArgumentTypeError, match="not like 500M"):
        parse_size("lots")
    with pytest.raises(argparse.ArgumentTypeError, match="not like 30d"):
        parse_age("soon")
    assert parse_age("12h") == 43200
