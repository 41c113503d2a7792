"""Recipes: the library wired into whole jobs (torchtune's word); each CLI command calls one.

    train.py      `captioner train`: `setup` (checks, data, vocabulary, model, objective, optimiser), `fit`, `train`
    build.py      the parts `train.setup` wires: the checks before any work, data, vocabulary, model, objective
    prepare.py    `captioner prepare`: vocabulary and feature cache ahead of training
    evaluate.py   `captioner evaluate`: a checkpoint scored on a split
    demo.py       `captioner demo`: the shapes set -> train -> evaluate -> an attention picture

The functions `train` and `prepare` share their modules' names, so they are imported from those
(`from captioner.recipes.train import train`); the other public names are re-exported here.
"""
from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {  # name -> its module
    "TrainResult": "captioner.recipes.train",
    "fit": "captioner.recipes.train",
    "run_config": "captioner.recipes.train",
    "setup": "captioner.recipes.train",
    "PrepareSummary": "captioner.recipes.prepare",
    "evaluate_checkpoint": "captioner.recipes.evaluate",
    "DemoResult": "captioner.recipes.demo",
    "run_demo": "captioner.recipes.demo",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    """A public name, imported on first use, so that `captioner --help` imports no recipe."""
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
