"""Several trained decoders decoding as one (`captioner caption --checkpoint a.pt b.pt`).

Models trained on the same encoder and vocabulary (other seeds, other epochs) share the image's
grid. At every step each member reads the previous word with its own state and memory; the word
distribution is the mean of theirs (log of the mean probability), the attention map the mean of
theirs. An `EnsembleDecoder` offers the methods beam search and sampling use (`memory`,
`init_hidden`, `step`), its state being the members' states side by side.

Shapes: B rows, L regions, V vocabulary, H_i member i's state width.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from captioner.model.decoder import AttentionDecoder, StepOutput
from captioner.model.memory import Memory


@dataclass(frozen=True)
class EnsembleMemory:
    """Each member's memory of the same images."""

    members: tuple[Memory, ...]

    def expand(self, k: int) -> EnsembleMemory:
        return EnsembleMemory(tuple(m.expand(k) for m in self.members))

    def select(self, rows: Tensor) -> EnsembleMemory:
        return EnsembleMemory(tuple(m.select(rows) for m in self.members))

    def select_images(self, images: Tensor, k: int) -> EnsembleMemory:
        return EnsembleMemory(tuple(m.select_images(images, k) for m in self.members))


class EnsembleDecoder(nn.Module):
    """The mean of several decoders' word distributions and attention maps."""

    def __init__(self, decoders: Sequence[AttentionDecoder]) -> None:
        super().__init__()
        self.members = nn.ModuleList(decoders)
        self.grid = decoders[0].grid

    def memory(self, features: Tensor) -> EnsembleMemory:
        """(B, L, D) grids -> each member's memory."""
        return EnsembleMemory(tuple(d.memory(features) for d in self.members))

    def init_hidden(self, memory: EnsembleMemory) -> Tensor:
        """(B, H_1 + ... + H_M): the members' initial states side by side."""
        states = [d.init_hidden(m) for d, m in zip(self.members, memory.members)]
        self._widths = [s.size(-1) for s in states]
        return torch.cat(states, dim=-1)

    @property
    def detects_words(self) -> bool:
        return all(d.detects_words for d in self.members)

    def word_log_probs(self, features: Tensor) -> Tensor:
        """(B, L, D) grids -> (B, V) log of the members' mean detector probability of each word."""
        logp = torch.stack([d.word_log_probs(features) for d in self.members])  # (M, B, V)
        return torch.logsumexp(logp, dim=0) - math.log(len(self.members))

    def step(self, tokens: Tensor, state: Tensor, memory: EnsembleMemory) -> StepOutput:
        """(B,) previous words -> log of the members' mean word probabilities (B, V), mean attention
        (B, L), the new states side by side."""
        outs = [d.step(tokens, s, m) for d, s, m in
                zip(self.members, state.split(self._widths, dim=-1), memory.members)]
        logp = torch.stack([torch.log_softmax(o.logits.float(), dim=-1) for o in outs])  # (M, B, V)
        mean = torch.logsumexp(logp, dim=0) - math.log(len(outs))  # (B, V)
        alpha = torch.stack([o.alpha for o in outs]).mean(0)  # (B, L)
        return StepOutput(mean, alpha, torch.cat([o.hidden for o in outs], dim=-1))
