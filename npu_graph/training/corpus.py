"""The byte-level training corpus: the `.py` sources of the installed Python standard library.

Files are listed from `sysconfig`'s stdlib path (site-packages excluded), sorted by relative path, and split by
a hash of that path, so the split is fixed (independent of the seed and of which other files exist): a file is
held out iff sha256(relative path) mod 100 < HELDOUT_PERCENT, and held-out files are never trained on. Each
part is the files' bytes joined by a NUL byte (a document boundary no source file contains).
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

HELDOUT_PERCENT = 5
SEPARATOR = b"\0"
SKIPPED_DIRS = {"site-packages", "__pycache__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path | None = None) -> list[str]:
    """Relative paths of the stdlib's .py files, sorted."""
    root = stdlib_root() if root is None else root
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]       # never walk site-packages
        rel = Path(folder).relative_to(root)
        found += [(rel / name).as_posix() for name in files
                  if name.endswith(".py") and os.path.isfile(os.path.join(folder, name))]
    return sorted(found)


def is_heldout(relative_path: str) -> bool:
    """The fixed split (module docstring)."""
    return int(hashlib.sha256(relative_path.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT


@dataclass(frozen=True)
class Corpus:
    """Training and held-out bytes (uint8 tensors), the files of each part and a digest of everything read."""
    train: torch.Tensor
    heldout: torch.Tensor
    train_files: tuple[str, ...]
    heldout_files: tuple[str, ...]
    digest: str


def load_corpus(root: Path | None = None, max_train_bytes: int | None = None) -> Corpus:
    """Read and split the corpus; `max_train_bytes` keeps the first files of the training part (in path order)
    up to that many bytes, for short runs."""
    root = stdlib_root() if root is None else root
    digest = hashlib.sha256()
    parts: dict[bool, list[bytes]] = {True: [], False: []}
    names: dict[bool, list[str]] = {True: [], False: []}
    train_bytes = 0
    for rel in source_files(root):
        held = is_heldout(rel)
        if not held and max_train_bytes is not None and train_bytes >= max_train_bytes:
            continue
        data = (root / rel).read_bytes().replace(SEPARATOR, b"")
        digest.update(rel.encode() + SEPARATOR + hashlib.sha256(data).digest())
        parts[held].append(data)
        names[held].append(rel)
        train_bytes += 0 if held else len(data) + 1
    if not names[True] or not names[False]:
        raise ValueError(f"the corpus at {root} has {len(names[False])} training and {len(names[True])} "
                         f"held-out files; both parts need at least one .py file")

    def joined(chunks: list[bytes]) -> torch.Tensor:
        return torch.frombuffer(bytearray(SEPARATOR.join(chunks)), dtype=torch.uint8)

    return Corpus(joined(parts[False]), joined(parts[True]), tuple(names[False]), tuple(names[True]),
                  digest.hexdigest())


def random_windows(data: torch.Tensor, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """`batch` windows of `length` + 1 bytes (inputs and next-byte targets) at random offsets, int64."""
    starts = torch.randint(0, data.numel() - length - 1, (batch,), generator=generator)
    return torch.stack([data[s:s + length + 1] for s in starts.tolist()]).long()


def fixed_windows(data: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """`count` evenly spaced windows of `length` + 1 bytes: the same evaluation set on every run."""
    step = max((data.numel() - length - 1) // max(count, 1), 1)
    return torch.stack([data[i * step:i * step + length + 1] for i in range(count)]).long()
