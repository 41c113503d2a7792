"""Training: a config (and optionally a checkpoint to resume) -> checkpoints and metrics.

    loss.py         cross-entropy + the optional coverage and entropy attention terms
    prepare.py      `captioner prepare`: vocabulary and feature cache ahead of training
    setup.py        data, vocabulary, model, optimiser, schedule -> a `Run`
    state.py        the run's position and `last.pt` / `best.pt`: exact resume
    loop.py         `train`, `fit`, `train_one_epoch`, `validate`
    distributed.py  torchrun process groups, collectives, RNG states
"""
from captioner.training.loop import TrainResult, train
from captioner.training.state import run_config

__all__ = ["TrainResult", "run_config", "train"]
