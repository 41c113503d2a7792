"""The captioning model: an encoder (image -> grid) and an attention decoder (grid -> words).

Shapes: B batch, L = H'·W' regions, D feature width, T tokens, V vocabulary.
"""
from __future__ import annotations

from torch import Tensor, nn

from captioner.config import ModelConfig
from captioner.model.decoder import AttentionDecoder, DecoderOutput
from captioner.model.encoder import Encoder, build_encoder


class CaptionModel(nn.Module):
    """Encoder + decoder. Training from the feature cache uses `decoder` alone."""

    def __init__(self, encoder: Encoder, decoder: AttentionDecoder) -> None:
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder

    def encode(self, images: Tensor) -> Tensor:
        """(B, 3, S, S) normalised images -> (B, L, D) features."""
        return self.encoder(images)

    def forward(self, images: Tensor, tokens: Tensor, lengths: Tensor, rows: Tensor | None = None,
                sampling_prob: float = 0.0, detect: bool | Tensor = True) -> DecoderOutput:
        """Teacher-forced pass from pixels: (N, 3, S, S) distinct images, (B, T + 1) tokens, (B,)
        lengths, (B,) rows (each caption's image) -> the decoder's packed output."""
        return self.decoder(self.encode(images), tokens, lengths, rows, sampling_prob=sampling_prob, detect=detect)


def build_model(cfg: ModelConfig, vocab_size: int, pretrained: bool = True, encoder: Encoder | None = None) -> CaptionModel:
    """Build encoder and decoder; `pretrained=False` skips loading encoder weights (a checkpoint
    follows); `encoder` is one built already (from `cfg.encoder`)."""
    encoder = encoder or build_encoder(cfg.encoder, pretrained=pretrained)
    decoder = AttentionDecoder(vocab_size, encoder.out_dim, cfg.decoder, grid=encoder.grid,
                               block_dim=encoder.block_dim)
    return CaptionModel(encoder, decoder)
