"""Training's parts, which recipes wire into jobs (`captioner.recipes.train` runs them):

    loss.py         cross-entropy + the optional coverage, entropy and concept attention terms
    objective.py    `Objective`: what a kind of training does with a batch; `CrossEntropy`
    scst.py         `SelfCritical`: self-critical sequence training, the other objective
    optim.py        Adam(W) and its learning-rate schedule
    state.py        the run (`Run`), its position, `last.pt` / `best.pt`: exact resume
    loop.py         `train_one_epoch` (an optimiser step on the objective's loss per batch), `validate`
    stop.py         Ctrl-C and SIGTERM: stop at a checkpoint
    distributed.py  torchrun process groups, collectives, RNG states
"""
from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {  # name -> its module
    "LossOutput": "captioner.training.loss",
    "build_criterion": "captioner.training.loss",
    "caption_loss": "captioner.training.loss",
    "CrossEntropy": "captioner.training.objective",
    "Objective": "captioner.training.objective",
    "BatchLoss": "captioner.training.objective",
    "SelfCritical": "captioner.training.scst",
    "build_optimizer": "captioner.training.optim",
    "build_scheduler": "captioner.training.optim",
    "Meter": "captioner.training.state",
    "Run": "captioner.training.state",
    "TrainState": "captioner.training.state",
    "train_one_epoch": "captioner.training.loop",
    "validate": "captioner.training.loop",
    "StopRequest": "captioner.training.stop",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    """A public name, imported on first use (as the other layers do)."""
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
