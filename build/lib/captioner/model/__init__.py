"""Model: image -> grid of regions -> words, with attention at every word.

    backbones.py      the registry of pretrained CNNs and their (offline) weights
    encoder.py        `Encoder`: images (B, 3, S, S) -> regions (B, L, D), frozen or fine-tuned
    attention.py      Bahdanau attention, keys computed once per image
    decoder.py        `AttentionDecoder`: GRU + attention, one `step`, a packed teacher-forced pass
    caption_model.py  `CaptionModel` = encoder + decoder, `build_model`
    checkpoint.py     one file per model: config, vocabulary, weights (and resume state)
"""
from captioner.model.caption_model import CaptionModel, build_model
from captioner.model.checkpoint import Checkpoint, CheckpointError, load_checkpoint, load_model, save_checkpoint
from captioner.model.decoder import AttentionDecoder, DecoderOutput, Memory
from captioner.model.encoder import Encoder, build_encoder

__all__ = ["AttentionDecoder", "CaptionModel", "Checkpoint", "CheckpointError", "DecoderOutput", "Encoder", "Memory",
           "build_encoder", "build_model", "load_checkpoint", "load_model", "save_checkpoint"]
