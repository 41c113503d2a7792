"""A tiny checkpoint with sharp attention, and `captioner serve` run as a user runs it, for the
server and browser tests."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from captioner.config import Config, DecodeConfig, DecoderConfig, EncoderConfig, ModelConfig
from captioner.data.vocab import build_vocabulary
from captioner.model import build_model
from captioner.model.checkpoint import save_checkpoint

CAPTIONS = ["a red circle to the left of a blue square", "a green triangle above a yellow circle",
            "there is a purple square"]
MODEL = ModelConfig(encoder=EncoderConfig(name="random", image_size=64),
                    decoder=DecoderConfig(embed_dim=16, hidden_dim=32, attention_dim=16, dropout=0.0))


def sharp_checkpoint(path: Path, seed: int = 0) -> Path:
    """An untrained model whose attention scores are scaled up, so each word's map gathers on a few
    cells of the 4x4 grid (as a trained model's object words do): something to see on the page."""
    torch.manual_seed(seed)
    vocab = build_vocabulary(CAPTIONS)
    model = build_model(MODEL, len(vocab), pretrained=False)
    with torch.no_grad():
        model.decoder.readout.weight.mul_(4.0)
        model.decoder.attention.score.weight.mul_(300.0)
    return save_checkpoint(path, Config(model=MODEL, decode=DecodeConfig(beam_size=3, max_length=8)), vocab,
                           model.state_dict())


class Server:
    """`captioner serve --port 0` in a subprocess; `url` once it prints where it listens."""

    def __init__(self, checkpoint: Path, *extra: str, timeout: float = 60.0) -> None:
        command = [sys.executable, "-m", "captioner.cli", "serve", "--checkpoint", str(checkpoint), "--port", "0",
                   "--device", "cpu", *extra]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline, self.output = time.monotonic() + timeout, []
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                raise RuntimeError(f"captioner serve exited: {''.join(self.output)}")
            self.output.append(line)
            found = re.search(r"at (http://\S+/)", line)
            if found:
                self.url = found.group(1)
                return
        self.process.kill()
        raise RuntimeError(f"captioner serve did not start: {''.join(self.output)}")

    def stop(self) -> int:
        """Ctrl-C, as a user stops it; the exit status."""
        self.process.send_signal(2)
        try:
            return self.process.wait(timeout=20)
        finally:
            if self.process.poll() is None:
                self.process.kill()
