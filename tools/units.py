"""Numbers on the command line: human sizes and ages, one spelling read (`--max-size 2G`) and written
(`cache ls`), and counts that must be at least 1."""
from __future__ import annotations

import argparse
import re

SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_size(text: str) -> int:
    """"500M", "2G", "1.5k", "4096" -> bytes (binary units, as `format_size` writes them)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"size {text!r} is not like 500M, 2G or 4096")
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2)])


def format_size(size: int) -> str:
    """Bytes -> "512B", "1.5K", "2.0G": the largest unit that keeps the number at least 1, read back by
    `parse_size`."""
    for unit in ("T", "G", "M", "K"):
        scale = SIZE_UNITS[unit.lower()]
        if size >= scale:
            return f"{size / scale:.1f}{unit}"
    return f"{size}B"


def parse_age(text: str) -> float:
    """"30d", "12h", "90m", "45s" -> seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"age {text!r} is not like 30d, 12h, 90m or 45s")
    return float(match.group(1)) * AGE_UNITS[match.group(2)]


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)
