"""The demo's checkpoint without waiting for it: when no trained checkpoint exists, the quick one is trained
by `ascend-dsa train` in a child process (one thread) while the demo compiles its graphs on a model of the
same shapes; the trained weights are then loaded into that model in place.

Compiled graphs take parameters as inputs and do not depend on their values (the runtime re-runs its
prologue when a parameter's version changes), so the graphs compiled on the untrained weights are the ones
that run the trained weights; the demo's compiled-vs-eager comparison checks it on every run.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import TracebackType

import torch

from npu_graph.models import checkpoint
from npu_graph.models.hybrid import HybridConfig, HybridLM
from npu_graph.training.loop import (
    QUICK_BATCH,
    QUICK_MINUTES,
    QUICK_SEQ_LEN,
    announce_training,
    checkpoint_paths,
    load_first,
)


class BackgroundTraining:
    """`ascend-dsa train` of the quick checkpoint in a child process (its progress lines go to stderr);
    a context manager that stops the child if the caller leaves before `wait()`."""

    def __init__(self, config: str, seed: int, out: Path, minutes: float = QUICK_MINUTES) -> None:
        self.config, self.out = config, out
        command = [sys.executable, "-m", "npu_graph", "train", "--config", config, "--seed", str(seed),
                   "--minutes", str(minutes), "--batch", str(QUICK_BATCH), "--seq-len", str(QUICK_SEQ_LEN),
                   "--out", str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the other core compiles
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)

    def __enter__(self) -> BackgroundTraining:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def load_into(self, model: HybridLM) -> HybridLM:
        """Waits for the training, then copies its weights into `model` (same config) in place."""
        code = self.process.wait()
        if code != 0:
            raise checkpoint.CheckpointError(
                f"training the quick checkpoint failed (exit status {code}); run `ascend-dsa train --config "
                f"{self.config} --out {self.out}` to see why")
        trained = HybridLM.from_pretrained(self.out)
        with torch.no_grad():
            model.load_state_dict(trained.state_dict())
        return model.eval()


def quick_model(config: str, seed: int = 0) -> tuple[HybridLM, BackgroundTraining | None]:
    """(the trained checkpoint, None) when one loads; else (an untrained model of its config, the training
    that `load_into` it when done)."""
    paths = checkpoint_paths(config, seed, quick=True)
    model, reason = load_first(paths)
    if model is not None:
        return model, None
    announce_training(reason, QUICK_MINUTES, quick=True)
    return HybridLM(HybridConfig.named(config)).eval(), BackgroundTraining(config, seed, paths[-1])
