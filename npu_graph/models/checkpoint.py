"""Checkpoints of the reference model: `model.safetensors` (weights), `config.json` (the HybridConfig) and
`training.json` (how it was made: seed, steps, corpus digest, final losses, held-out bits per byte).

Written to a temporary folder and renamed into place, so a reader never sees half a checkpoint. Loading checks
that every file is present and readable, the config is a valid HybridConfig and the weights are exactly the
model's (names, shapes, dtypes); anything else raises CheckpointError naming the file and what to do.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import safetensors.torch
import torch

from npu_graph.models.config import HybridConfig

Model = TypeVar("Model", bound=torch.nn.Module)

WEIGHTS, CONFIG, RECORD = "model.safetensors", "config.json", "training.json"


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or does not fit the model."""


def save(model: torch.nn.Module, record: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write the checkpoint folder `path` atomically (replacing an older one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        weights = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
        safetensors.torch.save_file(weights, str(tmp / WEIGHTS))
        (tmp / CONFIG).write_text(json.dumps(dataclasses.asdict(model.config), indent=1))
        (tmp / RECORD).write_text(json.dumps(record, indent=1, sort_keys=True))
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path.parent} is not a complete checkpoint: {path.name} is missing. "
                              f"Train one with `ascend-dsa train --out {path.parent}`") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} cannot be read ({e}); delete the folder and train again") from None


def load_record(path: str | os.PathLike) -> dict[str, Any]:
    """The training record of the checkpoint at `path`."""
    return _read_json(Path(path) / RECORD)


def load(path: str | os.PathLike, build: Callable[[HybridConfig], Model]) -> Model:
    """The checkpoint's model, `build(config)` with the checkpoint's weights, in eval mode (module docstring)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"there is no checkpoint at {path}; train one with `ascend-dsa train --out {path}`")
    try:
        config = HybridConfig(**_read_json(path / CONFIG))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path / CONFIG} is not a valid model config ({e}); train again") from None
    try:
        weights = safetensors.torch.load_file(str(path / WEIGHTS))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a complete checkpoint: {WEIGHTS} is missing; train again") from None
    except Exception as e:  # safetensors raises its own error types for damaged files
        raise CheckpointError(f"{path / WEIGHTS} is damaged ({e}); delete the folder and train again") from None
    model = build(config)
    _check_weights(model.state_dict(), weights, path / WEIGHTS)
    model.load_state_dict(weights)
    return model.eval()


def _check_weights(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor], where: Path) -> None:
    missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    wrong = [name for name in set(expected) & set(found)
             if (expected[name].shape, expected[name].dtype) != (found[name].shape, found[name].dtype)]
    if missing or extra or wrong:
        raise CheckpointError(f"{where} does not fit the model of its config.json (missing {missing[:3]}, "
                              f"unexpected {extra[:3]}, wrong shape or dtype {sorted(wrong)[:3]}); train again")
