"""captioner: image captioning with Bahdanau attention over a pretrained CNN grid and a GRU decoder."""

__version__ = "0.1.0"
