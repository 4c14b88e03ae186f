"""Fixtures for the kernel tests: `isa_level` (native_paths) runs a test once per instruction-set level."""
from native_paths import isa_level  # noqa: F401
